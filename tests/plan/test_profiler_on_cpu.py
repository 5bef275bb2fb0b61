import argparse

import pytest

from restage.cluster import find_cluster_file, load_cluster
from restage.graph import MFC
from restage.layout import Layout, Strategy
from restage.models.presets import preset
from restage.plan.estimator import Estimator
from restage.plan.profile import OPS, load_profile
from restage.plan.profiler import add_arguments, main
from restage.plan.roles import ModelRole


def test_profile_times_every_piece_and_the_estimator_uses_it(tmp_path, monkeypatch):
    monkeypatch.setenv("RESTAGE_CLUSTER_DIR", str(tmp_path))
    (tmp_path / "local-cpu.yaml").write_text(find_cluster_file("local-cpu").read_text())
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--arch", "llama-tiny", "--batches", "1,2", "--seqs", "8,16", "--tp", "1,2", "--repeats", "1"])
    assert main(args) == 0
    files = list((tmp_path / "profiles").glob("*.json"))
    assert [f.name for f in files] == ["local-cpu--llama-tiny--fp32.local.json"]
    profile = load_profile(files[0])
    assert {e.op for e in profile.entries} == set(OPS)
    assert all(e.seconds > 0 for e in profile.entries)
    assert {e.tp for e in profile.entries if e.op == "block_forward"} == {1, 2}
    assert profile.lookup("block_forward", 2, 16, 2) == pytest.approx(
        next(e.seconds for e in profile.entries if (e.op, e.tp, e.batch, e.seq) == ("block_forward", 2, 2, 16)))
    mfc = MFC("i", "inference", "actor", ("seqs",), ("v",), 2, 8, 8)
    role = ModelRole("actor", preset("llama-tiny"), dtype="fp32")
    estimate = Estimator(load_cluster("local-cpu")).estimate(mfc, role, Layout.contiguous(0, Strategy(tp=2)))
    assert estimate.source == f"profile:{files[0].name}"


def test_profile_shows_progress_and_writes_to_the_user_cache_not_the_repository(tmp_path, monkeypatch, capsys):
    from pathlib import Path

    from restage.plan.profile import find_profile

    repository_profiles = Path(__file__).resolve().parents[2] / "cluster" / "profiles"
    before = sorted(p.name for p in repository_profiles.glob("*")) if repository_profiles.is_dir() else []
    monkeypatch.delenv("RESTAGE_CLUSTER_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--arch", "llama-tiny", "--batches", "1", "--seqs", "8", "--tp", "1", "--repeats", "2"])
    assert main(args) == 0
    out = tmp_path / "cache" / "restage" / "profiles" / "local-cpu--llama-tiny--fp32.local.json"
    assert out.is_file()
    after = sorted(p.name for p in repository_profiles.glob("*")) if repository_profiles.is_dir() else []
    assert after == before
    lines = capsys.readouterr().out.splitlines()
    progress = [line for line in lines if line.startswith("restage profile: ")]
    assert progress[1] == "restage profile: tp 1: building the one-block shard and its 1 shapes"
    assert progress[2].startswith("restage profile: warm-up of 8 pieces done in ")
    assert [line.split(" done")[0] for line in progress[3:5]] == ["restage profile: round 1/2", "restage profile: round 2/2"]
    used = find_profile("local-cpu", preset("llama-tiny"), "fp32")  # the planner finds it, or says which it takes
    assert used is not None and (used.name == out.name or any(" note: the planner takes " in line for line in lines))


def test_a_profile_is_not_reused_across_head_widths_or_qk_norms():
    import dataclasses

    from restage.plan.profile import arch_signature

    qwen3 = preset("qwen3-8b")
    assert arch_signature(qwen3) != arch_signature(dataclasses.replace(qwen3, head_dim=64))
    assert arch_signature(qwen3) != arch_signature(dataclasses.replace(qwen3, qk_norm=False))
    assert arch_signature(preset("llama-3.1-8b")) == arch_signature(dataclasses.replace(preset("llama-3.1-8b"), head_dim=0))
