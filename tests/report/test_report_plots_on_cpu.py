"""PNG plots: written for every log source, of the documented pixel size, and showing what they claim."""

from __future__ import annotations

import math

import numpy as np
import pytest
from PIL import Image

from restage.report.log import read_log
from restage.report.plots import mfc_colors, plot_sweep, stat_panels, write_plots
from restage.report.summary import summarize
from restage.report.throughput import mfc_order


def pixels(path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"))


def rows_of(image: np.ndarray, rgba, below: int) -> np.ndarray:
    """Pixel rows (above ``below``) holding the colour ``rgba``."""
    target = np.array([round(255 * c) for c in rgba[:3]])
    ys = np.nonzero(np.abs(image.astype(int) - target).sum(axis=2) <= 3)[0]
    return ys[ys < below]


def has_color(image: np.ndarray, rgba, at_least: int = 50) -> bool:
    target = np.array([round(255 * c) for c in rgba[:3]])
    return int((np.abs(image.astype(int) - target).sum(axis=2) <= 3).sum()) >= at_least


def test_plots_exist_with_documented_sizes(any_log, tmp_path):
    log = read_log(any_log)
    summary = summarize(log)
    written = {p.name: p for p in write_plots(log, summary, tmp_path)}
    predicted = any(m["predicted_seconds"] for m in summary["mfcs"])
    assert set(written) == {"timeline.png", "throughput.png"} | ({"predicted.png"} if predicted else set())
    panels = len(stat_panels(log.stat_series()))
    assert Image.open(written["timeline.png"]).size == (1200, round(100 * min(16.0, 2.4 + 0.4 * log.world_size)))
    assert Image.open(written["throughput.png"]).size == (1200, 300 * math.ceil((2 + panels) / 2))
    if predicted:
        assert Image.open(written["predicted.png"]).size == (1200, 500)


def test_timeline_draws_every_mfc_in_its_colour(synthetic_log, tmp_path):
    log = read_log(synthetic_log)
    image = pixels(write_plots(log, summarize(log), tmp_path)[0])
    colors = mfc_colors(mfc_order(log))
    assert set(colors) == {"actor_gen", "ref_inf", "reward_inf", "critic_inf", "actor_train", "critic_train"}
    for name, rgba in colors.items():
        assert has_color(image, rgba), name
    # ref_inf runs on ranks 0-3 (upper rows), reward_inf on ranks 4-7 (lower rows); the legend sits below both
    legend_top = image.shape[0] - 60
    ref_rows, reward_rows = (rows_of(image, colors[name], legend_top) for name in ("ref_inf", "reward_inf"))
    assert ref_rows.max() < reward_rows.min()


def test_sweep_plot_size(tmp_path):
    rows = [{"name": "a", "samples_per_second": 3.0}, {"name": "b", "samples_per_second": None, "status": "no log"}]
    path = plot_sweep(rows, tmp_path / "sweep.png")
    assert Image.open(path).size == (1000, 500)
    assert has_color(pixels(path), (0.12156862745098039, 0.4666666666666667, 0.7058823529411765))  # the one bar: tab:blue


@pytest.mark.parametrize("steps", [1, 3])
def test_short_logs_plot(tmp_path, steps):
    from restage.report.synthetic import write_synthetic_log

    log = read_log(write_synthetic_log(tmp_path / "log.h5", steps=steps, world_size=2))
    assert len(write_plots(log, summarize(log), tmp_path / "png")) == 3


def test_statistic_panels_are_distinct_quantities_losses_first(synthetic_log):
    """reward and KL are logged under both train MFCs: one panel each; losses first, then reward, KL, eval curves."""
    series = read_log(synthetic_log).stat_series()
    panels = stat_panels(series)
    assert [title for title, _ in panels] == ["actor_train/loss", "critic_train/loss", "reward (actor_train, critic_train)",
                                              "kl (actor_train, critic_train)", "eval/reward", "eval/accuracy"]
    assert panels[2][1] == ["actor_train/reward", "critic_train/reward"]
    assert panels[3][1] == ["actor_train/kl", "critic_train/kl"]
    curves = {series[names[0]][1].tobytes() for _, names in panels}
    assert len(curves) == len(panels)  # no two panels draw the same curve
    assert series["eval/reward"][0].tolist() == [10, 20, 30]  # evaluated at the cadence and the last step


def test_a_loss_equal_to_another_statistic_is_one_panel():
    steps = np.arange(1, 4)
    series = {"actor_train/policy_loss": (steps, np.array([0.3, 0.2, 0.1])),
              "actor_train/loss": (steps, np.array([0.3, 0.2, 0.1])), "actor_train/lr": (steps, np.ones(3)),
              "actor_train/reward": (steps, np.array([1.0, 2.0, 3.0]))}
    assert stat_panels(series) == [("actor_train/policy_loss = loss",
                                     ["actor_train/policy_loss", "actor_train/loss"]),
                                    ("actor_train/reward", ["actor_train/reward"]), ("actor_train/lr", ["actor_train/lr"])]


def test_series_equal_up_to_float32_rounding_are_one_panel():
    """Each train MFC reduces the same reward over its own DP layout: the demo's differ by ~1e-8, one quantity."""
    steps = np.arange(1, 5)
    reward = np.array([0.2104, 0.1782, 0.1479, 0.2013])
    series = {"actor_train/reward": (steps, reward), "critic_train/reward": (steps, reward + 1.49e-8),
              "actor_train/kl": (steps, reward * 1.01)}  # 1 % apart: another quantity
    assert stat_panels(series) == [("reward (actor_train, critic_train)", ["actor_train/reward", "critic_train/reward"]),
                                   ("actor_train/kl", ["actor_train/kl"])]
