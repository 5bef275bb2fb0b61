"""The default timeouts survive a long step on a cluster (NCCL's watchdog counts from when an op is queued)."""

from restage.config.sections import RunConfig


def test_default_timeouts_outlast_a_long_step():
    run = RunConfig()
    assert run.collective_timeout_seconds == 1800.0  # a 70B train step can take many minutes
    assert run.startup_timeout_seconds == 3600.0  # peers may still be importing at the rendezvous
    assert run.peer_wait_timeout_seconds == 7200.0  # a receiver may wait for a whole generate or train step
