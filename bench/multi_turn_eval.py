"""Tool-call rate and accuracy of a policy on the calculator task's episodes (issue 31's before/after figures).

    python bench/multi_turn_eval.py MODEL_DIR [--job jobs/grpo_calculator_tiny.yaml] [--prompts 64] [--seed 7 ...]
                                              [--show N]

Runs one episode per prompt and seed (the last ``--prompts`` rows of the job's data, the held-out prompts of
``restage.data.arith``; sampled at the job's temperature, one rank, the job's environment and tools) through
``runtime.step.multi_turn.run_episodes`` and prints one line, pooled over the seeds: the fraction of episodes with a
call that ran, the fraction whose final answer is exactly right (``restage.data.arith.correct``), the mean final
score and turns; ``--show N`` prints the first N episodes first.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from restage.algorithms.base import CallContext
from restage.algorithms.interface import get_algorithm
from restage.config.load import load_config
from restage.data import arith
from restage.data.batch import pack_sequences
from restage.data.tokenizer import load_tokenizer
from restage.layout import Layout, Strategy
from restage.models.hf_checkpoint import load_stage
from restage.runtime.step.evaluation import episode_sums
from restage.runtime.step.multi_turn import play_episodes


def evaluate(model: str, job: str = "jobs/grpo_calculator_tiny.yaml", prompts: int = 64, seeds: tuple[int, ...] = (7,),
             show: int = 0) -> dict[str, float]:
    """The figures of the printed line, pooled over one episode per prompt and seed (each seed's episodes sample
    with their own noise)."""
    cfg = load_config(job)
    cfg = dataclasses.replace(cfg, algo={**cfg.algo, "group_size": 1})
    tokenizer = load_tokenizer(cfg.dataset.tokenizer)
    algo = get_algorithm(cfg.algorithm)
    state = algo.init_state(cfg, tokenizer)
    rows = [json.loads(line)["prompt"] for line in Path(cfg.dataset.path).read_text().splitlines()][-prompts:]
    ids = [[tokenizer.bos_token_id] + tokenizer.encode(p, add_special_tokens=False) for p in rows]
    packed = pack_sequences(ids, key="prompts", ids=list(range(len(ids))))
    module = load_stage(model, Layout((0,), Strategy()), None, 0)
    mfc = state.graph["actor_gen"]
    totals: dict[str, float] = {}
    for seed in seeds:
        records, _ = play_episodes(module, mfc, packed, cfg, state, CallContext(), seed)
        if seed == seeds[0]:
            for record in records[:show]:
                print(" ".join(tokenizer.convert_ids_to_tokens(list(record.ids))))
        # evaluate.episode_sums: the sums run.eval_every logs, the final answer after the last observation
        for key, value in episode_sums(records, tokenizer, arith.correct).items():
            totals[key] = totals.get(key, 0.0) + value / len(rows)
    totals = {k: totals[k] for k in ("accuracy", "tool_call_rate", "final_score", "turns")}
    return {**{k: v / len(seeds) for k, v in totals.items()}, "episodes": len(rows) * len(seeds)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--job", default="jobs/grpo_calculator_tiny.yaml")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--seed", type=int, nargs="+", default=[7], help="one episode per prompt for each seed")
    parser.add_argument("--show", type=int, default=0, help="print this many episodes (their tokens)")
    args = parser.parse_args(argv)
    out = evaluate(args.model, args.job, args.prompts, tuple(args.seed), args.show)
    print(f"{args.model}: tool_call_rate={out['tool_call_rate']:.3f} accuracy={out['accuracy']:.3f} "
          f"final_score={out['final_score']:.3f} turns={out['turns']:.2f} episodes={out['episodes']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
