"""restage.device: the one dtype table agrees with the config's names, and names round-trip."""

import torch

from restage.config import choices as config
from restage.device import DTYPES, TORCH_NAMES, rank_device, torch_dtype


def test_the_dtype_table_covers_the_config_names_and_round_trips():
    assert tuple(DTYPES) == config.DTYPES
    assert [torch_dtype(name) for name in ("fp32", "bf16", "fp16")] == [torch.float32, torch.bfloat16, torch.float16]
    assert [torch_dtype(TORCH_NAMES[d]) for d in DTYPES.values()] == list(DTYPES.values())
    assert torch_dtype("torch.bfloat16") == torch.bfloat16
    assert TORCH_NAMES[torch.bfloat16] == "bfloat16"


def test_the_rank_device_on_a_cpu_machine():
    assert rank_device(on_gpu=False) == torch.device("cpu")
    assert rank_device() == (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                             else torch.device("cpu"))
