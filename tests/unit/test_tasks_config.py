"""TaskConfig validation names the offending key."""

import pytest

from tidal.config_base import ConfigError, build
from tidal.tasks import TaskConfig


def test_defaults_valid_and_build_from_dict():
    cfg = build(TaskConfig, {"name": "arithmetic", "digits": 1, "num_train": 80, "num_eval": 20, "operations": ["+"]})
    assert cfg.name == "arithmetic" and cfg.operations == ["+"]
    assert TaskConfig().name == ""


@pytest.mark.parametrize(
    "data,key",
    [
        ({"name": "chess"}, "task.name"),
        ({"operations": ["*"]}, "task.operations[0]"),
        ({"operations": []}, "task.operations"),
        ({"digits": 1, "num_train": 200, "num_eval": 1}, "task.num_train"),  # 2 ops * 100 problems only
        ({"num_heads": 3}, "task.hidden_size"),
        ({"num_kv_heads": 3}, "task.num_kv_heads"),
        ({"sft_mistake_rate": 1.5}, "task.sft_mistake_rate"),
        ({"sft_lr": 0}, "task.sft_lr"),
        ({"sft_mistake_steps": -1}, "task.sft_mistake_steps"),
        ({"hidden": 64}, "task.hidden"),
    ],
)
def test_invalid_values_name_the_key(data, key):
    with pytest.raises(ConfigError) as err:
        build(TaskConfig, data, prefix="task")
    assert err.value.key == key
