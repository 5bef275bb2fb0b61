"""``python -m restage.runtime.spmd SCHEDULE [--resume]``: the program every rank runs.

Every rank reads the same schedule and walks the same op list each iteration, doing the ops it
takes part in (``schedule.program``). Rank 0 is also the master (``runtime.control.master``): it owns the
data cursor, the log and the decisions to checkpoint and stop, and talks to the others over MPI.
Any exception on any rank aborts the whole job with the rank named (``runtime.control.failure``). Each rank's
heartbeat (``runtime.control.heartbeat``) tells the launcher's watchdog that it lives and what it is doing.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from restage.runtime.control.channels import Control
from restage.runtime.control.failure import abort_on_error
from restage.runtime.control.heartbeat import Heartbeat, heartbeat_dir
from restage.runtime.control.threads import apply_threads, choose_threads, idle_local_ranks
from restage.runtime.dataplane.comm_budget import ranks_per_node
from restage.runtime.store.deepspeed_ops import use_extensions_dir
from restage.schedule.file import Schedule, read_schedule


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m restage.runtime.spmd")
    parser.add_argument("schedule", help="schedule.json written by `restage plan`")
    parser.add_argument("--resume", action="store_true", help="continue from the trial's last checkpoint")
    parser.add_argument("--trial-dir", default="", help="results directory (default: the schedule's directory)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not _has_cuda() else "cuda")
    use_extensions_dir()  # DeepSpeed's JIT builds: restage's per-user, per-version cache (runtime/store/deepspeed_ops.py)
    control = Control()
    trial_dir = Path(args.trial_dir or os.environ.get("RESTAGE_TRIAL_DIR") or Path(args.schedule).resolve().parent)
    # --resume insists on a checkpoint; RESTAGE_RESUME=1 (a requeued SLURM job) takes one if there is one.
    resume = "required" if args.resume else ("if-any" if os.environ.get("RESTAGE_RESUME") == "1" else "")
    heartbeat = Heartbeat(heartbeat_dir(trial_dir), control.rank).start()
    with abort_on_error(control.rank, trial_dir):
        # Before any torch work: each rank uses the cores it may run on, not one thread per core of the node,
        # and a rank the plan leaves without ops leaves its share to those beside it that have some.
        schedule = read_schedule(args.schedule)
        idle = idle_local_ranks(ranks_with_work(schedule), control.rank, ranks_per_node(schedule), schedule.world_size)
        threads = choose_threads(int(schedule.config.get("run", {}).get("threads_per_rank", 0)), idle_local=idle)
        apply_threads(threads)
        print(f"restage: rank {control.rank}: {torch.get_num_threads()} torch thread(s) ({threads.reason})", flush=True)
        heartbeat.doing("start-up: importing the runtime (torch, DeepSpeed)")
        # lazy: the heartbeat runs before the runtime's imports (DeepSpeed: seconds), so a stuck import is seen
        from restage.runtime.step.worker import Worker

        worker = Worker.start(control, args.schedule, trial_dir, resume=resume, heartbeat=heartbeat)
        worker.run()
        worker.close()
    heartbeat.finish()
    return 0


def ranks_with_work(schedule: Schedule) -> set[int]:
    """The ranks that run an op of the iteration or hold a model's home shard (the others only take part in
    control messages)."""
    return ({r for op in schedule.ops() for r in op.ranks} | {r for e in schedule.mfcs for r in e.layout.mesh}
            | {r for m in schedule.models.values() for r in m.home_layout.mesh})


def _has_cuda() -> bool:
    return torch.cuda.is_available()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.exit(code)
