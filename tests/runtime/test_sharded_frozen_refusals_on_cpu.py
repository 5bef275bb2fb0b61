"""What a sharded frozen model cannot do is refused in one line naming the key to change."""

import pytest

from restage.config.load import load_config
from restage.errors import ConfigError
from restage.runtime.store.sharded_frozen import check_sharded


@pytest.mark.parametrize("extra, why", [(["models.ref.trainable=true"], "models.ref.trainable is set"),
                                        (["models.ref.offload_when_idle=true"], "models.ref.offload_when_idle is set")])
def test_a_config_that_shards_what_cannot_be_sharded_is_refused(extra, why):
    with pytest.raises(ConfigError) as refused:
        load_config("jobs/grpo_tiny.yaml", ["models.ref.shard_frozen=true", *extra])
    message = str(refused.value)
    assert "\n" not in message and why in message and message.endswith("set models.ref.shard_frozen false")


@pytest.mark.parametrize("args, why", [((True, False, False, 1, False), "it is trained"),
                                       ((False, False, False, 2, False), "its layout has ep > 1"),
                                       ((False, False, False, 1, True), "a layout other than its home")])
def test_the_runtime_refuses_what_the_schedule_asks_of_a_sharded_model(args, why):
    with pytest.raises(ConfigError) as refused:
        check_sharded("ref", *args)
    assert why in str(refused.value) and "\n" not in str(refused.value)
    check_sharded("ref", False, False, False, 1, False)  # a frozen model on its home layout: fine
