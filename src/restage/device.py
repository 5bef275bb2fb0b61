"""Where and in what precision a rank computes: the config's dtype names as torch dtypes, and the rank's device.

The one table from ``fp32``/``bf16``/``fp16`` (``config.DTYPES``, ``ModelSpec.dtype``) to torch
dtypes, and the one rule for the device a rank's tensors live on.
"""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TORCH_NAMES: dict[torch.dtype, str] = {dtype: str(dtype).removeprefix("torch.") for dtype in DTYPES.values()}


def torch_dtype(name: str) -> torch.dtype:
    """``fp32``/``bf16``/``fp16`` or torch's own ``float32``/``bfloat16``/``float16`` (``torch.`` prefix allowed)."""
    if name in DTYPES:
        return DTYPES[name]
    by_torch_name = {torch_name: dtype for dtype, torch_name in TORCH_NAMES.items()}
    return by_torch_name[name.removeprefix("torch.")]


def rank_device(on_gpu: bool | None = None) -> torch.device:
    """This rank's current GPU when ``on_gpu`` (default: whenever CUDA is available), else the CPU."""
    if on_gpu is None:
        on_gpu = torch.cuda.is_available()
    return torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
