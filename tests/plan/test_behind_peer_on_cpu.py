"""`restage plan` under a peer predicted faster: which MFC is behind and what bears on it (plan/peers/behind.py,
docs/plan.md "Behind a peer"); and the ep column of a mixture's plan ("Expert parallelism")."""

from __future__ import annotations

import re

from restage.config.load import config_from_dict
from restage.plan.cli import render
from restage.plan.peers.baselines import BASELINES
from restage.plan.planner import make_plan
from restage.plan.schedule import build_schedule


def grpo(arch: str, nodes: int = 1, batch: int = 128, **extra):
    model = {"arch": arch, "dtype": "bf16"}
    return config_from_dict({
        "experiment": "t", "algorithm": "grpo", "reward_fn": "sort", "algo": {"group_size": 8, "minibatches": 2},
        "models": {"actor": {**model, "trainable": True}, "ref": model}, "run": {"batch_size": batch},
        "dataset": {"max_prompt_tokens": 512, "max_answer_tokens": 512}, "cluster": {"name": "h100-80gb", "nodes": nodes},
        **extra, "generation": {"max_new_tokens": 512, **extra.get("generation", {})}})


def behind_lines(text: str) -> dict[str, str]:
    """peer -> the line printed under it, for the peers followed by a 'behind in' line."""
    lines = text.splitlines()
    return {re.match(r"  vs (\w+)", lines[i - 1])[1]: line for i, line in enumerate(lines) if "behind in" in line}


def test_a_peer_ahead_names_the_mfc_and_the_setting_and_following_it_helps():
    cfg = grpo("qwen3-0.6b")  # 1024 answers over 8 ranks: 128 a rank, against the rollout engine's default 64 slots
    outcome = make_plan(cfg)
    text = render(build_schedule(cfg, outcome), outcome)
    ours = outcome.evaluation
    ahead = {name for name, ev in outcome.baselines.items()
             if name in BASELINES and ev and ev.iteration_seconds < ours.iteration_seconds}
    lines = behind_lines(text)
    assert ahead and set(lines) == ahead  # a line under every peer ahead, and only those
    gen = [m.name for m in outcome.problem.mfcs].index("actor_gen")
    for name, line in lines.items():
        peer = outcome.baselines[name]
        assert line == (f"    behind in actor_gen: {ours.mfc_seconds[gen]:.3f} s here, {peer.mfc_seconds[gen]:.3f} s in "
                        f"{name}'s plan; restage's rollout engine decodes 64 of a rank's 128 answers at once: raise "
                        "generation.max_slots (now 64)")
    advised = grpo("qwen3-0.6b", generation={"max_slots": 128})
    better = make_plan(advised)
    assert better.evaluation.iteration_seconds < 0.9 * ours.iteration_seconds
    for line in behind_lines(render(build_schedule(advised, better), better)).values():
        assert "no setting of restage's closes this" in line and "max_slots" not in line


def test_a_manual_plan_behind_a_peer_points_to_the_search():
    layouts = {"actor_gen": "ranks:0-7 dp8tp1pp1", "ref_inf": "ranks:0-7 dp8tp1pp1 mb4",
               "actor_train": "ranks:0-7 dp8tp1pp1 mb4"}  # the searched plan's layouts
    cfg = grpo("qwen3-0.6b", plan={"mode": "manual", "layouts": layouts})
    outcome = make_plan(cfg)
    text = render(build_schedule(cfg, outcome), outcome)
    header = next(line for line in text.splitlines() if line.startswith("MFC"))
    assert header.split()[:6] == ["MFC", "mesh", "dp", "tp", "pp", "mb"]  # no ep column: no layout splits experts
    lines = behind_lines(text)
    assert lines and all(line.endswith("this plan's layouts are plan.mode=manual's; plan.mode=search starts from the "
                                       "peers' layouts restage can run") for line in lines.values())


def test_the_plan_table_shows_ep_when_a_layout_splits_experts():
    layout = "ranks:0-15 dp8tp1pp2ep4 mb8"  # qwen3-30b-a3b: 128 experts, 32 per rank
    cfg = grpo("qwen3-30b-a3b", nodes=2, batch=64,
               plan={"mode": "manual", "layouts": dict.fromkeys(("actor_gen", "ref_inf", "actor_train"), layout)})
    outcome = make_plan(cfg, with_baselines=False)
    text = render(build_schedule(cfg, outcome), outcome)
    header = next(line for line in text.splitlines() if line.startswith("MFC"))
    rows = [line.split() for line in text.splitlines() if line.split()[:1] in (["actor_gen"], ["ref_inf"], ["actor_train"])]
    assert header.split()[:7] == ["MFC", "mesh", "dp", "tp", "pp", "ep", "mb"]
    assert len(rows) == 3 and all(row[1:7] == ["0-15", "8", "1", "2", "4", "1" if row[0] == "actor_gen" else "8"]
                                  for row in rows)
