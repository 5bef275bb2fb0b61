"""How far restage's predictions are from measurements: the one place that holds the numbers, with their sources.

* ``GPU_VALIDATION``: the held-out and untouched sets of ``bench/validation.py`` (issue 30: published, measured RL steps
  of verl, NeMo-Aligner and NeMo-RL and pre-training steps of Megatron-Bridge, systems no constant was fitted on, each
  predicted by restage's estimator under that system's plan; the untouched set's figures are its one prediction).
* ``CPU_VALIDATION``: the held-out plans of ``bench/estimator.py`` and the fresh and third held-out sets of
  ``bench/cpu_unprofiled.py`` (real runs of small PPO jobs on this project's 2-core CPU machine, each
  predicted by the estimator and simulator with the cluster file's constants, as ``restage plan`` predicts).
* ``PROCESS_BASELINES``: the memory a rank process holds before its plan puts anything on the device
  (``bench/process_baseline.py`` and a tiny job's run), which the estimator's per-MFC figures leave out.

The uncertainty band of a prediction is the central ``BAND_QUANTILES`` of the measured / predicted
ratios of the matching set (GPU clusters: ``GPU_VALIDATION``; CPU clusters: ``CPU_VALIDATION``),
quantiles interpolated linearly between the sorted ratios, widened to the prediction itself where both
quantiles fall on one side of it (ratio 1): a band is printed beside its point prediction, so it always
contains it (the CPU set's ratios are all below 1: the estimator over-predicts there, and the band then
runs from the 10% quantile up to the prediction). ``restage plan`` prints it beside the
predicted iteration time and ``restage report`` sets the measured times against it. When the cost
model changes, rerun the commands in ``source`` and replace the checks:
``tests/plan/test_prediction_band_on_cpu.py`` fails while the GPU checks differ from what
``bench/validation.py`` predicts now.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

BAND_QUANTILES = (0.1, 0.9)  # the central 80% of the measured / predicted ratios


@dataclass(frozen=True)
class Check:
    """One measurement set against restage's prediction for the same work."""

    name: str
    predicted_seconds: float
    measured_seconds: float

    @property
    def ratio(self) -> float:
        """measured / predicted: what a prediction is multiplied by to give the measurement."""
        return self.measured_seconds / self.predicted_seconds


@dataclass(frozen=True)
class CheckSet:
    what: str
    source: str  # the command that produced the checks, where and when
    checks: tuple[Check, ...]


@dataclass(frozen=True)
class Band:
    """The measured time a prediction most likely falls in, as ratios to the prediction, and where they come from."""

    low_ratio: float  # min(1, the low quantile): never above the prediction
    high_ratio: float  # max(1, the high quantile): never below it
    points: int
    what: str
    source: str
    quantile_ratios: tuple[float, float] = (0.0, 0.0)  # the quantiles themselves, before widening to 1

    def seconds(self, predicted_seconds: float) -> tuple[float, float]:
        return predicted_seconds * self.low_ratio, predicted_seconds * self.high_ratio

    def describe(self) -> str:
        low, high = (round(100 * q) for q in BAND_QUANTILES)
        q_low, q_high = self.quantile_ratios
        text = (f"x{self.low_ratio:.2f}..x{self.high_ratio:.2f} of the prediction, the {low}% and {high}% quantiles of "
                f"measured/predicted over {self.points} {self.what}")
        if q_high < 1.0:
            text += f", widened up to the prediction (the {high}% quantile is x{q_high:.2f}: the estimator over-predicts)"
        elif q_low > 1.0:
            text += f", widened down to the prediction (the {low}% quantile is x{q_low:.2f}: the estimator under-predicts)"
        return text


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values``, interpolated linearly between the sorted values (position q x (n - 1))."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    below = int(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (position - below) * (ordered[above] - ordered[below])


def band_of(checks: CheckSet) -> Band:
    ratios = [c.ratio for c in checks.checks]
    low_q, high_q = BAND_QUANTILES
    q_low, q_high = quantile(ratios, low_q), quantile(ratios, high_q)
    # Widened to ratio 1 where both quantiles lie on one side: the band must contain its own point prediction.
    return Band(min(1.0, q_low), max(1.0, q_high), len(ratios), checks.what, checks.source, (q_low, q_high))


