import pytest

from restage.errors import LayoutError
from restage.layout import Coord, Layout, Strategy


def test_rank_order_is_pp_major_then_dp_then_tp():
    layout = Layout((10, 11, 12, 13, 14, 15, 16, 17), Strategy(dp=2, tp=2, pp=2))
    assert layout.coord(10) == Coord(0, 0, 0)
    assert layout.coord(11) == Coord(0, 0, 1)
    assert layout.coord(12) == Coord(0, 1, 0)
    assert layout.coord(14) == Coord(1, 0, 0)
    assert layout.coord(17) == Coord(1, 1, 1)
    assert layout.coord(3) is None
    for rank, c in layout.coords():
        assert layout.rank_at(c.pp, c.dp, c.tp) == rank


def test_groups_partition_the_mesh():
    layout = Layout.contiguous(4, Strategy(dp=2, tp=2, pp=2))
    assert layout.tp_groups() == [(4, 5), (6, 7), (8, 9), (10, 11)]
    assert layout.dp_groups() == [(4, 6), (5, 7), (8, 10), (9, 11)]
    assert layout.pp_groups() == [(4, 8), (5, 9), (6, 10), (7, 11)]
    for kind in ("tp", "dp", "pp"):
        groups = getattr(layout, f"{kind}_groups")()
        assert sorted(r for g in groups for r in g) == list(layout.mesh)
    assert layout.group_of(9, "dp") == (9, 11)


def test_bad_layouts_are_refused():
    with pytest.raises(LayoutError, match="dp\\*tp\\*pp"):
        Layout((0, 1, 2), Strategy(tp=2))
    with pytest.raises(LayoutError, match="repeats"):
        Layout((0, 0), Strategy(dp=2))
    with pytest.raises(LayoutError, match="only 4 ranks exist"):
        Layout.contiguous(2, Strategy(dp=4)).check_world(4)


def test_strategy_parse_and_json_round_trip():
    assert Strategy.parse("dp2tp4") == Strategy(dp=2, tp=4, pp=1)
    layout = Layout((3, 1, 2, 0), Strategy.parse("pp2tp2"))
    assert Layout.from_json(layout.to_json()) == layout
    with pytest.raises(LayoutError):
        Strategy.parse("dp2x")
