"""The report against numbers worked out by hand on the noise-free synthetic plan (synthetic.py's docstring).

4 ranks: lo = {0, 1}, hi = {2, 3}. A step: realloc 0.05 s on all ranks; actor_gen 1.0 on all;
seqs transfers 0.02 (lo and hi at once); ref_inf 0.3 on lo | reward_inf 0.25 then critic_inf 0.25
on hi; rewards transfer 0.02 on all (starts at 1.57); actor_train 0.8 on lo | critic_train 0.7 on
hi; master 0.01. Step = 0.05 + 1.0 + 0.02 + 0.5 + 0.02 + 0.8 + 0.01 = 2.4 s.
"""

from __future__ import annotations

import pytest

from restage.accuracy import PROCESS_BASELINES, prediction_band
from restage.report.log import read_log
from restage.report.summary import summarize

STEP = 2.4
STEPS = 5
SAMPLES = 8 * 4  # per step
TOKENS = SAMPLES * 256
FLOPS = (2 * 4 + 6 * 2) * 7e9 * TOKENS  # four inference passes at 2N, two training passes at 6N per token


@pytest.fixture(scope="module")
def report(exact_log):
    return summarize(read_log(exact_log), last_n=2)


def test_throughput_and_mfu(report):
    overall = report["throughput"]["all"]
    assert overall["wall_seconds"] == pytest.approx(STEPS * STEP)
    assert overall["step_seconds_mean"] == pytest.approx(STEP)
    assert overall["samples_per_second"] == pytest.approx(SAMPLES / STEP)
    assert overall["tokens_per_second"] == pytest.approx(TOKENS / STEP)
    assert overall["tflops_per_device"] == pytest.approx(FLOPS / STEP / 4 / 1e12)
    assert overall["mfu"] == pytest.approx(FLOPS / STEP / 4 / 312e12)
    assert report["throughput"]["last"]["steps"] == 2
    assert report["throughput"]["last"]["first_step"] == 4  # steps 1..5: the last 2 are steps 4 and 5


def test_shares_per_rank(report):
    lo, hi = report["shares"]["0"], report["shares"]["3"]
    assert lo["mfcs"] == pytest.approx({"actor_gen": 1.0 / STEP, "ref_inf": 0.3 / STEP, "reward_inf": 0.0,
                                        "critic_inf": 0.0, "actor_train": 0.8 / STEP, "critic_train": 0.0})
    assert hi["mfcs"] == pytest.approx({"actor_gen": 1.0 / STEP, "ref_inf": 0.0, "reward_inf": 0.25 / STEP,
                                        "critic_inf": 0.25 / STEP, "actor_train": 0.0, "critic_train": 0.7 / STEP})
    for share in (lo, hi):
        assert share["realloc"] == pytest.approx(0.05 / STEP)
        assert share["transfer"] == pytest.approx(0.04 / STEP)
    assert lo["idle"] == pytest.approx(1 - 2.19 / STEP)
    assert hi["idle"] == pytest.approx(1 - 2.29 / STEP)


def test_movements(report):
    realloc, transfer = report["movements"]["realloc"], report["movements"]["transfer"]
    assert realloc["share"] == pytest.approx(0.05 / STEP)
    assert realloc["bytes_per_step"] == pytest.approx(2 * 7e9)
    # seqs to lo and to hi run at the same time: 0.02 s in flight, then rewards 0.02 s
    assert transfer["share"] == pytest.approx(0.04 / STEP)
    assert transfer["seconds_per_step"] == pytest.approx(0.04)


