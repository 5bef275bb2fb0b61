import json

import pytest

from restage.cluster import load_cluster
from restage.graph import MFC
from restage.layout import Layout, Strategy
from restage.models.presets import preset
from restage.plan.estimator import Estimator, overhead_counts, overhead_seconds
from restage.plan.mfc_flops import mfc_flops
from restage.plan.profile import Profile, ProfileEntry
from restage.plan.roles import ModelRole

GEN = MFC("actor_gen", "generate", "actor", ("prompts",), ("seqs",), 64, 128, 256)
INF = MFC("ref_inf", "inference", "actor", ("seqs",), ("ref_logprobs",), 64, 128, 256)
TRAIN = MFC("actor_train", "train_step", "actor", ("seqs",), (), 64, 128, 256, micro_batches=4)


def role(arch="llama-7b", **kw):
    return ModelRole("actor", preset(arch), **{"dtype": "bf16", "trainable": True, "zero_stage": 1, **kw})


def est(mfc, strategy, r=None, cluster=None, m=None):
    cluster = cluster or load_cluster("h100-80gb", nodes=2)
    return Estimator(cluster, use_profiles=False).estimate(mfc, r or role(), Layout.contiguous(0, strategy), m)


def params_7b():
    h, inter, layers, vocab = 4096, 11008, 32, 32000
    return layers * (4 * h * h + 3 * h * inter + 2 * h) + 2 * vocab * h + h


def test_memory_per_rank_falls_with_tp_pp_and_zero_stage():
    by_tp = [est(TRAIN, Strategy(tp=t)).peak_memory_bytes for t in (1, 2, 4, 8)]
    by_pp = [est(TRAIN, Strategy(pp=p), m=4).peak_memory_bytes for p in (1, 2, 4)]
    by_zero = [est(TRAIN, Strategy(dp=8), role(zero_stage=z)).state_bytes for z in (0, 1, 2, 3)]
    assert by_tp == sorted(by_tp, reverse=True) and len(set(by_tp)) == 4
    assert by_pp == sorted(by_pp, reverse=True) and len(set(by_pp)) == 3
    assert by_zero == sorted(by_zero, reverse=True) and len(set(by_zero)) == 4


def test_state_bytes_per_zero_stage_by_hand():
    n, dp = params_7b(), 8
    expect = {0: n * (2 + 2 + 12), 1: n * (2 + 2) + n * 12 / dp, 2: n * 2 + n * (2 + 12) / dp, 3: n * (2 + 2 + 12) / dp}
    for zero, bytes_ in expect.items():
        assert est(TRAIN, Strategy(dp=dp), role(zero_stage=zero)).state_bytes == pytest.approx(bytes_, rel=1e-6)


def test_recomputation_trades_time_for_activation_memory():
    plain, ckpt = est(TRAIN, Strategy(dp=2)), est(TRAIN, Strategy(dp=2), role(gradient_checkpointing=True))
    assert ckpt.transient_bytes < plain.transient_bytes / 3
    assert ckpt.seconds > plain.seconds


@pytest.mark.parametrize("mfc", [GEN, INF, TRAIN])
def test_time_falls_with_more_devices(mfc):
    times = [est(mfc, Strategy(dp=d)).seconds for d in (1, 2, 4, 8)]
    assert times == sorted(times, reverse=True) and len(set(times)) == 4


def test_decode_time_grows_with_kv_length():
    short = est(GEN, Strategy(dp=2))
    long = est(MFC("g", "generate", "actor", ("prompts",), ("seqs",), 64, 2048, 256), Strategy(dp=2))
    assert long.part("decode_seconds") > 1.2 * short.part("decode_seconds")
    assert long.transient_bytes > short.transient_bytes  # the KV cache


def test_communication_is_charged_and_slower_across_nodes():
    tp = est(INF, Strategy(tp=4))
    assert tp.part("tp_comm_seconds") > 0 and est(INF, Strategy(dp=4)).part("tp_comm_seconds") == 0
    assert est(TRAIN, Strategy(dp=4)).part("dp_comm_seconds") > 0
    assert est(TRAIN, Strategy(pp=2), m=4).part("pp_send_seconds") > 0
    narrow = load_cluster("h100-80gb", nodes=2, devices_per_node=2)  # tp=4 now spans two nodes
    assert est(INF, Strategy(tp=4), cluster=narrow).part("tp_comm_seconds") > 5 * tp.part("tp_comm_seconds")


