"""What a reward time limit costs per batch: the same rewards scored on threads (no limit) and in the killable
worker processes (``rewards.timeout_seconds``), on the tiny jobs' batch (8 prompts x 8 answers of the sort task).

Usage: ``python bench/reward_limit_overhead.py [BATCHES]``; prints one line per reward and mode: the median
seconds per batch once the workers are up, and the first batch's (which starts them).
"""

from __future__ import annotations

import statistics
import sys
import time

from restage.algorithms.rewards import resolve_reward
from restage.algorithms.scoring import RewardPool
from restage.config.sections import RewardsConfig

ANSWERS = 64


def main(batches: int = 50) -> None:
    prompts = [f"sort {i % 10} {(i * 7) % 10} {(i * 3) % 10} :" for i in range(ANSWERS)]
    answers = [" ".join(sorted(p.split()[1:-1])) for p in prompts]
    ids = list(range(ANSWERS))
    for spec, extra in (("sort", {}), ("format", {"format_pattern": r"[0-9 ]+"})):
        for label, limit in (("threads (no limit)", 0.0), ("processes (timeout_seconds=10)", 10.0)):
            options = RewardsConfig(timeout_seconds=limit, **extra)
            fn = resolve_reward(spec, options)
            with RewardPool(options.workers) as pool:
                seconds = []
                for _ in range(batches):
                    began = time.perf_counter()
                    pool.submit(fn, prompts, answers, ids, None, options).result()
                    seconds.append(time.perf_counter() - began)
            print(f"{spec:7s} {label:32s} {statistics.median(seconds[1:]) * 1e3:8.2f} ms/batch "
                  f"(first batch {seconds[0] * 1e3:7.1f} ms)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 50)
