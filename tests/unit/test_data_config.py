"""DataConfig / DataSource validation through the config builder (errors name the dotted key)."""

import pytest

from tidal.config_base import ConfigError, build
from tidal.data import DataConfig, DataSource


def test_defaults():
    cfg = build(DataConfig, {"train": [{"path": "a.jsonl"}]})
    assert cfg.train == [DataSource(path="a.jsonl", weight=1.0, format="auto")]
    assert (cfg.prompt_key, cfg.messages_key, cfg.reference_key, cfg.label_key, cfg.image_key) == ("prompt", "messages", "reference", "label", "images")
    assert cfg.apply_chat_template and cfg.shuffle and cfg.overlong_prompt == "error" and cfg.system_prompt is None


@pytest.mark.parametrize(
    "data, key",
    [
        ({"train": [{"path": "a", "weight": 0}]}, "data.train[0].weight"),
        ({"eval": [{"path": "a", "format": "csv"}]}, "data.eval[0].format"),
        ({"train": [{"path": ""}]}, "data.train[0].path"),
        ({"max_prompt_len": 0}, "data.max_prompt_len"),
        ({"overlong_prompt": "truncate"}, "data.overlong_prompt"),
        ({"label_key": "prompt"}, "data.label_key"),
        ({"system_prompt": "x", "apply_chat_template": False}, "data.system_prompt"),
        ({"prompt_kye": "q"}, "data.prompt_kye"),
    ],
)
def test_errors_name_the_key(data, key):
    with pytest.raises(ConfigError) as e:
        build(DataConfig, data, prefix="data")
    assert e.value.key == key
