"""End-to-end RL throughput on this CPU machine: restage's GRPO jobs against TRL's GRPOTrainer, and restage's PPO tiny job.

    python bench/e2e_cpu.py [--json] [--jobs grpo_tiny grpo_256x4] [--steps N] [--warmup 5] [--cores C]
                            [--nproc 1 2] [--repeats 3] [--skip-trl] [--skip-ppo] [--only-async]

First, always: GRPO tiny on 2 ranks in sync and in async mode (``async_comparison``) beside what
``plan.execution=auto`` chooses, as ``grpo_sync_samples_per_s``, ``grpo_async_samples_per_s``, ``planner_choice``
and the predicted rates, and async with partial rollouts at the same lookahead and push interval (staleness one
higher: ``grpo_async_partial_samples_per_s``; ``--only-async``: nothing else).

Two GRPO jobs, each measured against TRL:

* ``grpo_tiny`` (``jobs/grpo_tiny.yaml``): a 64-wide, 2-layer LLaMA, 8 prompts x 8 answers of 7 tokens per step,
  KL 0.01 (a reference pass), two optimizer steps per step: mostly framework overhead. 40 steps by default.
* ``grpo_256x4`` (``jobs/grpo_256x4.yaml``): a 256-wide, 4-layer LLaMA (2.9M parameters), 4 prompts x 4
  answers sampled at temperature 1 up to 64 tokens, stopped at EOS (so lengths spread: a random policy ends
  after about 16 tokens on average), KL 0 (no reference model on either side), one optimizer step per step.
  25 steps by default.

Both sides get the same cores, ``--cores`` (default: every core of the machine, 2 here). restage runs each
job with ``restage run -n NPROC`` for each ``--nproc`` that divides them, with ``run.threads_per_rank`` =
cores / NPROC (on 2 cores: ``-n 1`` with 2 threads and ``-n 2`` with 1 thread per rank; the driver process
only waits), and TRL runs in one process with that many torch threads; ranks x threads per rank = TRL's
threads in every pairing. restage's planner picks the layouts (they are printed). It reads log.h5: samples
(prompts), completions and tokens (prompt + answer tokens of every completion) per second over the steps after
``--warmup``, and where a step's time goes: generation (generate MFCs), inference passes (inference MFCs),
training (train MFCs), data and parameter moves (with any wait for other ranks), and overhead (the rest of the
step's wall time: control messages, logging, building batches), all as rank 0 spends them; and each MFC's span
(first start to last end over its ranks).

TRL's GRPOTrainer runs the same job: the same model directory and tokenizer, prompts, prompts x
completions per generation round, ``max_new_tokens``, temperature (top-k 0, top-p 1 on both sides),
optimizer steps per round (restage's ``minibatches``), KL coefficient (``beta``; 0 loads no reference
model: ``GRPOConfig.beta`` docs, and ``GRPOTrainer.__init__`` sets ``ref_model = None``), clip range,
learning rate, AdamW betas, gradient clip, fp32 and no activation checkpointing (TRL defaults to bf16 and
checkpointing; restage's jobs use neither), and restage's Python sort reward (bench/_trl_grpo.py cites
each setting). It runs in its own venv (bench/.venv-trl, made on first use with ``pip install trl==1.16.0``;
never a restage dependency), one process with ``--cores`` torch threads. Its rate is taken over the rounds
after the warm-up the same way (wall seconds between the end of the last warm-up round and the end of the last
round), and its time is split by timers around GRPOTrainer's own methods (bench/_trl_grpo.py): generation,
reward scoring, the no-grad passes made while scoring (``old_logprobs``: the old-policy log-probs TRL computes
when a round feeds more than one optimizer step, as on grpo_tiny, a pass restage's GRPO does not make since it
takes the sampling log-probs; ``reference_logprobs``: the reference model's, at KL > 0), the training
forward/backward and the optimizer step; the rest is overhead. Both passes are TRL's cost of the job and stay
in its time.

Each job is measured ``--repeats`` times (at least 3), alternating: every restage pairing, then TRL, then again
(restage -n 1, restage -n 2, TRL, restage -n 1, ...). ``speedup_vs_trl`` is the median over the repeats of
restage's samples (prompts) per second over TRL's in the same repeat, for the pairing with the higher median
(every pairing's median is printed and in ``speedup_vs_trl_by_config``). A median of per-repeat ratios rather
than median rate over median rate: the two runs of a repeat run minutes apart at most, so a slow phase of the
shared machine that spans both cancels in their ratio, and the median then drops the repeat where the load hit
one side only; a best-of ratio instead keeps whichever side was luckiest. The best-of ratio (restage's fastest
run over TRL's fastest) stays as ``speedup_vs_trl_best``. Each configuration's figures shown are those of its
median run, with every repeat's rate and load average beside them. The target (issue 29): ``speedup_vs_trl``
>= 1.3 on both jobs. Mean answer lengths are printed for both sides: they do the same work only while their
policies sample answers of about the same length.

Both are steady-state rates: start-up (mpirun, planning, DeepSpeed, TRL's model loading) is reported
apart, as the whole command's wall seconds. The machine's load average is printed: other processes
on a shared 2-core machine change every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
TRL_VENV = ROOT / "bench" / ".venv-trl"
TRL_PINS = ("torch==2.13.0", "trl==1.16.0", "transformers==5.23.0")
RESULTS = ROOT / "results" / "bench-e2e"


@dataclass(frozen=True)
class Job:
    """One GRPO job measured against TRL: its config file and default steps (TRL rounds as many)."""

    name: str
    steps: int


JOBS = {"grpo_tiny": Job("grpo_tiny", steps=40), "grpo_256x4": Job("grpo_256x4", steps=25)}
KINDS = {"generate": "generation", "inference": "inference_passes", "train_step": "training"}
MIN_REPEATS = 3  # the fewest that make a median differ from a mean or a best-of


@dataclass(frozen=True)
class Pairing:
    """restage on ``nproc`` ranks of ``threads`` threads each against TRL on ``nproc * threads`` torch threads."""

    nproc: int
    threads: int

    @property
    def cores(self) -> int:
        return self.nproc * self.threads

    @property
    def key(self) -> str:
        return f"-n {self.nproc} x {self.threads} threads"


def equal_core_pairings(cores: int, nprocs: list[int]) -> list[Pairing]:
    """One pairing per rank count that divides ``cores``, its ranks sharing them evenly."""
    return [Pairing(n, cores // n) for n in nprocs if n > 0 and cores % n == 0]


def run_restage(job: str, nproc: int, steps: int, overrides: list[str], threads: int = 0,
                trial: str = "") -> tuple[Path, float]:
    """One `restage run` (``threads`` per rank, 0: restage's own rule); its trial directory and wall seconds."""
    from restage.config.load import load_config

    trial = trial or f"bench-n{nproc}-t{threads}"
    command = [sys.executable, "-m", "restage.cli", "run", f"jobs/{job}.yaml", "-n", str(nproc), f"trial={trial}",
               f"run.steps={steps}", "run.save_every=0", f"run.threads_per_rank={threads}", f"run.results_dir={RESULTS}",
               "--overwrite", *overrides]
    # restage's own rule sets each rank's threads (the CPU mask split among the ranks): no OMP_NUM_THREADS from here.
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | {"PYTHONPATH": str(ROOT / "src")}
    started = time.time()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return RESULTS / load_config(ROOT / "jobs" / f"{job}.yaml").experiment / trial, time.time() - started


def restage_figures(trial: Path, warmup: int, group_size: int, wall_seconds: float) -> dict:
    """Steady-state rates, the per-MFC seconds and where a step's time goes, from a run's log.h5."""
    from restage.report.log import read_log

    log = read_log(trial)
    steps = log.steps[log.steps["step"] > warmup]  # steps count from 1: the rate runs from the end of step `warmup`
    seconds = float(steps["end_seconds"][-1] - log.steps["end_seconds"][warmup - 1]) if warmup else float(
        steps["end_seconds"][-1] - steps["start_seconds"][0])
    samples, tokens = int(steps["samples"].sum()), int(steps["tokens"].sum())
    measured = set(steps["step"].tolist())
    by_mfc, kinds = {}, {}
    for name in dict.fromkeys(log.mfcs["name"].tolist()):
        rows = log.mfcs[(log.mfcs["name"] == name) & np.isin(log.mfcs["step"], list(measured))]
        per_step = [rows["end_seconds"][rows["step"] == s].max() - rows["start_seconds"][rows["step"] == s].min()
                    for s in measured if (rows["step"] == s).any()]  # async: the last step generates nothing ahead
        by_mfc[name] = float(np.mean(per_step)) if per_step else 0.0
        kinds[name] = str(rows["kind"][0]) if len(rows) else ""
    for kind in ("realloc", "transfer"):
        rows = log.transfers[(log.transfers["kind"] == kind) & np.isin(log.transfers["step"], list(measured))]
        # Rank 0's view: the moves it waits on, in sequence (moves on other ranks overlap with these).
        mine = rows[rows["rank"] == 0]
        by_mfc[kind] = float((mine["end_seconds"] - mine["start_seconds"]).sum() / max(1, len(measured)))
    step_seconds = seconds / len(steps)
    # Where rank 0's step goes (its spans follow one another, so they and the overhead add up to the step);
    # a move's span includes waiting for the other ranks to produce what it moves.
    mine = log.mfcs[(log.mfcs["rank"] == 0) & np.isin(log.mfcs["step"], list(measured))]
    breakdown = {label: float((mine["end_seconds"] - mine["start_seconds"])[mine["kind"] == kind].sum() / len(measured))
                 for kind, label in KINDS.items()}
    breakdown["moves"] = by_mfc["realloc"] + by_mfc["transfer"]
    breakdown["overhead"] = step_seconds - sum(breakdown.values())
    layouts = {m["name"]: _layout_text(m["layout"]) for m in log.schedule["mfcs"]}
    series = log.stat_series()
    answer = next((k for k in series if k.endswith("/answer_tokens")), None)
    return {"steps_measured": len(steps), "seconds": seconds, "samples_per_second": samples / seconds,
            "completions_per_second": samples * group_size / seconds, "tokens_per_second": tokens / seconds,
            "step_seconds": step_seconds, "seconds_per_step": breakdown, "seconds_per_step_by_mfc": by_mfc,
            "answer_tokens_mean": float(np.mean(series[answer][1][warmup:])) if answer else None,
            "layouts": layouts, "reward_last": float(series["actor_train/reward"][1][-1]),
            "command_wall_seconds": wall_seconds}


def _layout_text(layout: dict) -> str:
    mesh = layout["mesh"]
    return f"[{mesh[0]}-{mesh[-1]}] dp{layout['dp']} tp{layout['tp']} pp{layout['pp']}"


def ensure_trl_venv() -> Path:
    python = TRL_VENV / "bin" / "python"
    if not python.is_file():
        subprocess.run([sys.executable, "-m", "venv", str(TRL_VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *TRL_PINS], check=True)
    return python


def run_trl(cfg, rounds: int, warmup: int, threads: int) -> dict:
    """TRL's GRPOTrainer on the GRPO job's sizes; rates and the split of a round's time over the rounds after ``warmup``."""
    python = ensure_trl_venv()
    algo, gen, optim = cfg.algo, cfg.generation, cfg.models["actor"].optim
    args = {"model": str(ROOT / cfg.models["actor"].path), "prompts": str(ROOT / cfg.dataset.path),
            "group_size": int(algo["group_size"]), "prompts_per_step": cfg.run.batch_size,
            "minibatches": int(algo.get("minibatches", 1)), "rounds": rounds,
            "max_new_tokens": gen.max_new_tokens, "temperature": gen.temperature, "top_k": gen.top_k,
            "top_p": gen.top_p, "kl_coef": float(algo["kl_coef"]), "clip_eps": float(algo.get("clip_eps", 0.2)),
            "lr": optim.lr, "weight_decay": optim.weight_decay, "betas": list(optim.betas),
            "max_grad_norm": optim.grad_clip, "seed": cfg.seed, "threads": threads, "output_dir": str(RESULTS / "trl")}
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)
    started = time.time()
    done = subprocess.run([str(python), str(ROOT / "bench" / "_trl_grpo.py"), json.dumps(args)], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    wall = time.time() - started
    if done.returncode != 0:
        raise SystemExit(f"TRL failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    per_round = out["steps_per_round"]
    ends = [s for s in out["steps"] if s["step"] % per_round == 0]  # the last optimizer step of each round
    firsts = [s for s in out["steps"] if s["step"] % per_round == 1 or per_round == 1]  # logs tokens of its round
    measured = len(ends) - warmup
    since = ends[warmup - 1]["end_seconds"] if warmup else out["start_seconds"]
    seconds = ends[-1]["end_seconds"] - since
    tokens = firsts[-1]["num_tokens"] - (firsts[warmup - 1]["num_tokens"] if warmup else 0.0)
    completions = measured * out["completions_per_round"]
    spans: dict[str, float] = {}
    for name, begin, end in out["spans"]:
        if begin >= since:
            spans[name] = spans.get(name, 0.0) + (end - begin) / measured
    rollout = spans.get("rollout", 0.0)
    breakdown = {"generation": spans.get("generation", 0.0), "old_logprobs": spans.get("old_logprobs", 0.0),
                 "reference_logprobs": spans.get("reference_logprobs", 0.0), "rewards": spans.get("rewards", 0.0)}
    breakdown["rollout_other"] = rollout - sum(breakdown.values())
    breakdown["training"] = (spans.get("training_step", 0.0) - rollout + spans.get("grad_clip", 0.0)
                             + spans.get("optimizer", 0.0))
    breakdown["overhead"] = seconds / measured - rollout - breakdown["training"]
    lengths = [s["completions/mean_length"] for s in firsts[warmup:] if "completions/mean_length" in s]
    return {"rounds_measured": measured, "seconds": seconds,
            "samples_per_second": completions / args["group_size"] / seconds,
            "completions_per_second": completions / seconds, "tokens_per_second": tokens / seconds,
            "step_seconds": seconds / measured, "seconds_per_step": breakdown,
            "answer_tokens_mean": float(np.mean(lengths)) if lengths else None,
            "reward_last": firsts[-1].get("reward"), "threads": threads,
            "versions": {k: out[k] for k in ("torch", "transformers", "trl")}, "command_wall_seconds": wall}


def async_comparison(steps: int, warmup: int, group: int) -> dict:
    """GRPO tiny on 2 ranks in sync and async mode, measured back to back, beside what `plan.execution=auto` picks.

    Each mode runs the plan the planner makes for it (sync: the search; async: the best generation/training
    split at the staleness and push interval auto found best), so the measured faster mode can be compared with
    the planner's choice."""
    from restage.config.load import load_config
    from restage.plan.planner import make_plan

    choice = make_plan(load_config("jobs/grpo_tiny.yaml", ["plan.execution=auto"]), with_baselines=False).mode_choice
    assert choice is not None
    k, n = max(choice.staleness, 1), max(choice.push_every, 1)
    trial, wall = run_restage("grpo_tiny", 2, steps, ["plan.execution=sync"], trial="bench-sync")
    sync = restage_figures(trial, warmup, group, wall)
    trial, wall = run_restage("grpo_tiny", 2, steps, ["plan.execution=async", f"plan.staleness={k}",
                                                      f"plan.push_every={n}"], trial="bench-async")
    asynchronous = restage_figures(trial, warmup, group, wall)
    # Partial rollouts at async's lookahead and push interval: staleness k + 1, push every n (lookahead k - n + 1 as
    # whole batches at (k, n); a token may be one version older: docs/runtime.md, "Partial rollouts").
    trial, wall = run_restage("grpo_tiny", 2, steps, ["plan.execution=async", f"plan.staleness={k + 1}",
                                                      f"plan.push_every={n}", "plan.partial_rollouts=true"],
                              trial="bench-async-partial")
    partial = restage_figures(trial, warmup, group, wall)
    measured = {"sync": sync["samples_per_second"], "async": asynchronous["samples_per_second"]}
    faster = max(measured, key=lambda mode: measured[mode])
    return {"grpo_sync_samples_per_s": measured["sync"], "grpo_async_samples_per_s": measured["async"],
            "async_over_sync": measured["async"] / measured["sync"], "planner_choice": choice.chosen,
            "planner_predicted_sync_samples_per_s": choice.sync_samples_per_second,
            "planner_predicted_async_samples_per_s": choice.async_samples_per_second,
            "async_staleness": k, "async_push_every": n, "measured_faster": faster,
            # the chosen mode's measured rate against the faster mode's (the target: within 5%)
            "planner_choice_vs_faster": measured[choice.chosen] / measured[faster],
            "grpo_async_partial_samples_per_s": partial["samples_per_second"],
            "grpo_sync": sync, "grpo_async": asynchronous, "grpo_async_partial": partial}


def _median_run(runs: list[dict]) -> dict:
    """The run with the median samples/s (the lower middle one for an even count), standing for its configuration;
    with every repeat's rate and load, their median and the best."""
    rates = [r["samples_per_second"] for r in runs]
    middle = sorted(range(len(runs)), key=rates.__getitem__)[(len(runs) - 1) // 2]
    return dict(runs[middle]) | {"median_samples_per_second": statistics.median(rates),
                                 "best_samples_per_second": max(rates), "repeats_samples_per_second": rates,
                                 "repeats_load_average_1min_before": [r["load_average_1min_before"] for r in runs]}


def _progress(job: str, side: str, fig: dict) -> None:
    """One line per run on stderr, so a long benchmark's figures so far survive it being stopped."""
    print(f"{job}: {side}: {fig['samples_per_second']:.2f} samples/s at load {fig['load_average_1min_before']:.1f}",
          file=sys.stderr, flush=True)


def measure_job(job: Job, args) -> dict:
    """restage in every equal-core pairing and TRL on one GRPO job, alternating, ``args.repeats`` times; the median
    of the per-repeat ratios as the headline (module docstring)."""
    from restage.config.load import load_config

    cfg = load_config(f"jobs/{job.name}.yaml")
    group = int(cfg.algo["group_size"])
    steps = args.steps or job.steps
    pairings = equal_core_pairings(args.cores, args.nproc)
    ours: dict[str, list[dict]] = {p.key: [] for p in pairings}
    theirs: list[dict] = []
    for _ in range(args.repeats):  # alternating, so slow phases of the machine hit both sides alike
        for p in pairings:
            load = os.getloadavg()[0]
            trial, wall = run_restage(job.name, p.nproc, steps, [], p.threads)
            ours[p.key].append(restage_figures(trial, args.warmup, group, wall) | {"load_average_1min_before": load})
            _progress(job.name, f"restage {p.key}", ours[p.key][-1])
        if not args.skip_trl:
            load = os.getloadavg()[0]
            theirs.append(run_trl(cfg, steps, args.warmup, args.cores) | {"load_average_1min_before": load})
            _progress(job.name, f"TRL {args.cores} threads", theirs[-1])
    out: dict = {"cores": args.cores, "restage": {key: _median_run(runs) for key, runs in ours.items()}}
    if args.skip_trl:
        chosen = max(ours, key=lambda key: out["restage"][key]["median_samples_per_second"])
    else:
        ratios = {key: [a["samples_per_second"] / b["samples_per_second"] for a, b in zip(runs, theirs, strict=True)]
                  for key, runs in ours.items()}
        token_ratios = {key: [a["tokens_per_second"] / b["tokens_per_second"] for a, b in zip(runs, theirs, strict=True)]
                        for key, runs in ours.items()}
        by_config = {key: statistics.median(r) for key, r in ratios.items()}
        chosen = max(by_config, key=by_config.__getitem__)
        out["trl"] = _median_run(theirs)
        out["trl_samples_per_second"] = out["trl"]["median_samples_per_second"]
        out["speedup_vs_trl"] = by_config[chosen]
        out["speedup_vs_trl_repeats"] = ratios[chosen]
        out["speedup_vs_trl_tokens"] = statistics.median(token_ratios[chosen])
        out["speedup_vs_trl_by_config"] = by_config
        out["speedup_vs_trl_best"] = (max(r["samples_per_second"] for runs in ours.values() for r in runs)
                                      / out["trl"]["best_samples_per_second"])
        out["method"] = (f"equal cores ({args.cores}): median over {args.repeats} alternating repeats of restage's "
                         f"samples/s over TRL's in the same repeat; best: fastest restage run over fastest TRL run")
    out["restage_best"] = chosen
    out["restage_samples_per_second"] = out["restage"][chosen]["median_samples_per_second"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--jobs", nargs="+", choices=sorted(JOBS), default=list(JOBS), help="GRPO jobs (default both)")
    # As many restage steps as TRL rounds (each is one generation round and its optimizer steps), so both
    # policies have learnt about as far and their answers have similar lengths (60 steps against 40 rounds
    # gave restage longer answers on the tiny job: 1.39x completions/s but 1.48x tokens/s).
    parser.add_argument("--steps", type=int, default=0, help="restage steps and TRL rounds per job (default: the job's)")
    parser.add_argument("--warmup", type=int, default=5, help="steps / rounds left out of the rates (default 5)")
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1,
                        help="cores each side gets: TRL's torch threads, restage's ranks x threads per rank "
                             "(default: every core)")
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2],
                        help="restage rank counts to measure, each that divides --cores (default 1 2)")
    parser.add_argument("--repeats", type=int, default=MIN_REPEATS,
                        help=f"alternating repeats of restage and TRL, the median ratio the headline (at least "
                             f"{MIN_REPEATS}; default {MIN_REPEATS})")
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--skip-ppo", action="store_true", help="leave out restage's PPO tiny job")
    parser.add_argument("--only-async", action="store_true", help="measure only the sync/async GRPO comparison")
    args = parser.parse_args(argv)
    if args.repeats < MIN_REPEATS:
        parser.error(f"--repeats {args.repeats}: the headline is a median, so at least {MIN_REPEATS}")
    if not equal_core_pairings(args.cores, args.nproc):
        parser.error(f"--nproc {' '.join(map(str, args.nproc))}: none divides --cores {args.cores}")
    os.chdir(ROOT)
    # Libraries imported on the way may log to stdout (DeepSpeed's accelerator notice, through transformers):
    # stdout carries only the result.
    with contextlib.redirect_stdout(sys.stderr):
        result = measure(args)
    print(json.dumps(result, indent=2) if args.json else format_text(result, args))
    return 0


def measure(args) -> dict:
    """Every measurement ``main``'s arguments ask for, as one JSON-able dict."""
    from restage.config.load import load_config
    from restage.demo import ensure_llama_256x4, ensure_tiny_model

    ensure_tiny_model()
    ensure_llama_256x4()
    result: dict = {"machine": {"cpus": os.cpu_count(), "load_average_1min_before": os.getloadavg()[0]}, "jobs": {}}
    tiny = load_config("jobs/grpo_tiny.yaml")
    result.update(async_comparison(args.steps or JOBS["grpo_tiny"].steps, args.warmup, int(tiny.algo["group_size"])))
    for name in [] if args.only_async else args.jobs:
        result["jobs"][name] = measure_job(JOBS[name], args)
    if not args.skip_ppo and not args.only_async:
        result["ppo_tiny"] = {}
        for p in equal_core_pairings(args.cores, args.nproc):
            trial, wall = run_restage("ppo_tiny", p.nproc, args.steps or JOBS["grpo_tiny"].steps, [], p.threads)
            result["ppo_tiny"][p.key] = restage_figures(trial, args.warmup, 1, wall)
    result["machine"]["load_average_1min_after"] = os.getloadavg()[0]
    return result


def _repeats_text(fig: dict) -> str:
    return ("repeats: " + ", ".join(f"{r:.2f}" for r in fig["repeats_samples_per_second"]) + " samples/s at load "
            + ", ".join(f"{a:.1f}" for a in fig["repeats_load_average_1min_before"])
            + f" (median {fig['median_samples_per_second']:.2f}, best {fig['best_samples_per_second']:.2f})")


def _breakdown_text(breakdown: dict) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in breakdown.items())


def _restage_lines(label: str, fig: dict) -> list[str]:
    answer = f", answers {fig['answer_tokens_mean']:.1f} tokens" if fig["answer_tokens_mean"] is not None else ""
    return [f"restage {label}, {fig['steps_measured']} steps: {fig['samples_per_second']:.2f} samples/s, "
            f"{fig['completions_per_second']:.1f} completions/s, {fig['tokens_per_second']:.0f} tokens/s, "
            f"{fig['step_seconds']:.3f} s/step{answer} (command {fig['command_wall_seconds']:.0f} s with start-up)",
            "  layouts: " + ", ".join(f"{k} {v}" for k, v in fig["layouts"].items()),
            "  seconds per step: " + _breakdown_text(fig["seconds_per_step"]),
            "  by MFC: " + _breakdown_text(fig["seconds_per_step_by_mfc"])]


def format_text(result: dict, args) -> str:
    machine = result["machine"]
    lines = [f"e2e CPU throughput ({machine['cpus']} cores, load average {machine['load_average_1min_before']:.1f} "
             f"before, {machine['load_average_1min_after']:.1f} after; steady state after {args.warmup} warm-up steps)"]
    lines.append(f"\nGRPO tiny on 2 ranks: sync {result['grpo_sync_samples_per_s']:.1f} samples/s, async "
                 f"(staleness {result['async_staleness']}, push every {result['async_push_every']}) "
                 f"{result['grpo_async_samples_per_s']:.1f} samples/s ({result['async_over_sync']:.2f}x; target 1.3x); "
                 f"planner chose {result['planner_choice']} (predicted sync "
                 f"{result['planner_predicted_sync_samples_per_s']:.1f}, async "
                 f"{result['planner_predicted_async_samples_per_s'] or 0:.1f} samples/s); its measured rate is "
                 f"{result['planner_choice_vs_faster']:.2f}x the faster mode's")
    lines.append(f"Async with partial rollouts (staleness {result['async_staleness'] + 1}, push every "
                 f"{result['async_push_every']}): "
                 f"{result['grpo_async_partial_samples_per_s']:.1f} samples/s")
    for mode in ("grpo_sync", "grpo_async", "grpo_async_partial"):
        lines += _restage_lines(mode, result[mode])
    for name, job in result["jobs"].items():
        lines.append(f"\n== {name} (equal cores: {job['cores']} for each side; the median run of each shown) ==")
        for key, fig in job["restage"].items():
            lines += _restage_lines(key, fig) + ["  " + _repeats_text(fig)]
        if "trl" in job:
            t = job["trl"]
            answer = f", answers {t['answer_tokens_mean']:.1f} tokens" if t["answer_tokens_mean"] is not None else ""
            lines.append(f"TRL GRPOTrainer {t['versions']['trl']} (1 process, {t['threads']} threads), "
                         f"{t['rounds_measured']} rounds: {t['samples_per_second']:.2f} samples/s, "
                         f"{t['completions_per_second']:.1f} completions/s, {t['tokens_per_second']:.0f} tokens/s, "
                         f"{t['step_seconds']:.3f} s/round{answer} (command {t['command_wall_seconds']:.0f} s)")
            lines.append("  seconds per round: " + _breakdown_text(t["seconds_per_step"]))
            lines.append("  " + _repeats_text(t))
            others = ", ".join(f"{key} {ratio:.2f}x" for key, ratio in job["speedup_vs_trl_by_config"].items())
            lines.append(f"restage ({job['restage_best']}) / TRL ({t['threads']} threads), median of "
                         f"{len(job['speedup_vs_trl_repeats'])} repeats: {job['speedup_vs_trl']:.2f}x samples/s "
                         f"(target >= 1.3; repeats "
                         + ", ".join(f"{r:.2f}" for r in job["speedup_vs_trl_repeats"])
                         + f"), {job['speedup_vs_trl_tokens']:.2f}x tokens/s; every pairing: {others}; "
                         f"best / best {job['speedup_vs_trl_best']:.2f}x")
    for n, fig in result.get("ppo_tiny", {}).items():
        lines += ["", *_restage_lines(f"ppo_tiny {n}", fig)]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
