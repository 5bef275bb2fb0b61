"""Rewards with NaN on purpose (tests/runtime/test_nonfinite_multirank.py): the constant reward, but NaN for the
first answer of the NAN_CALL-th call on rank NAN_RANK (every generating rank calls it once per step), or always."""

import math
import os

CALLS = {"n": 0}
NAN_CALL, NAN_RANK = 2, "0"


def reward(prompts, answers):
    CALLS["n"] += 1
    out = [float(len(a) % 3) for a in answers]
    if CALLS["n"] == NAN_CALL and os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK")) == NAN_RANK:
        out[0] = math.nan
    return out


def always_nan(prompts, answers):
    return [math.nan for _ in prompts]
