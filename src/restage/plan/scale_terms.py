"""What a many-GPU RL step costs beyond one rank's estimate (issue 30 item 2): three terms, each with its unit.

The estimator (``estimator.py``) prices one rank of one MFC: its kernels, its collectives as if nothing overlapped,
its fixed host costs. Three things it leaves out grow with the cluster rather than with the work, and this module
adds them to an estimate from outside, so every plan the search ranks keeps its estimator figure and a check
against published measurements (``bench/validation.py``) can switch each term on and off:

* ``overlap`` (a fraction, 0..1): the share of a train step's ZeRO collectives (ZeRO-3's parameter gathers, the
  gradient reduction over dp) hidden under its compute. DeepSpeed overlaps both (``overlap_comm``,
  ``stage3_prefetch_bucket_size``) and FSDP prefetches the next unit's gather (``forward_prefetch`` /
  ``backward_prefetch``); restage's estimator counts them in full. The hidden seconds are ``overlap x min(comm,
  compute)``: no overlap can hide more than the compute it runs under.
* ``straggler_sigma`` (relative spread, dimensionless): each rank's time for a synchronised step varies
  (clocks, thermals, network contention, data); a step that ends in a collective waits for the slowest of its
  ``n`` ranks. With ranks' times spread normally with relative deviation sigma, the expected slowest is about
  ``1 + sigma x sqrt(2 ln n)`` times the mean (the leading term of the expected maximum of n normal draws).
* the longest answer's tail (tokens, no constant): a generation batch ends with its longest answer. Where a source
  gives the mean answer length, answers are taken as exponentially distributed about it, capped at the maximum
  length; the longest of ``n`` is then ``min(cap, mean x H_n)`` (``H_n`` the n-th harmonic number, the expected
  maximum of n unit exponentials), and the batch decodes the tokens past the mean at the few-sequence rate.

The two constants are fitted on ``bench/validation.py``'s fit set only (``fit_terms`` there); the defaults here
are the terms off.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

COMM_PARTS = ("zero3_gather_seconds", "dp_comm_seconds")  # the estimate's ZeRO collectives (pass_cost.train_cost)


@dataclass(frozen=True)
class ScaleTerms:
    """The terms' constants: ``overlap`` (fraction of ZeRO collectives hidden), ``straggler_sigma`` (relative
    spread of a rank's step time) and ``tail`` (whether generation pays the longest answer)."""

    overlap: float = 0.0
    straggler_sigma: float = 0.0
    tail: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"overlap {self.overlap} is a fraction: use a value in [0, 1]")
        if self.straggler_sigma < 0.0:
            raise ValueError(f"straggler_sigma {self.straggler_sigma} is a spread: use a value >= 0")


def hidden_seconds(parts: dict[str, float], overlap: float) -> float:
    """Seconds of a train step's ZeRO collectives hidden under its compute (``parts``: an estimate's breakdown)."""
    comm = sum(parts.get(name, 0.0) for name in COMM_PARTS)
    return overlap * min(comm, parts.get("compute_seconds", 0.0))


def slowest_rank_factor(ranks: int, sigma: float) -> float:
    """Expected slowest of ``ranks`` ranks' step times over their mean: ``1 + sigma x sqrt(2 ln ranks)``."""
    return 1.0 + sigma * math.sqrt(2.0 * math.log(ranks)) if ranks > 1 else 1.0


def harmonic(n: int) -> float:
    """H_n = 1 + 1/2 + ... + 1/n (summed below 1,000, else ln n + Euler's constant + 1/2n - 1/12n^2)."""
    if n < 1000:
        return sum(1.0 / k for k in range(1, n + 1))
    return math.log(n) + 0.5772156649015329 + 1.0 / (2 * n) - 1.0 / (12 * n * n)


def longest_answer(mean_tokens: float, cap_tokens: int, answers: int) -> float:
    """Expected longest of ``answers`` exponentially distributed answer lengths of mean ``mean_tokens``, capped."""
    if mean_tokens <= 0 or answers < 1:
        raise ValueError(f"longest_answer needs a positive mean and at least one answer (got {mean_tokens}, {answers})")
    return min(float(cap_tokens), mean_tokens * harmonic(answers))


def train_seconds(seconds: float, parts: dict[str, float], ranks: int, terms: ScaleTerms) -> float:
    """A train step's estimated ``seconds`` with the overlap and the slowest of ``ranks`` ranks applied."""
    return (seconds - hidden_seconds(parts, terms.overlap)) * slowest_rank_factor(ranks, terms.straggler_sigma)
