"""A trivial SPMD program that exercises the launch path the way the runtime will use it.

``python -m restage.launch.rank restage.launch.selftest SCHEDULE`` on every rank (the schedule
path is ignored; the config comes from $RESTAGE_CONFIG): join MPI (mpi4py) and torch.distributed
(gloo, from the rendezvous the launcher gives), then for each of ``run.steps`` steps all-reduce
``(rank + 1) * step`` over both, sleep ``algo.selftest_sleep_seconds``, and let the master
checkpoint the running sums every ``run.save_every`` steps (every step when 0);
``algo.selftest_fail_rank`` / ``selftest_fail_step`` make that rank raise at that step. It honours the
resume and preemption contract of ``restage.launch.job`` exactly as the runtime must:
RESTAGE_RESUME=1 continues from the newest whole checkpoint, and the PREEMPT file (checked by
the master, the decision broadcast over MPI) makes every rank stop after checkpointing.

Outputs in the trial directory: ``log.h5`` (the runtime's HDF5 log, ``restage.report.log``: one
``steps`` row and the two sums as ``stats`` per step, flushed by the master), ``selftest.json``
(the result, written at the end) and ``checkpoints/step-N/``.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from mpi4py import MPI

from restage.config.load import load_config
from restage.launch.trial import write_json_atomic
from restage.report.log_writer import LogWriter
from restage.runtime.checkpoint import checkpoint_dir
from restage.runtime.control.failure import abort_on_error


def _load_state(trial_dir: Path) -> dict:
    path = checkpoint_dir.latest(trial_dir)
    if path is None:
        return {"step": 0, "sum_torch": 0, "sum_mpi": 0, "resumed_from": None}
    state = json.loads((path / "state.json").read_text())
    return {**state, "resumed_from": state["step"]}


def _save(trial_dir: Path, state: dict, keep: int) -> None:
    partial = checkpoint_dir.begin(trial_dir, state["step"])
    (partial / "state.json").write_text(json.dumps({k: state[k] for k in ("step", "sum_torch", "sum_mpi")}))
    checkpoint_dir.commit(trial_dir, state["step"], {"program": "restage.launch.selftest"}, keep)


def main() -> int:
    with abort_on_error(MPI.COMM_WORLD.Get_rank(), os.environ["RESTAGE_TRIAL_DIR"]):
        return _run(MPI.COMM_WORLD)


def _run(comm) -> int:
    rank, world = comm.Get_rank(), comm.Get_size()
    if (rank, world) != (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])):
        raise RuntimeError(f"MPI says rank {rank}/{world}, the launcher said {os.environ['RANK']}/{os.environ['WORLD_SIZE']}")
    cfg = load_config(os.environ["RESTAGE_CONFIG"])
    trial_dir = Path(os.environ["RESTAGE_TRIAL_DIR"])
    preempt_file = Path(os.environ["RESTAGE_PREEMPT_FILE"])
    sleep_seconds = float(cfg.algo.get("selftest_sleep_seconds", 0.0))
    save_every = cfg.run.save_every or 1
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                            rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    placements = comm.gather({"rank": rank, "host": socket.gethostname(), "local_rank": int(os.environ["LOCAL_RANK"]),
                              "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}, root=0)
    resume = os.environ.get("RESTAGE_RESUME") == "1"
    state = comm.bcast(_load_state(trial_dir) if rank == 0 and resume else None, root=0) or \
        {"step": 0, "sum_torch": 0, "sum_mpi": 0, "resumed_from": None}
    log = None
    if rank == 0:
        log = LogWriter(trial_dir, world_size=world, config=cfg.to_yaml(), dtype="int64",
                        resume_step=state["step"] if resume else None, overwrite=not resume)
    stopped = False
    while state["step"] < cfg.run.steps:
        step = state["step"] + 1
        start_seconds = time.time()
        value = torch.tensor([(rank + 1) * step], dtype=torch.int64)
        dist.all_reduce(value)
        state["sum_torch"] += int(value.item())
        state["sum_mpi"] += comm.allreduce((rank + 1) * step)
        state["step"] = step
        if (rank, step) == (cfg.algo.get("selftest_fail_rank"), cfg.algo.get("selftest_fail_step")):
            raise RuntimeError(f"selftest failure injected at step {step}")
        time.sleep(sleep_seconds)
        # The master decides; everyone follows, so all ranks stop after the same step.
        stop = comm.bcast(preempt_file.exists() if rank == 0 else None, root=0)
        if rank == 0:
            assert log is not None  # rank 0 made it
            log.stats(step, {"sum_torch": state["sum_torch"], "sum_mpi": state["sum_mpi"]})
            log.end_step(step, start_seconds, time.time(), samples=world, tokens=0)
            if step % save_every == 0 or stop or step == cfg.run.steps:
                _save(trial_dir, state, cfg.run.keep_checkpoints)
        comm.Barrier()
        if stop and step < cfg.run.steps:
            stopped = True
            break
    if rank == 0:
        assert log is not None  # rank 0 made it
        if stopped:
            log.abort()  # flushed, but not marked closed: the trial is not finished
            print(f"selftest: preempted after step {state['step']}; checkpoint written", flush=True)
        else:
            log.close()
            write_json_atomic(trial_dir / "selftest.json", {
                "world_size": world, "steps": state["step"], "sum_torch": state["sum_torch"], "sum_mpi": state["sum_mpi"],
                "resumed_from": state["resumed_from"], "placements": placements,
                "rendezvous": f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"})
            print(f"selftest: {world} ranks, {state['step']} steps, sum {state['sum_torch']}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
