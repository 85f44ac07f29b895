"""The built-in parity preference task: rows follow the rule, settings change what is built, the
build is atomic and reused, and the model is a causal LM of the asked shape."""

import json

from transformers import AutoConfig

from tidal.config_base import build
from tidal.rm.config import PreferenceTaskConfig
from tidal.rm.task import asset_dir, parity_rows, prepare


def test_rows_follow_the_parity_rule():
    rows = parity_rows(300, max_digits=2, seed=3)
    for r in rows:
        want = 1 if " odd " in r["prompt"] else 0
        assert int(r["chosen"]) % 2 == want and int(r["rejected"]) % 2 == 1 - want
        assert 1 <= len(r["chosen"]) <= 2 and 1 <= len(r["rejected"]) <= 2
    assert {len(r["chosen"]) for r in rows} == {1, 2}
    assert {" odd " in r["prompt"] for r in rows} == {True, False}
    assert rows == parity_rows(300, max_digits=2, seed=3) != parity_rows(300, max_digits=2, seed=4)
    assert max(len(r["chosen"]) for r in parity_rows(50, max_digits=4, seed=0)) == 4


def test_prepare_builds_once_with_the_asked_shape(tmp_path):
    cfg = build(PreferenceTaskConfig, {"name": "parity", "workdir": str(tmp_path), "num_train": 10, "num_eval": 4,
                                       "hidden_size": 16, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 32})
    assets = prepare(cfg)
    train = [json.loads(line) for line in open(assets.train_path)]
    assert len(train) == 10 and len(open(assets.eval_path).readlines()) == 4
    config = AutoConfig.from_pretrained(assets.model_path)
    assert config.hidden_size == 16 and config.num_hidden_layers == 1 and config.architectures == ["Qwen2ForCausalLM"]
    stamp = (asset_dir(cfg) / "task.json").stat().st_mtime_ns
    assert prepare(cfg) == assets and (asset_dir(cfg) / "task.json").stat().st_mtime_ns == stamp  # reused, not rebuilt
    other = build(PreferenceTaskConfig, {**cfg.__dict__, "seed": 1})
    assert asset_dir(other) != asset_dir(cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == [asset_dir(cfg).name]  # no temporary leftovers