GPU_VALIDATION = CheckSet(
    what="held-out and untouched published GPU points (bench/validation.py)",
    source="python bench/validation.py --json, 'estimator' predictions of set 'held_out' (docs/validation_2026-11-29.json: "
           "verl's fully-async page, H20, 7B-30B, 16-128 GPUs; NeMo-Aligner's PPO tables, 70B-405B, 96-1,008 GPUs), then "
           "of set 'untouched', predicted once (bench/validation.py --final, docs/validation_untouched_2026-11-29.json: "
           "NeMo-RL's GRPO summary, 8B-671B, 16-512 H100s; Megatron-Bridge's pre-training summary, 8B-405B, 8-1,024 "
           "H100s); each point under its system's plan, unstated settings from the script's DEFAULTS, the estimator "
           "alone, as restage plan predicts; 2026-11-29",
    checks=(
        Check("verl-qwen2.5-7b-dapo-colocate-32gpu", 1764.74, 790.1),
        Check("verl-qwen2.5-7b-dapo-async-16x16", 2472.61, 294.77),
        Check("verl-qwen2.5-7b-dapo-colocate-64gpu", 891.85, 365.28),
        Check("verl-qwen2.5-7b-dapo-async-32x32", 1248.17, 189.26),
        Check("verl-qwen2.5-7b-dapo-colocate-128gpu", 453.71, 356.3),
        Check("verl-qwen2.5-7b-dapo-async-64x64", 629.28, 150.63),
        Check("verl-qwen3-30b-a3b-grpo-colocate-128gpu", 146.68, 497.89),
        Check("verl-qwen3-30b-a3b-grpo-async-96x32", 455.51, 282.75),
        Check("verl-qwen2.5-7b-dapo-colocate-16gpu-10k", 1716.58, 484.623),
        Check("verl-qwen2.5-7b-dapo-async-8x8-10k", 1670.80, 489.953),
        Check("nemo-aligner-llama3-70b-ppo-8x4-nodes", 315.26, 366.7),
        Check("nemo-aligner-llama3-70b-ppo-16x8-nodes", 161.12, 190.4),
        Check("nemo-aligner-llama3-70b-ppo-32x16-nodes", 85.27, 108),
        Check("nemo-aligner-llama3-70b-ppo-64x32-nodes", 47.20, 56.9),
        Check("nemo-aligner-llama3.1-405b-ppo-84x42-nodes", 107.47, 164.6),
        Check("nemo-rl-llama3.1-8b-grpo-16gpu", 57.75, 97.7),
        Check("nemo-rl-llama3.1-8b-grpo-async-16gpu", 93.12, 74.6),
        Check("nemo-rl-deepseek-v3-grpo-256gpu", 30.01, 154),
        Check("nemo-rl-deepseek-v3-grpo-async-512gpu", 22.51, 77.9),
        Check("nemo-rl-qwen3-235b-grpo-128gpu", 204.88, 506),
        Check("nemo-rl-qwen3-235b-grpo-async-256gpu", 151.91, 241),
        Check("nemo-rl-qwen3-30b-a3b-grpo-32gpu", 200.09, 225),
        Check("nemo-rl-qwen3-30b-a3b-grpo-async-32gpu", 85.13, 244),
        Check("nemo-rl-qwen3-32b-grpo-32gpu", 364.91, 393),
        Check("nemo-rl-qwen3-32b-grpo-async-64gpu", 285.42, 215),
        Check("megatron-bridge-llama3-8b-fp8-8gpu", 14.05, 9.070098955089613),
        Check("megatron-bridge-llama3-70b-fp8-64gpu", 29.95, 20.214682294879704),
        Check("megatron-bridge-llama3.1-405b-fp8-1024gpu", 54.15, 39.51125401929261),
        Check("megatron-bridge-gpt-oss-120b-bf16-64gpu", 12.63, 13.669280827632237),
        Check("megatron-bridge-qwen3-30b-a3b-fp8-16gpu", 23.93, 102.52014078998826),
        Check("megatron-bridge-qwen3-235b-a22b-fp8-256gpu", 202.91, 80.2645437844458),
    ),
)

