"""GRPO raises the sort task's reward with a tiny Mixtral actor that trains under expert parallelism (dp2ep2, its
DeepSpeed engine reducing expert gradients over expert-dp groups) and generates without it (dp2, every rank all
experts), so every step reallocates the actor between layouts that differ in ep. Same reward and margin as the
dense GRPO test (tests/e2e/test_rl_learning.py): the mean of ``actor_train/reward`` over the last five steps
exceeds that over the first five by at least 0.10."""

import shutil

import numpy as np
import pytest
from e2e_jobs import ROOT, layout_overrides, report, restage_run

from restage.report.log import read_log

pytestmark = [pytest.mark.e2e, pytest.mark.multirank]

WINDOW, MARGIN, STEPS = 5, 0.10, 50
LAYOUTS = {"actor_gen": "ranks:0-1 dp2", "ref_inf": "ranks:0-1 dp2ep2", "actor_train": "ranks:0-1 dp2ep2"}


def _tiny_mixtral(path):
    from restage.models.tiny import build_tiny

    build_tiny(path, family="mixtral", vocab_size=16, tokenizer=False, hidden_size=64, intermediate_size=128,
               num_layers=2, num_heads=4, num_kv_heads=2, max_positions=64, router_aux_loss_coef=0.01)
    for file in (ROOT / "data" / "synthetic" / "tokenizer").iterdir():
        shutil.copy(file, path / file.name)
    return path


def test_grpo_raises_reward_training_a_moe_actor_under_ep_and_generating_without(tmp_path):
    model = _tiny_mixtral(tmp_path / "mixtral")
    run = restage_run(tmp_path, "grpo_tiny", 2, "e2e-moe", f"run.steps={STEPS}", f"models.actor.path={model}",
                      f"models.ref.path={model}", *layout_overrides(LAYOUTS, tuple(LAYOUTS)))
    reward = run.stat("actor_train/reward")
    start, end = float(reward[:WINDOW].mean()), float(reward[-WINDOW:].mean())
    assert end - start >= MARGIN, f"GRPO (MoE, train ep2) reward {start:.3f} -> {end:.3f} in {STEPS} steps"

    log = read_log(run.trial_dir)
    layouts = {m["name"]: m["layout"] for m in log.schedule["mfcs"]}
    assert layouts["actor_train"].get("ep") == 2 and "ep" not in layouts["actor_gen"]
    moves = log.transfers[(log.transfers["kind"] == "realloc") & (log.transfers["name"] == "actor")]
    assert sorted({int(s) for s in moves["step"]}) == list(range(1, STEPS + 1))  # the actor moves every step
    per_step = np.array([moves["num_bytes"][moves["step"] == s].sum() for s in range(1, STEPS + 1)])
    assert (per_step > 0).all()
    assert max(run.stat("actor_train/router/layer0/max_load")) > 1.0  # the router statistics come through under ep
    report("grpo_moe_ep", steps=STEPS, reward_start=start, reward_end=end, gain=end - start,
           realloc_bytes_per_step=int(per_step[0]), seconds=run.seconds)
