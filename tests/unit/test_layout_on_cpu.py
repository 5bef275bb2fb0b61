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


class _Created:
    """Stands in for ProcessGroups: hands out a group only for ranks created up front, raising as it does otherwise."""

    def __init__(self, groups):
        self.groups = {tuple(sorted(g)) for g in groups}

    def get(self, ranks):
        key = tuple(sorted(ranks))
        if key not in self.groups:
            raise KeyError(f"no group over {key}; it was not requested up front")
        return key


def _strategies(world: int):
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    return [Strategy(dp=world // (tp * pp), tp=tp, pp=pp) for tp in divisors for pp in divisors if world % (tp * pp) == 0]


@pytest.mark.parametrize("world", [8, 16])
def test_every_group_deepspeeds_mpu_asks_for_is_created_up_front(world):
    # Before: dp2tp2pp2's model-parallel group (0, 1, 4, 5) was not in all_groups, and DeepSpeed's ZeRO set-up
    # died with "rank 1 has no group over (0, 1, 4, 5); it was not requested up front".
    from restage.runtime.dataplane.comm_budget import engine_singleton_ranks
    from restage.runtime.store.zero_engines import LayoutMPU

    for strategy in _strategies(world):
        layout = Layout.contiguous(0, strategy)
        created = _Created([*layout.all_groups(), *[(r,) for r in engine_singleton_ranks(layout)]])
        for rank in layout.mesh:
            mpu = LayoutMPU(layout, rank, created)
            asked = [mpu.get_data_parallel_group(), mpu.get_model_parallel_group(), mpu.get_tensor_model_parallel_group()]
            assert [len(g) for g in asked] == [strategy.dp, strategy.tp * strategy.pp, strategy.tp]
            assert rank in asked[1] and set(asked[1]) == {layout.rank_at(p, layout.coord(rank).dp, t)
                                                           for p in range(strategy.pp) for t in range(strategy.tp)}
        assert len(layout.all_groups()) == len(set(layout.all_groups()))  # one order, no group twice