CPU_VALIDATION = CheckSet(
    what="held-out CPU plans (bench/estimator.py, bench/cpu_unprofiled.py's fresh and third sets)",
    source="OMP_NUM_THREADS=1 python bench/estimator.py --both --rounds 1 --steps 10 --nice -19, then bench/estimator.py "
           "--reuse with cluster/local-cpu.yaml holding that day's rates (bench/cpu_rates.py), profile and overheads "
           "(fitted on the calibration set of the same runs): 'evaluation', iteration seconds of the 11 evaluated "
           "plans (another model and job size than the calibration's, no profile: the roofline with its CPU thread "
           "and cache terms, as restage plan predicts); 2026-11-28, the 2-core Zen 4 machine (load average 1.5-1.9); "
           "predicted again (--reuse) on 2026-11-29 by the roofline with its GEMM-rows and weight-read terms and "
           "the block overhead and efficiency of bench/cpu_roofline_fit.py; then the ten jobs of bench/cpu_unprofiled.py's "
           "fresh set, 144-768 wide, fixed and run before that fit and predicted once after it (--set 2026-11-29 "
           "--reuse --json, docs/cpu_check_2026-11-29_fresh.json; its in-band count was taken against the 11 plans "
           "alone, before its own runs joined the set); then the ten jobs of its third set (--set 2026-11-29-b, fixed "
           "after those, run and predicted once by the same roofline, docs/cpu_check_2026-11-29-b_heldout.json; its "
           "in-band count was taken against the 21 points before it)",
    checks=(
        Check("colocated-pp2", 0.4706, 0.4172),
        Check("separated", 0.1975, 0.2661),
        Check("gen-dp2-split", 0.2009, 0.4092),
        Check("gen-dp2-train-tp2", 0.4010, 0.4582),
        Check("gen-tp2-train-dp2", 0.7087, 0.5756),
        Check("critic-tp2", 0.4161, 0.4087),
        Check("train-pp2", 0.3836, 0.3398),
        Check("gen-pp2", 0.4909, 0.4389),
        Check("inference-split", 0.3933, 0.3694),
        Check("trains-apart", 0.1875, 0.1915),
        Check("gen-tp2-train-pp2", 0.7077, 0.6091),
        Check("w144-l8-pp2", 0.9026, 0.8679),
        Check("w224-l5-one-rank", 0.6617, 0.6673),
        Check("w288-l2-gen-tp2", 0.8072, 0.8352),
        Check("w352-l4-apart", 1.2466, 1.1994),
        Check("w416-l3-dp2", 1.3610, 1.7274),
        Check("w480-l2-tp2", 1.3986, 1.9583),
        Check("w544-l3-one-rank", 1.8489, 1.8043),
        Check("w608-l2-dp2", 1.7840, 2.3256),
        Check("w704-l3-apart", 3.4016, 3.0287),
        Check("w768-l2-tp2", 2.6010, 2.7451),
        Check("w176-l4-one-rank", 0.3808, 0.5453),
        Check("w208-l10-pp2", 1.7781, 1.7940),
        Check("w240-l6-dp2", 1.0802, 1.2584),
        Check("w272-l3-gen-tp2", 1.0384, 1.3274),
        Check("w336-l2-tp2", 0.9063, 1.2495),
        Check("w400-l4-one-rank", 1.4010, 1.7754),
        Check("w464-l2-apart", 1.0019, 1.1057),
        Check("w528-l4-dp2", 2.7184, 4.2102),
        Check("w592-l3-tp2", 2.6384, 3.3849),
        Check("w656-l2-one-rank", 1.6794, 1.9543),
    ),
)


# Plans whose blocks were costed from a measured profile, held out from what was fitted. GPU: none measured yet, so such
# plans take the published set's band. CPU: bench/cpu_unprofiled.py's held-out runs predicted with each model's profile
# taken on the same machine (--profiles); the critics' and reward models' heads are not in an LM's profile and fall back
# to the roofline, as they do in every PPO plan.
GPU_PROFILED: CheckSet | None = None
CPU_PROFILED: CheckSet | None = CheckSet(
    what="held-out profiled CPU plans (bench/cpu_unprofiled.py --set 2026-11-29-b --profiles)",
    source="OMP_NUM_THREADS=1 python bench/cpu_unprofiled.py --set 2026-11-29-b --steps 8 --nice -19 --run-only, then "
           "--reuse --profiles results/cpu-unprofiled-2026-11-29-b-profiles --json "
           "(docs/cpu_check_2026-11-29-b_heldout_profiled.json): iteration seconds of its 10 jobs, each model profiled "
           "on the machine (restage profile, one thread) and scaled to the rank's threads (compute.thread_scale, "
           "bbd5fa0, made before the set was predicted); 2026-11-29, the 2-core Zen 4 machine. Before: the first set's "
           "runs (docs/cpu_check_2026-11-28_heldout_profiled.json, band x0.69..x1.00), whose actor training PPO's "
           "early stop cut short and whose one-rank profiles were not scaled",
    checks=(
        Check("w176-l4-one-rank", 0.3538, 0.5453),
        Check("w208-l10-pp2", 1.9139, 1.7940),
        Check("w240-l6-dp2", 1.1626, 1.2584),
        Check("w272-l3-gen-tp2", 1.1217, 1.3274),
        Check("w336-l2-tp2", 0.9794, 1.2495),
        Check("w400-l4-one-rank", 1.4000, 1.7754),
        Check("w464-l2-apart", 1.0064, 1.1057),
        Check("w528-l4-dp2", 2.6826, 4.2102),
        Check("w592-l3-tp2", 2.7638, 3.3849),
        Check("w656-l2-one-rank", 1.5530, 1.9543),
    ),
)


