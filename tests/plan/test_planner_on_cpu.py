import json

import pytest
from plan_helpers import ppo_config

from restage.cli import main as restage_main
from restage.errors import ConfigError, PlanError
from restage.layout import Layout, Strategy
from restage.plan.planner import build_problem, check_fits, make_plan, parse_manual_layout
from restage.plan.schedule import build_schedule
from restage.schedule.file import SCHEDULE_FORMAT_VERSION, read_schedule, write_schedule
from restage.schedule.ops import Op


def tiny_ppo(**extra):
    return ppo_config("llama-tiny", "llama-tiny", cluster="local-cpu", batch=8, prompt=16, gen=16, zero=0, **extra)


def test_70b_ppo_on_one_h100_node_is_refused_naming_memory_and_node_count():
    with pytest.raises(PlanError) as err:
        check_fits(build_problem(ppo_config("llama-70b", "llama-7b", nodes=1)))
    message = str(err.value)
    assert "\n" not in message
    assert "do not fit on 1 node(s) x 8 h100-80gb" in message and "GiB on its fullest device" in message
    needed = float(message.split("needs ")[1].split(" GiB")[0])
    assert needed > 72  # more than the usable memory of one 80 GiB device
    nodes = int(message.rsplit("cluster.nodes=", 1)[1])
    assert nodes > 1
    check_fits(build_problem(ppo_config("llama-70b", "llama-7b", nodes=nodes)))  # the named size fits


def test_manual_layouts_are_parsed_and_bad_ones_refused_in_one_line():
    assert parse_manual_layout("ranks:0-3 dp2tp2pp1") == (Layout((0, 1, 2, 3), Strategy(dp=2, tp=2)), None)
    assert parse_manual_layout("ranks:0,2 dp2 mb4") == (Layout((0, 2), Strategy(dp=2)), 4)
    assert parse_manual_layout("ranks:0-3 dp4ep2") == (Layout((0, 1, 2, 3), Strategy(dp=4, ep=2)), None)
    with pytest.raises(ConfigError, match="write it like"):
        parse_manual_layout("0-3 dp2")
    with pytest.raises(ConfigError, match="cannot hold dp4"):
        parse_manual_layout("ranks:0-1 dp4")


def test_manual_and_heuristic_modes():
    layouts = {"actor_gen": "ranks:0-1 dp2", "reward_inf": "ranks:0 dp1", "ref_inf": "ranks:1 dp1",
               "critic_inf": "ranks:0-1 dp1tp2", "actor_train": "ranks:0-1 dp2 mb2", "critic_train": "ranks:0-1 dp2"}
    manual = make_plan(tiny_ppo(plan={"mode": "manual", "layouts": layouts}), with_baselines=False)
    assert [str(c.layout) for c in manual.plan] == ["[0-1]dp2tp1pp1", "[0-0]dp1tp1pp1", "[1-1]dp1tp1pp1",
                                                    "[0-1]dp1tp2pp1", "[0-1]dp2tp1pp1", "[0-1]dp2tp1pp1"]
    assert manual.plan[4].micro_batches == 2
    with pytest.raises(ConfigError, match="missing"):
        make_plan(tiny_ppo(plan={"mode": "manual", "layouts": {"actor_gen": "ranks:0-1 dp2"}}))
    colocated = make_plan(tiny_ppo(plan={"mode": "heuristic", "heuristic": "colocated"}))
    assert len({c.layout for c in colocated.plan}) == 1 and colocated.plan[0].layout.mesh == (0, 1)
    assert colocated.evaluation.iteration_seconds == pytest.approx(colocated.baselines["colocated"].iteration_seconds)


def test_schedule_carries_layouts_predictions_and_the_op_list(tmp_path):
    cfg = tiny_ppo()
    outcome = make_plan(cfg, time_budget_seconds=2, max_steps=400)
    schedule = build_schedule(cfg, outcome)
    path = write_schedule(schedule, tmp_path / "schedule.json")
    data = json.loads(path.read_text())
    assert data["format_version"] == SCHEDULE_FORMAT_VERSION
    names = [m["name"] for m in data["mfcs"]]
    assert names == [m.name for m in outcome.problem.mfcs]
    for entry, cand in zip(data["mfcs"], outcome.plan):
        assert entry["predicted"]["seconds"] == pytest.approx(cand.seconds)
        assert entry["predicted"]["peak_memory_bytes"] > 0
        assert Layout.from_json(entry["layout"]) == cand.layout and entry["micro_batches"] == cand.micro_batches
    assert data["models"]["actor"]["zero_stage"] == 0 and data["models"]["actor"]["arch"]["hidden_size"] == 64
    back = read_schedule(path)
    ops = back.ops()
    assert all(isinstance(op, Op) for op in ops)
    assert sorted(op.mfc for op in ops if op.kind == "run") == sorted(names)  # every MFC runs once
    ends = max(s["predicted"]["end_seconds"] for s in data["steps"] if "predicted" in s)
    assert ends == pytest.approx(data["predicted"]["iteration_seconds"])
    data["format_version"] = 99
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="format_version 99"):
        read_schedule(path)


def test_restage_plan_cli_writes_the_schedule_and_prints_json(tmp_path, capsys):
    config = tmp_path / "job.yaml"
    config.write_text(tiny_ppo().to_yaml())
    out = tmp_path / "s.json"
    assert restage_main(["plan", str(config), "run.batch_size=4", "--out", str(out), "--search-seconds", "1", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["schedule"] == str(out) and out.is_file()
    assert printed["iteration_seconds"] > 0 and len(printed["mfcs"]) == 6
    assert read_schedule(out).config["run"]["batch_size"] == 4
    big = tmp_path / "big.yaml"
    big.write_text(ppo_config("llama-70b", "llama-7b", nodes=1).to_yaml())
    assert restage_main(["plan", str(big), "--out", str(tmp_path / "x.json")]) == 2
    assert "set cluster.nodes=" in capsys.readouterr().err
