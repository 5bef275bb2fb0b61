"""The schedule's op kinds: one JSON form per kind, read back equal; an unknown kind refused in one line."""

from typing import get_args

import pytest

from restage.errors import ConfigError
from restage.layout import Layout, Strategy
from restage.schedule.ops import (
    Ema,
    Free,
    Generate,
    Offload,
    Op,
    Push,
    Realloc,
    Reload,
    Run,
    SendKey,
    TakeBuffered,
    op_from_json,
    op_subject,
    op_to_json,
)

A, B = Layout.contiguous(0, Strategy(dp=2)), Layout.contiguous(2, Strategy(tp=2))
OPS = [Run((0, 1), "actor_gen", "actor", A), Realloc((0, 1, 2, 3), "actor", B, A),
       SendKey((0, 1, 2, 3), "ref_inf", "seqs", "actor_gen", A, B), Free((0, 1), "actor", A),
       Offload((2, 3), "ref", B), Reload((2, 3), "ref", B), Ema((0, 1, 2, 3), "actor_train", "ref", A, B),
       Push((0, 1, 2, 3), "actor", B, A, 2), Generate((0, 1), "actor_gen", "actor", A, 1, 2),
       TakeBuffered((0, 1), "actor_gen", A)]


@pytest.mark.parametrize("op", OPS, ids=lambda op: op.kind)
def test_every_kind_reads_back_equal_from_its_json(op):
    data = op_to_json(op)
    assert op_from_json(data) == op
    assert list(data)[:2] == ["kind", "ranks"] and data["ranks"] == list(op.ranks)


def test_json_keys_are_schedule_format_1():
    assert {type(op) for op in OPS} == set(get_args(Op))  # every kind is checked here
    keys = {op.kind: sorted(op_to_json(op)) for op in OPS}
    assert keys == {"run": ["dst", "kind", "mfc", "model", "ranks"],
                    "realloc": ["dst", "kind", "model", "ranks", "src"],
                    "transfer": ["dst", "key", "kind", "mfc", "producer", "ranks", "src"],
                    "free": ["dst", "kind", "model", "ranks"], "offload": ["dst", "kind", "model", "ranks"],
                    "reload": ["dst", "kind", "model", "ranks"], "ema": ["dst", "kind", "mfc", "model", "ranks", "src"],
                    # async mode's (schedule/async_program.py); sync schedules hold none of them
                    "push": ["dst", "every", "kind", "model", "ranks", "src"],
                    "generate": ["dst", "kind", "mfc", "model", "ranks", "start", "stop"],
                    "take": ["dst", "kind", "mfc", "ranks"]}
    assert [op_subject(op) for op in OPS] == ["actor_gen", "actor", "ref_inf", "actor", "ref", "ref", "actor_train",
                                              "actor", "actor_gen", "actor_gen"]


def test_a_partial_generate_writes_its_flag_and_a_whole_one_stays_as_before():
    """``Generate.partial`` is written only when true: async schedules without partial rollouts keep their bytes."""
    whole, partial = Generate((0, 1), "actor_gen", "actor", A, 1, 2), Generate((0, 1), "actor_gen", "actor", A, 1, 2, True)
    assert "partial" not in op_to_json(whole) and op_to_json(partial)["partial"] is True
    assert op_from_json(op_to_json(partial)) == partial and op_from_json(op_to_json(whole)) == whole


def test_an_unknown_kind_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^schedule step of unknown kind 'teleport'; run `restage plan` again"):
        op_from_json({"kind": "teleport", "ranks": [0]})
