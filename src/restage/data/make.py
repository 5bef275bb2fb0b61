"""Make the synthetic data sets and tokenizer shipped in ``data/synthetic/``: ``python -m restage.data.make``.

Deterministic (seeded), so re-running reproduces the committed files byte for byte:

* ``prompts.jsonl``    ``{"prompt"}``                        for PPO, GRPO, ReMax, RAFT
* ``sft.jsonl``        ``{"prompt", "answer"}``              the sorted digits
* ``preference.jsonl`` ``{"prompt", "chosen", "rejected"}``  chosen sorted (reward 1), rejected with one
  swap of unequal digits (reward < 1), so "is there a descent" separates them
* ``tokenizer/``       word-level HF tokenizer over the 16-token vocabulary of ``restage.data.tasks``
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from restage.data import tasks
from restage.data.tokenizer import build_word_tokenizer

DEFAULT_DIR = Path("data/synthetic")
SIZES = {"prompts": 1000, "sft": 1500, "preference": 1500}


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def make(out_dir: str | Path = DEFAULT_DIR, seed: int = 0, sizes: dict[str, int] | None = None) -> Path:
    """Write the three JSONL sets and the tokenizer under ``out_dir``; returns ``out_dir``."""
    sizes = {**SIZES, **(sizes or {})}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    prompts = [tasks.make_prompt(tasks.random_digits(rng)) for _ in range(sizes["prompts"])]
    _write_jsonl(out_dir / "prompts.jsonl", [{"prompt": p} for p in prompts])
    sft = []
    for _ in range(sizes["sft"]):
        digits = tasks.random_digits(rng)
        sft.append({"prompt": tasks.make_prompt(digits), "answer": " ".join(sorted(digits))})
    _write_jsonl(out_dir / "sft.jsonl", sft)
    pairs = []
    for _ in range(sizes["preference"]):
        digits = tasks.random_digits(rng)
        best = sorted(digits)
        pairs.append({"prompt": tasks.make_prompt(digits), "chosen": " ".join(best),
                      "rejected": " ".join(tasks.corrupt(best, rng))})
    _write_jsonl(out_dir / "preference.jsonl", pairs)
    build_word_tokenizer(tasks.VOCAB, out_dir / "tokenizer")
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m restage.data.make", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(DEFAULT_DIR), help="output directory (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = make(args.out, args.seed)
    print(f"wrote {', '.join(sorted(p.name for p in out.iterdir()))} under {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
