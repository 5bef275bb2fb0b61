"""GRPO with a LoRA actor under `restage run` learns by the dense test's margin, and after the first step its
reallocation moves only the adapters (the generation copy keeps the frozen base).

Same job, layouts and reward window as test_rl_learning.py's GRPO case (2 ranks, actor generating in dp2
and training in tp2, margin 0.10 over 50 steps); the adapters get rank 8 on every linear and a larger LR.
"""

import numpy as np
import pytest
from e2e_jobs import RELAYOUT, layout_overrides, report, restage_run
from test_rl_learning import WINDOW

from restage.layout import Layout, Strategy
from restage.models.arch import LoraConfig, ModelConfig
from restage.report.log import read_log
from restage.schedule.realloc_plan import destination_shard_bytes, plan_reallocation

pytestmark = [pytest.mark.e2e, pytest.mark.multirank]

LORA = ["models.actor.lora.rank=8", "models.actor.lora.alpha=16", "models.actor.lora.target_modules=[q,k,v,o,gate,up,down]",
        "models.actor.optim.lr=5.0e-3"]


def test_lora_grpo_raises_reward_and_reallocates_only_adapters(tmp_path):
    steps, margin = 50, 0.10  # test_rl_learning.py's GRPO figures
    mfcs = ("actor_gen", "ref_inf", "actor_train")
    run = restage_run(tmp_path, "grpo_tiny", 2, "lora", f"run.steps={steps}", *LORA, *layout_overrides(RELAYOUT, mfcs))
    reward = run.stat("actor_train/reward")
    start, end = float(reward[:WINDOW].mean()), float(reward[-WINDOW:].mean())
    assert end - start >= margin, f"LoRA GRPO reward {start:.3f} -> {end:.3f} in {steps} steps"

    log = read_log(run.trial_dir)
    moves = log.transfers[(log.transfers["kind"] == "realloc") & (log.transfers["name"] == "actor")]
    per_step = np.array([moves["num_bytes"][moves["step"] == s].sum() for s in range(1, steps + 1)])
    cfg = ModelConfig.from_json(log.schedule["models"]["actor"]["arch"])
    assert cfg.lora == LoraConfig(8, 16.0, ("q", "k", "v", "o", "gate", "up", "down"))
    train, gen = Layout.contiguous(0, Strategy(tp=2)), Layout.contiguous(0, Strategy(dp=2))
    full = plan_reallocation(cfg, train, gen, bytes_per_element=4)
    adapters = plan_reallocation(cfg, train, gen, bytes_per_element=4, adapters_only=True)
    # What the dp2 copies lack of the adapters: each rank's whole adapter shard less the half it holds in tp2.
    lacking = sum(destination_shard_bytes(adapters, r) for r in gen.mesh) - adapters.local_bytes
    assert per_step[0] == full.total_bytes  # the first move builds the copy, base included
    assert (per_step[1:] == lacking).all() and lacking == adapters.total_bytes
    report("lora_grpo", steps=steps, reward_start=start, reward_end=end, gain=end - start,
           first_realloc_bytes=int(per_step[0]), adapter_realloc_bytes=int(per_step[1]), seconds=run.seconds)