def profiled(sources: Iterable[str]) -> bool:
    """Whether every estimate of a plan was made from a measured profile (sources as ``Estimate.source`` writes them:
    ``roofline``, ``profile:<name>``, or ``profile:<name>+roofline`` where the profile lacked a piece, such as a
    critic's head, which an LM's profile never holds)."""
    sources = list(sources)
    return bool(sources) and all(s.startswith("profile:") for s in sources)


def prediction_band(has_gpus: bool, profiled: bool = False) -> Band:
    """The band for a prediction: GPU clusters and CPU ranks apart, plans estimated from a measured profile apart from
    the roofline's where a held-out set of profiled plans exists (``CPU_PROFILED``; ``GPU_PROFILED`` not yet)."""
    measured = (GPU_PROFILED if has_gpus else CPU_PROFILED) if profiled else None
    return band_of(measured or (GPU_VALIDATION if has_gpus else CPU_VALIDATION))


@dataclass(frozen=True)
class ProcessBaseline:
    """Memory per rank that the runtime's measure reads before the plan puts anything there."""

    bytes: int
    label: str  # a few words for one output line
    what: str
    source: str


PROCESS_BASELINES = {
    # bench/process_baseline.py, stage "nccl", two fresh runs gave the same bytes.
    "gpu": ProcessBaseline(
        1_355_612_160,
        "CUDA context, cuBLAS, one NCCL communicator",
        "CUDA context, cuBLAS workspace, attention kernels and one NCCL communicator (outside PyTorch's allocator "
        "but in the runtime's measure); not measured: DeepSpeed's buffers and more communicators with peers",
        "python bench/process_baseline.py on one NVIDIA H100 80GB HBM3 (driver 580.159.04, torch 2.11.0+cu130, "
        "NCCL 2.28.9, lazy CUDA module loading), 2026-11-26; with CUDA_MODULE_LOADING=EAGER it is 2.31 GiB"),
    # A rank of jobs/ppo_tiny.yaml: peak resident set less the plan's predicted bytes, the mean of the two ranks
    # (448,403,200 and 445,681,664) to three figures.
    "cpu": ProcessBaseline(
        447_000_000,
        "the rank process's resident set: interpreter, libraries, MPI, data",
        "a rank process's resident set: interpreter, torch, DeepSpeed and the runtime's modules (0.28 GiB of it by "
        "bench/process_baseline.py --device cpu), MPI, data and engines",
        "restage run jobs/ppo_tiny.yaml -n 2 run.steps=4, then restage report: peak resident set 451,661,824 and "
        "448,589,824 bytes on ranks 0 and 1, less the plan's 3,258,624 and 2,908,160; torch 2.13.0+cpu, DeepSpeed "
        "0.19.8, 2026-11-26"),
}


def process_baseline(has_gpus: bool) -> ProcessBaseline:
    return PROCESS_BASELINES["gpu" if has_gpus else "cpu"]


def accuracy_of(has_gpus: bool, sources: Iterable[str]) -> tuple[Band, ProcessBaseline]:
    """What ``restage plan`` prints beside a prediction and ``restage report`` sets the run against: the band (the
    profiled plans' where every estimate came from a profile, ``sources`` as the schedule's ``predicted.estimator``)
    and the process baseline of the cluster's kind of device."""
    return prediction_band(has_gpus, profiled(sources)), process_baseline(has_gpus)