def test_predicted_against_measured(report):
    mfcs = {m["name"]: m for m in report["mfcs"]}
    assert list(mfcs) == ["actor_gen", "ref_inf", "reward_inf", "critic_inf", "actor_train", "critic_train"]
    assert mfcs["actor_gen"]["measured_seconds"] == pytest.approx(1.0)
    assert mfcs["actor_gen"]["predicted_seconds"] == pytest.approx(0.9)
    assert mfcs["actor_gen"]["error_percent"] == pytest.approx(-10.0)
    assert mfcs["critic_inf"]["error_percent"] == pytest.approx(20.0)
    assert mfcs["reward_inf"]["error_percent"] == pytest.approx(0.0, abs=1e-9)
    assert mfcs["actor_train"]["peak_memory_bytes"] == 60_000_000_000
    # predicted: the plan's 0.9 x 60e9 plus the GPU process baseline (restage/accuracy.py)
    baseline = PROCESS_BASELINES["gpu"].bytes
    assert mfcs["actor_train"]["predicted_peak_memory_bytes"] == 54_000_000_000 + baseline
    assert mfcs["actor_train"]["memory_error_percent"] == pytest.approx(100 * (54e9 + baseline - 60e9) / 60e9)
    assert mfcs["actor_gen"]["ranks"] == [0, 1, 2, 3] and mfcs["ref_inf"]["ranks"] == [0, 1]
    assert mfcs["critic_train"]["flops_per_step"] == pytest.approx(6 * 7e9 * TOKENS)


def test_statistics(report):
    reward, kl = report["stats"]["actor_train/reward"], report["stats"]["actor_train/kl"]
    assert reward["count"] == STEPS and reward["first_step"] == 1 and reward["last"] == pytest.approx(1.0)
    assert kl["count"] == STEPS - 2 and kl["first_step"] == 3
    assert report["stats"]["eval/reward"]["count"] == 1 and report["stats"]["eval/reward"]["first_step"] == STEPS
    assert report["warnings"] == []


def test_steps_count_from_one_in_the_report(report, exact_log):
    from restage.report.summary import format_text

    assert (report["throughput"]["all"]["first_step"], report["throughput"]["all"]["last_step"]) == (1, STEPS)
    assert report["last_complete_step"] == STEPS
    text = format_text(report)
    assert f"steps 1..{STEPS} ({STEPS} complete)" in text
    assert f"complete: the run closed its log after step {STEPS}" in text


def test_memory_is_compared_with_the_process_baseline_where_the_device_is_known(exact_log):
    """GPU and CPU ranks: the plan's bytes plus that device's process baseline; no device or no prediction: measured only."""
    import dataclasses

    from restage.report.summary import format_text

    log = read_log(exact_log)
    gpu = summarize(log)
    assert all(m["memory_compared"] for m in gpu["mfcs"]) and gpu["memory_note"] == ""
    cpu = summarize(dataclasses.replace(log, cluster={**log.cluster, "device": "AMD EPYC (Zen 3) core, CPU"}))
    for g, c in zip(gpu["mfcs"], cpu["mfcs"]):
        assert g["process_baseline_bytes"] == PROCESS_BASELINES["gpu"].bytes
        assert c["process_baseline_bytes"] == PROCESS_BASELINES["cpu"].bytes
        assert c["predicted_peak_memory_bytes"] == c["predicted_plan_memory_bytes"] + PROCESS_BASELINES["cpu"].bytes
    nameless = summarize(dataclasses.replace(log, cluster={}, schedule={**log.schedule, "cluster": {}}))
    assert not any(m["memory_compared"] or m["memory_error_percent"] is not None for m in nameless["mfcs"])
    assert f"warning: peak memory is shown measured only: {nameless['memory_note']}" in format_text(nameless)
    schedule = {"mfcs": [{**m, "predicted": {**m["predicted"], "peak_memory_bytes": 0}} for m in log.schedule["mfcs"]]}
    unpredicted = summarize(dataclasses.replace(log, schedule=schedule))
    assert not any(m["memory_compared"] for m in unpredicted["mfcs"])
    assert unpredicted["memory_note"] == "the schedule predicts no peak memory for these MFCs"
    assert [m["peak_memory_bytes"] for m in unpredicted["mfcs"]] == [m["peak_memory_bytes"] for m in gpu["mfcs"]]


