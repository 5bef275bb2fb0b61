"""Achieved fraction of peak FLOP/s of a GEMM, by its per-rank shape.

A large well-shaped bf16 GEMM reaches at most the device's maximum achievable matmul FLOP/s (MAMF,
``MAMF_EFFICIENCY``, measured: stas00/ml-engineering, compute/accelerator/README.md, "Maximum Achievable
Matmul FLOPS comparison table": A100-SXM 267.9 of 312 TFLOP/s = 0.859 at 6912x16384x2048, H100-SXM
792.1 of 989 = 0.801 at 6144x17920x2816), a short burst. The cluster file's ``compute_efficiency`` is what
sustained training passes reach at that shape: MAMF times a factor fitted on published training
measurements (``bench/calibration.py --fit``; clocks under sustained power draw, kernel gaps). A smaller dimension fills fewer
output tiles per wave of SMs and gives each tile a shorter K loop, so efficiency falls: each of M, N, K
contributes a factor ``d / (d + half)``, normalised to 1 at the measured best shape. This is what makes
the narrow per-rank GEMMs of high TP slow. ``half`` is one 128-wide output tile for the weight
dimensions (N, K: ``HALF_EFFICIENCY_DIM``) and 16 for the rows (M: ``HALF_EFFICIENCY_ROWS``, the
smallest tensor-core MMA tile, m16n8k16 in the PTX ISA: cuBLAS runs skinny decoding GEMMs with such
tiles, so a GEMM of one row computes as if it had about 16 and stays memory-bound). Both are this
project's assumptions, not measurements; a profile (``restage profile``) replaces the whole curve.
"""

from __future__ import annotations

from restage.cluster import ClusterSpec

HALF_EFFICIENCY_DIM = 128  # elements of N and K; assumption (one tensor-core output tile), see the module docstring
HALF_EFFICIENCY_ROWS = 16  # rows (M); assumption (the smallest MMA tile)
# The shapes at which the MAMF figures were measured (M, N, K), per cluster device family. H200: the H100's figures,
# an assumption (the same GH100 die, SM count and clocks; no published H200 MAMF; only the HBM differs).
MAMF_EFFICIENCY = {"A100": 267.9 / 312, "A800": 267.9 / 312, "H100": 792.1 / 989, "H200": 792.1 / 989}
MAMF_SHAPES = {"A100": (6912, 16384, 2048), "A800": (6912, 16384, 2048), "H100": (6144, 17920, 2816),
               "H200": (6144, 17920, 2816)}
_DEFAULT_SHAPE = (8192, 8192, 8192)
# A CPU cluster's ``compute_efficiency`` is the rate of many rows (square GEMMs of 256-1024 in ``bench/cpu_rates.py``,
# or a block's GEMMs refitted by ``bench/cpu_roofline_fit.py``): the rows factor is 1 at this many. A CPU's BLAS is
# not tile-quantised in N and K (a GEMM of 128 x 128 weights runs within 10% of a 1024 x 1024 one on this project's
# machines), so only the rows count, with the cluster's ``gemm_half_rows``.
CPU_REFERENCE_ROWS = 1024


def _dim_factor(dim: float, half: float = HALF_EFFICIENCY_DIM) -> float:
    return dim / (dim + half)


def mamf_efficiency(cluster: ClusterSpec) -> float | None:
    """The measured MAMF fraction of peak of the cluster's device, if known."""
    for family, efficiency in MAMF_EFFICIENCY.items():
        if family in cluster.device:
            return efficiency
    return None


def mamf_shape(cluster: ClusterSpec) -> tuple[int, int, int]:
    """The GEMM shape at which the cluster's ``compute_efficiency`` was measured."""
    for family, shape in MAMF_SHAPES.items():
        if family in cluster.device:
            return shape
    return _DEFAULT_SHAPE


def gemm_efficiency(cluster: ClusterSpec, rows: float, cols: float, depth: float) -> float:
    """Fraction of peak FLOP/s a (rows x depth) @ (depth x cols) GEMM reaches: ``compute_efficiency`` at the
    measured shape, lower for smaller dimensions, never above it."""
    if not cluster.has_gpus:
        half = cluster.gemm_half_rows
        if not half:
            return cluster.compute_efficiency
        factor = _dim_factor(max(rows, 1.0), half) / _dim_factor(CPU_REFERENCE_ROWS, half)
        return cluster.compute_efficiency * min(1.0, factor)
    m, n, k = mamf_shape(cluster)
    reference = _dim_factor(m, HALF_EFFICIENCY_ROWS) * _dim_factor(n) * _dim_factor(k)
    shape = _dim_factor(max(rows, 1.0), HALF_EFFICIENCY_ROWS) * _dim_factor(max(cols, 1.0)) * _dim_factor(max(depth, 1.0))
    return cluster.compute_efficiency * min(1.0, shape / reference)
