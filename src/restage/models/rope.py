"""Rotary position embeddings: the default RoPE and the scaled variants HF configs name.

``rope_from_hf`` reads a llama-family ``config.json`` (the ``rope_scaling`` dict of older configs or
transformers 5's ``rope_parameters``, which also carries ``rope_theta``); ``inv_frequencies`` gives the
frequencies transformers' rotary embedding uses for it, ``rope_cos_sin`` the cos / sin tables and ``rope_tables``
them as the decoder applies them (once per forward, to queries and keys together).

Supported ``rope_type``s, all static (one set of frequencies for every position):

* ``default``: ``theta ** (-2i / head_dim)``.
* ``linear``: the default frequencies divided by ``factor`` (position interpolation).
* ``llama3`` (Llama 3.1 to 3.3): wavelengths shorter than ``original_max_position_embeddings /
  high_freq_factor`` are kept, those longer than ``original / low_freq_factor`` are divided by ``factor``,
  and the band between is blended linearly in ``original / wavelength``.
* ``yarn``: per-frequency blend of interpolated (``/ factor``) and original frequencies over a ramp set by
  ``beta_fast`` / ``beta_slow``, and cos / sin multiplied by ``attention_factor`` (so attention logits by its
  square).
* ``dynamic`` (NTK): transformers rescales theta only once a sequence passes ``max_position_embeddings``;
  below that its frequencies are the default ones. restage refuses every sequence longer than
  ``max_position_embeddings`` (``generation.generate``, ``data.datasets.check_positions``), so it uses the
  default frequencies, exactly what transformers uses at those lengths. Lengths past it, where the
  frequencies would depend on the longest sequence of the batch (which packing and KV-cache decoding
  change), are never run.

Anything else (``longrope``, ``partial_rotary_factor`` < 1, ...) is refused with one line naming the
supported types.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal, assert_never, get_args

import torch
from torch.types import Device

from restage.errors import CheckpointError

ScaledRopeType = Literal["linear", "dynamic", "llama3", "yarn"]
RopeType = Literal["default", ScaledRopeType]
ROPE_TYPES: tuple[RopeType, ...] = ("default", *get_args(ScaledRopeType))
DEFAULT_THETA = 10000.0  # transformers' default_theta, used when a config names none


@dataclass(frozen=True)
class RopeScaling:
    """A scaled RoPE (``rope_type`` other than ``default``), its keys resolved as transformers resolves them."""

    rope_type: ScaledRopeType
    factor: float
    original_max_positions: int = 0  # llama3, yarn: the pre-training context length
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn: round the ramp's ends to whole dimensions
    attention_factor: float = 1.0  # yarn: multiplies cos and sin

    def to_hf(self) -> dict[str, Any]:
        """The ``rope_parameters`` keys (but ``rope_theta``) transformers reads back to the same frequencies."""
        out: dict[str, Any] = {"rope_type": self.rope_type, "factor": self.factor}
        match self.rope_type:
            case "llama3":
                out.update(low_freq_factor=self.low_freq_factor, high_freq_factor=self.high_freq_factor,
                           original_max_position_embeddings=self.original_max_positions)
            case "yarn":
                out.update(original_max_position_embeddings=self.original_max_positions, beta_fast=self.beta_fast,
                           beta_slow=self.beta_slow, truncate=self.truncate, attention_factor=self.attention_factor)
            case "linear" | "dynamic":
                pass
            case unknown:
                assert_never(unknown)
        return out

    @classmethod
    def from_json(cls, data: RopeScaling | dict[str, Any] | None) -> RopeScaling | None:
        return cls(**data) if isinstance(data, dict) else data


def rope_to_hf(theta: float, scaling: RopeScaling | None) -> dict[str, Any]:
    """A ``rope_parameters`` dict for ``config.json``."""
    return {**(scaling.to_hf() if scaling else {"rope_type": "default"}), "rope_theta": theta}


def rope_from_hf(hf: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, scaling)`` of a llama-family HF config dict; raise CheckpointError saying what to change."""
    # transformers takes rope_scaling over rope_parameters, and the dict's own rope_theta over the top-level one.
    rope = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    theta = float(rope.get("rope_theta") or hf.get("rope_theta") or DEFAULT_THETA)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    kind = _ROPE_TYPE_OF.get(str(rope_type))
    if kind is None:
        raise CheckpointError(f"{source}: rope type {rope_type!r} is not supported; use one of {', '.join(ROPE_TYPES)} "
                              "(rope_scaling / rope_parameters in config.json)")
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise CheckpointError(f"{source}: partial_rotary_factor={partial} is not supported; only RoPE over the whole "
                              "head (1.0)")
    match kind:
        case "default":
            return theta, None
        case "linear" | "dynamic" | "llama3" | "yarn":
            return theta, _scaling(kind, rope, hf, source)
        case unknown:
            assert_never(unknown)


_ROPE_TYPE_OF: dict[str, RopeType] = {t: t for t in ROPE_TYPES}  # a config's string -> the checked kind


