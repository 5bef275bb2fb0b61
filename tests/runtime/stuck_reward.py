"""A rule-based reward that never returns on rank 1 from its third call: a rank stuck inside an MFC whose process
(and heartbeat thread) keeps running."""

import os
import time

CALLS = {"n": 0}


def reward(prompts, answers):
    CALLS["n"] += 1
    if CALLS["n"] >= 3 and os.environ.get("OMPI_COMM_WORLD_RANK") == "1":
        while True:
            time.sleep(1.0)
    return [0.0 for _ in prompts]