def test_training_time_is_near_model_flops_over_achievable_peak():
    c = load_cluster("h100-80gb")
    mfc = MFC("t", "train_step", "actor", ("seqs",), (), 512, 128, 896, micro_batches=8)
    tokens = 512 * 1024
    lower = 6 * params_7b() * tokens / (8 * c.peak_bf16_flops_per_second * c.compute_efficiency)
    seconds = est(mfc, Strategy(dp=8), cluster=c).seconds
    assert lower < seconds < 1.6 * lower  # seconds, not ms or µs
    assert mfc_flops(mfc, preset("llama-7b")) == pytest.approx(6 * params_7b() * tokens, rel=0.12)


def test_a_measured_profile_replaces_the_roofline(tmp_path, monkeypatch):
    tiny = preset("llama-tiny")
    entries = [ProfileEntry("block_forward", 1, 4, 64, 0.01), ProfileEntry("block_forward", 1, 16, 64, 0.04),
               ProfileEntry("embed_forward", 1, 256, 1, 0.001), ProfileEntry("head_forward", 1, 256, 1, 0.002)]
    (tmp_path / "profiles").mkdir()
    Profile("p", "local-cpu", "fp32", tiny, entries).save(tmp_path / "profiles" / "local-cpu.json")
    monkeypatch.setenv("RESTAGE_CLUSTER_DIR", str(tmp_path))
    cpu = load_cluster("local-cpu")
    mfc = MFC("i", "inference", "actor", ("seqs",), ("v",), 4, 32, 32)
    r = ModelRole("actor", tiny, dtype="fp32")
    got = Estimator(cpu).estimate(mfc, r, Layout.contiguous(0, Strategy()))
    assert got.source == "profile:local-cpu.json"
    # two blocks, embedding, head, and the cluster file's fixed overheads for one call of one micro-batch
    overhead = overhead_seconds(cpu, mfc, Layout.contiguous(0, Strategy()), 1)
    assert overhead == pytest.approx(cpu.mfc_overhead_seconds + 4 * cpu.sequence_overhead_seconds
                                     + cpu.forward_overhead_seconds)
    assert got.seconds == pytest.approx(2 * 0.01 + 0.001 + 0.002 + overhead)
    profile = Profile.from_json(json.loads((tmp_path / "profiles" / "local-cpu.json").read_text()))
    assert profile.lookup("block_forward", 8, 64, 1) == pytest.approx((0.01 * 0.04) ** 0.5)  # log-linear midpoint
    assert profile.lookup("block_forward", 32, 64, 1) == pytest.approx(0.08)  # beyond the grid: linear in batch
    assert profile.lookup("block_forward", 8, 64, 2) is None
    other = ModelRole("actor", preset("llama-small"), dtype="fp32")
    assert Estimator(cpu).estimate(mfc, other, Layout.contiguous(0, Strategy())).source == "roofline"


def test_fixed_overheads_are_counted_per_call_slot_step_and_token():
    train = MFC("t", "train_step", "actor", ("seqs",), (), 64, 16, 16, micro_batches=2, minibatches=4, epochs=2)
    counts = overhead_counts(train, Layout.contiguous(0, Strategy(dp=2, pp=2)), 4)
    # 8 optimizer steps, each 4 micro-batches through a 2-stage pipeline (5 slots); 32 sequences per DP rank, twice
    assert counts == {"mfc": 1, "sequence": 64, "forward": 40, "backward": 40, "optimizer_step": 8, "dp_step": 8}
    assert overhead_counts(train, Layout.contiguous(0, Strategy(pp=2)), 4)["dp_step"] == 0  # no gradient reduction
    gen = MFC("g", "generate", "actor", ("prompts",), ("seqs",), 64, 16, 24)
    assert overhead_counts(gen, Layout.contiguous(0, Strategy(dp=4)), 1) == {"mfc": 1, "sequence": 16, "forward": 1,
                                                                             "decode_step": 24}