def _scaling(kind: ScaledRopeType, rope: dict[str, Any], hf: dict[str, Any], source: str) -> RopeScaling:
    """The scaled RoPE a config's ``rope`` dict describes (``kind`` is its checked ``rope_type``)."""
    max_positions = hf.get("max_position_embeddings", 2048)
    original = int(hf.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
                   or max_positions)
    try:
        match kind:
            case "linear" | "dynamic":
                return RopeScaling(kind, float(rope["factor"]))
            case "llama3":
                return RopeScaling("llama3", float(rope["factor"]), original,
                                   low_freq_factor=float(rope["low_freq_factor"]),
                                   high_freq_factor=float(rope["high_freq_factor"]))
            case "yarn":
                pass
            case unknown:
                assert_never(unknown)
    except KeyError as missing:
        raise CheckpointError(f"{source}: rope type {kind!r} needs {missing} in rope_scaling / rope_parameters; "
                              "add it") from None
    factor = float(rope.get("factor") or max_positions / original)
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else _yarn_mscale(factor, 1.0))
    return RopeScaling("yarn", factor, original, beta_fast=float(rope.get("beta_fast") or 32),
                       beta_slow=float(rope.get("beta_slow") or 1), truncate=bool(rope.get("truncate", True)),
                       attention_factor=float(attention_factor))


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@lru_cache(maxsize=64)
def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None,
                    device: Device = None) -> torch.Tensor:
    """``[head_dim / 2]`` fp32 inverse frequencies on ``device`` (cached: one copy to the device, not one a call)."""
    return _inv_frequencies(head_dim, theta, scaling).to(device)


def _inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    base = 1.0 / theta**exponents
    if scaling is None:
        return base
    match scaling.rope_type:
        case "dynamic":  # the default frequencies at every length restage runs (see the module's docstring)
            return base
        case "linear":
            return base / scaling.factor
        case "llama3":
            return _llama3(base, scaling)
        case "yarn":
            return _yarn(head_dim, theta, exponents, scaling)
        case unknown:
            assert_never(unknown)


def _llama3(base: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    wavelength = 2 * math.pi / base
    long_wave = s.original_max_positions / s.low_freq_factor  # longer: fully interpolated
    short_wave = s.original_max_positions / s.high_freq_factor  # shorter: kept
    scaled = torch.where(wavelength > long_wave, base / s.factor, base)
    # Between the two: blend of interpolated and kept, linear in the rotations the old context holds.
    blend = (s.original_max_positions / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    mixed = (1 - blend) * scaled / s.factor + blend * scaled
    between = (wavelength >= short_wave) & (wavelength <= long_wave)
    return torch.where(between, mixed, scaled)


def _yarn(head_dim: int, theta: float, exponents: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    def dimension_of(rotations: float) -> float:
        """The (fractional) dimension whose wavelength fits ``rotations`` times into the original context."""
        return head_dim * math.log(s.original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension_of(s.beta_fast), dimension_of(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers does, so the ramp is a step rather than a division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    wavelength_scale = theta**exponents
    kept, interpolated = 1.0 / wavelength_scale, 1.0 / (s.factor * wavelength_scale)
    keep = 1 - ramp  # 1 for the fast (short-wavelength) dimensions, 0 for the slow ones
    return interpolated * (1 - keep) + kept * keep


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                 scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, head_dim]`` cos and sin of the rotary embedding (computed in fp32, then cast)."""
    inv_freq = inv_frequencies(head_dim, theta, scaling, positions.device)
    freqs = positions.float().unsqueeze(-1) * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)
    cos, sin = angles.cos(), angles.sin()
    if scaling is not None and scaling.attention_factor != 1.0:
        cos, sin = cos * scaling.attention_factor, sin * scaling.attention_factor
    return cos.to(dtype), sin.to(dtype)


@dataclass(frozen=True)
class RopeTables:
    """What every layer of one forward applies: ``cos`` and ``signed_sin`` ``[T, 1, D]``, the sine of the first
    half negated (so the rotation needs no negation of ``x``). Made once per forward, not per layer and head set."""

    cos: torch.Tensor
    signed_sin: torch.Tensor


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                scaling: RopeScaling | None = None) -> RopeTables:
    """``rope_cos_sin``'s tables in the shape and sign ``apply_rope`` uses."""
    cos, sin = rope_cos_sin(positions, head_dim, theta, dtype, scaling)
    half = head_dim // 2
    return RopeTables(cos.unsqueeze(1), torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).unsqueeze(1))


def apply_rope(x: torch.Tensor, rope: RopeTables) -> torch.Tensor:
    """Rotate ``x`` ``[T, H, D]`` (half-split convention of the HF LLaMA checkpoints).

    ``x * cos + [-x2, x1] * sin`` computed as ``x * cos + [x2, x1] * [-sin1, sin2]``: a product's sign is its
    factors' signs, so every element is bit-identical to the textbook form.
    """
    half = x.shape[-1] // 2
    return x * rope.cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * rope.signed_sin


def apply_rope_qk(q: torch.Tensor, k: torch.Tensor, rope: RopeTables) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_rope`` on queries and keys in one pass over their heads side by side (one set of small ops per layer
    instead of two: a decode step is bound by per-op overhead); each result is a view of the other's buffer."""
    both = apply_rope(torch.cat((q, k), dim=1), rope)
    return both[:, : q.shape[1]], both[:, q.shape[1]:]
