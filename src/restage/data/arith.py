"""The calculator task of jobs/grpo_calculator_tiny.yaml: multiply a digit by a two-digit number, which the tiny policy
can do only with its calculator tool.

Prompt ``compute 7 * 4 8 :`` (one word per character, for the word-level tokenizer of
``data/arith/tokenizer``); the episode the policy should learn (``environment.name: tool_use_spelled``)::

    <call> 7 * 4 8 </call>                 <- the policy's first turn (ends at </call>; the one tool unnamed)
    <result> 3 3 6 </result>               <- observation: the sandboxed calculator's output
    3 3 6 [EOS]                            <- the policy's final answer

The reward of the final answer is dense, as the sort task's is: 1.0 for the exact product; otherwise half the
fraction of its digits in the right place. ``python -m restage.data.arith`` writes ``data/arith/``: ``prompts.jsonl``
(the RL prompts; its last ``VALIDATION`` rows are the held-out prompts of ``bench/multi_turn_eval.py``) and
``sft.jsonl``, a few demonstrated episodes (the SFT warm start of jobs/sft_calculator_tiny.yaml) whose prompts are
none of the held-out ones; each is ``{"prompt", "answer"}`` with the answer as its three turns, the tool's turn
taking no loss (``data/chat.py``).
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Sequence
from pathlib import Path

from restage.data.tokenizer import build_word_tokenizer

TASK_WORD, END_OF_PROMPT = "compute", ":"
DIGITS = tuple("0123456789")
MARKERS = ("<call>", "calculator", "</call>", "<result>", "</result>")
SPECIAL_TOKENS = ("[PAD]", "[BOS]", "[EOS]", "[UNK]")
# 24 tokens: splits evenly for TP up to 8.
VOCAB = SPECIAL_TOKENS + DIGITS + ("+", "-", "*", TASK_WORD, END_OF_PROMPT) + MARKERS
DEFAULT_DIR = Path("data/arith")
VALIDATION = 64  # the last rows of prompts.jsonl: bench/multi_turn_eval.py's prompts, never demonstrated
DEMOS = 256  # sft.jsonl's episodes, of the 704 prompts there are: few SFT steps (jobs/sft_calculator_tiny.yaml) keep the start weak


def make_prompt(a: int, op: str, b: int) -> str:
    return " ".join((TASK_WORD, *str(a), op, *str(b), END_OF_PROMPT))


def target(prompt: str) -> str:
    """The right answer's digits, spelled (``3 3 6``); '' when the prompt is not one of this task's."""
    words = prompt.split()
    if TASK_WORD not in words or END_OF_PROMPT not in words:
        return ""
    body = "".join(words[words.index(TASK_WORD) + 1:words.index(END_OF_PROMPT)])
    for op, fn in (("*", lambda x, y: x * y), ("+", lambda x, y: x + y), ("-", lambda x, y: x - y)):
        if op in body:
            left, _, right = body.partition(op)
            if left.isdigit() and right.isdigit():
                return " ".join(str(fn(int(left), int(right))))
    return ""


def score(prompt: str, answer: str) -> float:
    want, got = target(prompt).split(), answer.split()
    if not want:
        return 0.0
    if got == want:
        return 1.0
    return 0.5 * sum(w == g for w, g in zip(want, got)) / max(len(want), len(got))


def reward(prompts: Sequence[str], answers: Sequence[str]) -> list[float]:
    """The task's reward (``reward_fn: restage.data.arith:reward``)."""
    return [score(p, a) for p, a in zip(prompts, answers)]


def correct(prompts: Sequence[str], answers: Sequence[str]) -> list[bool]:
    return [score(p, a) == 1.0 for p, a in zip(prompts, answers)]


def demonstration(prompt: str) -> list[dict]:
    """The ideal episode of ``prompt`` as turns (SFT's multi-turn answer): the call, the tool's output, the answer."""
    words = prompt.split()
    expression, product = " ".join(words[words.index(TASK_WORD) + 1:words.index(END_OF_PROMPT)]), target(prompt)
    return [{"role": "assistant", "content": f"<call> {expression} </call>"},
            {"role": "tool", "content": f"<result> {product} </result>"},
            {"role": "assistant", "content": product}]


def make(out_dir: str | Path = DEFAULT_DIR, seed: int = 0, size: int = 500, demos: int = DEMOS) -> Path:
    """Write ``prompts.jsonl`` (a digit 2-9 times a number 12-99), ``sft.jsonl`` (``demos`` demonstrated episodes of
    distinct prompts outside the last ``VALIDATION`` rows of prompts.jsonl) and the word-level tokenizer under
    ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows = [{"prompt": make_prompt(rng.randint(2, 9), "*", rng.randint(12, 99))} for _ in range(size)]
    (out_dir / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    held_out = {r["prompt"] for r in rows[-VALIDATION:]}
    pool = [p for p in (make_prompt(a, "*", b) for a in range(2, 10) for b in range(12, 100)) if p not in held_out]
    picked = random.Random(seed + 1).sample(pool, demos)  # its own stream: prompts.jsonl stays as it was
    (out_dir / "sft.jsonl").write_text("".join(json.dumps({"prompt": p, "answer": demonstration(p)}) + "\n"
                                               for p in picked))
    build_word_tokenizer(VOCAB, out_dir / "tokenizer")
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m restage.data.arith", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(DEFAULT_DIR))
    parser.add_argument("--demos", type=int, default=DEMOS, help="episodes in sft.jsonl")
    args = parser.parse_args(argv)
    print(f"wrote {make(args.out, demos=args.demos)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