def test_a_tiny_cpu_job_predicts_its_process_baseline_not_zero(tmp_path):
    """The tiny PPO job's case: the plan predicts ~3 MB, a rank's resident set is ~0.42 GiB."""
    from restage.report.log_writer import LogWriter
    from restage.report.summary import format_text

    plan_bytes, measured_bytes = 3_258_624, 451_661_824  # ppo_tiny's actor_train on rank 0 (restage/accuracy.py)
    schedule = {"predicted": {"iteration_seconds": 0.118},
                "mfcs": [{"name": "actor_train", "predicted": {"seconds": 0.07, "peak_memory_bytes": plan_bytes}}]}
    with LogWriter(tmp_path, world_size=1, schedule=schedule, cluster={"device": "AMD EPYC (Zen 3) core, CPU"}) as w:
        for step in (1, 2, 3):
            w.mfc(step, "actor_train", "actor", "train_step", 0, step - 1.0, step - 0.9, 10, 1e6, measured_bytes)
            w.end_step(step, step - 1.0, step - 0.85, samples=4, tokens=40, flops=1e6)
    report = summarize(read_log(tmp_path))
    (mfc,) = report["mfcs"]
    predicted = plan_bytes + PROCESS_BASELINES["cpu"].bytes
    assert mfc["predicted_peak_memory_bytes"] == predicted and mfc["memory_compared"]
    assert mfc["memory_error_percent"] == pytest.approx(100 * (predicted - measured_bytes) / measured_bytes)
    line = next(x for x in format_text(report).splitlines() if x.strip().startswith("actor_train"))
    assert line.split()[-3:] == [f"{measured_bytes / 2**30:.2f}", f"{predicted / 2**30:.2f}",
                                 f"{mfc['memory_error_percent']:+.1f}"]
    assert line.split()[-2] != "0.00"
    # The iteration against the plan's band: a step of 0.15 s, predicted 0.118 s, band from the CPU validation.
    band = prediction_band(False)
    assert report["iteration"]["measured_seconds"] == pytest.approx(0.15)
    assert report["iteration"]["band_seconds"] == pytest.approx([0.118 * band.low_ratio, 0.118 * band.high_ratio])
    assert report["iteration"]["inside_band"] == (0.118 * band.low_ratio <= 0.15 <= 0.118 * band.high_ratio)
    assert mfc["predicted_band_seconds"] == pytest.approx([0.07 * band.low_ratio, 0.07 * band.high_ratio])


def test_mfu_reads_the_cluster_and_dtype_where_the_runtime_may_put_them():
    from restage.report.throughput import peak_flops_per_device

    spec = {"device": "A100", "peak_fp32_flops_per_second": 19.5e12, "peak_bf16_flops_per_second": 312e12}
    assert peak_flops_per_device(spec, "fp32") == (19.5e12, "fp32")
    assert peak_flops_per_device(spec, "") == (312e12, "bf16")
    assert peak_flops_per_device({"device": {"peak_flops": {"fp16": 1e12}}}, "") == (1e12, "fp16")
    assert peak_flops_per_device(spec, "fp8")[0] is None and peak_flops_per_device(None, "bf16")[0] is None


def test_dtype_and_cluster_fall_back_to_the_schedule(tmp_path):
    from restage.report.log_writer import LogWriter

    schedule = {"models": {"actor": {"dtype": "fp32"}, "ref": {"dtype": "fp32"}},
                "cluster": {"peak_fp32_flops_per_second": 1e12, "peak_bf16_flops_per_second": 8e12}}
    with LogWriter(tmp_path, world_size=2, schedule=schedule) as writer:
        writer.end_step(1, 0.0, 2.0, samples=4, tokens=40, flops=4e12)
    report = summarize(read_log(tmp_path))
    assert (report["mfu_dtype"], report["peak_flops_per_device"]) == ("fp32", 1e12)
    assert report["throughput"]["all"]["mfu"] == pytest.approx(4e12 / 2.0 / 2 / 1e12)
