"""Tool-call rate and accuracy of a policy on the calculator task's episodes (issue 31's before/after figures).

    python bench/multi_turn_eval.py MODEL_DIR [--job jobs/grpo_calculator_tiny.yaml] [--prompts 64] [--seed 7]

Runs one episode per prompt (the last ``--prompts`` rows of the job's data, sampled at the job's temperature,
one rank, the job's environment and tools) through ``runtime.multi_turn.run_episodes`` and prints one line:
the fraction of episodes with a call that ran, the fraction whose final answer is exactly right
(``restage.data.arith.correct``), the mean final score and turns.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from restage.algorithms.interface import get_algorithm
from restage.config import load_config
from restage.data import arith
from restage.data.batch import pack_sequences
from restage.data.tokenizer import load_tokenizer
from restage.layout import Layout, Strategy
from restage.models.checkpoint import load_stage
from restage.runtime.multi_turn import run_episodes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--job", default="jobs/grpo_calculator_tiny.yaml")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    cfg = load_config(args.job)
    cfg = dataclasses.replace(cfg, algo={**cfg.algo, "group_size": 1})
    tokenizer = load_tokenizer(cfg.dataset.tokenizer)
    algo = get_algorithm(cfg.algorithm)
    state = algo.init_state(cfg, tokenizer)
    rows = [json.loads(line)["prompt"] for line in Path(cfg.dataset.path).read_text().splitlines()][-args.prompts:]
    ids = [[tokenizer.bos_token_id] + tokenizer.encode(p, add_special_tokens=False) for p in rows]
    prompts = pack_sequences(ids, key="prompts", ids=list(range(len(ids))))
    module = load_stage(args.model, Layout((0,), Strategy()), None, 0)
    result = run_episodes(module, state.graph["actor_gen"], prompts, algo, cfg, state, seed=args.seed)
    batch, start, finals = result.batch, 0, []
    for n in batch.seqlens:
        seq, mask = batch["seqs"][start:start + n].tolist(), batch["prompt_mask"][start:start + n].tolist()
        start += n
        last = max(i for i, m in enumerate(mask) if m)  # the final answer follows the last observation or the prompt
        finals.append(tokenizer.decode(seq[last + 1:], skip_special_tokens=True))
    accuracy = sum(arith.correct(rows, finals)) / len(rows)
    stats = result.stats
    print(f"{args.model}: tool_call_rate={stats['actor_gen/tool_call_rate']:.3f} accuracy={accuracy:.3f} "
          f"final_score={stats.get('actor_gen/final_score', 0.0):.3f} turns={stats['actor_gen/turns']:.2f} "
          f"episodes={len(rows)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
