"""The calculator task of jobs/grpo_calculator_tiny.yaml: multiply a digit by a two-digit number, which the tiny policy
can do only with its calculator tool.

Prompt ``compute 7 * 4 8 :`` (one word per character, for the word-level tokenizer of
``data/arith/tokenizer``); the episode the policy should learn (``environment.name: tool_use_spelled``)::

    <call> 7 * 4 8 </call>                 <- the policy's first turn (ends at </call>; the one tool unnamed)
    <result> 3 3 6 </result>               <- observation: the sandboxed calculator's output
    3 3 6 [EOS]                            <- the policy's final answer

The reward of the final answer is dense, as the sort task's is: 1.0 for the exact product; otherwise half the
fraction of its digits in the right place. ``python -m restage.data.arith`` writes ``data/arith/``.
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


def make(out_dir: str | Path = DEFAULT_DIR, seed: int = 0, size: int = 500) -> Path:
    """Write ``prompts.jsonl`` (a digit 2-9 times a number 12-99) and the word-level tokenizer under ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows = [{"prompt": make_prompt(rng.randint(2, 9), "*", rng.randint(12, 99))} for _ in range(size)]
    (out_dir / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    build_word_tokenizer(VOCAB, out_dir / "tokenizer")
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m restage.data.arith", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(DEFAULT_DIR))
    args = parser.parse_args(argv)
    print(f"wrote {make(args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
