"""Expert parallelism inside dp: the ep and expert-dp groups, names and JSON (unchanged without ep)."""

import pytest

from restage.errors import LayoutError
from restage.layout import Layout, Strategy


def test_ep_groups_are_consecutive_dp_indices_and_edp_groups_share_an_ep_rank():
    # dp4 ep2 tp2 pp1 on ranks 0..7: dp index d, tp t sits at 2d + t
    layout = Layout.contiguous(0, Strategy(dp=4, tp=2, ep=2))
    assert layout.ep_groups() == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert layout.edp_groups() == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert layout.group_of(6, "ep") == (4, 6) and layout.group_of(6, "edp") == (2, 6)
    assert [layout.strategy.ep_rank(layout.coord(r).dp) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    for kind in ("ep", "edp"):
        groups = getattr(layout, f"{kind}_groups")()
        assert sorted(r for g in groups for r in g) == list(layout.mesh)
    assert set(layout.ep_groups()) <= set(layout.all_groups())
    assert set(layout.edp_groups()) <= set(layout.all_groups())


def test_ep_over_all_of_dp_has_singleton_expert_dp_groups_left_out_of_all_groups():
    layout = Layout.contiguous(0, Strategy(dp=2, pp=2, ep=2))
    assert layout.ep_groups() == [(0, 1), (2, 3)]
    assert layout.edp_groups() == [(0,), (1,), (2,), (3,)]
    assert all(len(g) > 1 for g in layout.all_groups())


def test_without_ep_names_json_and_groups_are_unchanged():
    layout = Layout.contiguous(0, Strategy(dp=2, tp=2, pp=2))
    assert str(layout.strategy) == "dp2tp2pp2"
    assert layout.to_json() == {"mesh": list(range(8)), "dp": 2, "tp": 2, "pp": 2}
    assert len(layout.all_groups()) == 4 + 4 + 4 + 2 + 1  # tp, dp, pp, model-parallel (tp x pp) and the mesh


def test_ep_names_parse_and_json_round_trip():
    strategy = Strategy.parse("dp4ep2tp2")
    assert strategy == Strategy(dp=4, tp=2, pp=1, ep=2)
    assert str(strategy) == "dp4ep2tp2pp1" and Strategy.parse(str(strategy)) == strategy
    layout = Layout.contiguous(0, strategy)
    assert layout.to_json()["ep"] == 2
    assert Layout.from_json(layout.to_json()) == layout


def test_ep_that_does_not_divide_dp_is_refused_in_one_line():
    with pytest.raises(LayoutError, match="ep=3 does not divide dp=4") as err:
        Strategy(dp=4, ep=3)
    assert "\n" not in str(err.value)
    with pytest.raises(LayoutError, match="positive"):
        Strategy(ep=0)
