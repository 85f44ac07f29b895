"""Weight sync can never be silently stale: every sync is read back and compared (an engine that
drops or alters what it is sent fails at once, naming the weights), and the per-step
rollout/trainer logprob difference has an alarm (warn, counted; or stop)."""

import pytest
import torch

from tests.engine.helpers import tiny_hf
from tidal.build import build_trainer
from tidal.config import load_config
from tidal.distributed import shutdown
from tidal.engine.config import EngineConfig
from tidal.engine.hf import HFEngine
from tidal.engine.native import NativeEngine
from tidal.sync import WeightSyncError, mismatch_alarm

CPU = torch.device("cpu")


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_native_engine_verifies_exactly_what_it_holds(arch):
    hf = tiny_hf(arch, seed=0)
    engine = NativeEngine(hf.config, EngineConfig(kv_cache_max_tokens=256), device=CPU, dtype=torch.float32)
    named = [(n, p.detach().clone()) for n, p in hf.named_parameters()]
    engine.load_weights(named)
    assert engine.verify_weights(named) == []
    qkv = engine.model.model.layers[0].self_attn.qkv_proj.weight
    qkv.data[-1, 0] += 1.0  # the last row of the packed q/k/v is v_proj's
    assert engine.verify_weights(named) == ["model.layers.0.self_attn.v_proj.weight"]
    engine.load_weights(named)
    other = [(n, t + 1.0) if n.endswith("mlp.gate_proj.weight") else (n, t) for n, t in named]
    assert engine.verify_weights(other) == sorted(n for n, _ in named if n.endswith("mlp.gate_proj.weight"))


def test_hf_engine_verifies_what_it_holds():
    hf = tiny_hf("qwen2", seed=0)
    engine = HFEngine(hf.config, EngineConfig(backend="hf"), device=CPU, dtype=torch.float32)
    named = [(n, p.detach().clone()) for n, p in hf.named_parameters()]
    engine.load_weights(named)
    assert engine.verify_weights(named) == []
    assert engine.verify_weights([(named[0][0], named[0][1] * 2 + 1)]) == [named[0][0]]


def test_mismatch_alarm_reads_either_metric():
    assert mismatch_alarm({"actor/mismatch_abs_logp_diff": 0.01}, 0.5) is None
    assert "actor/mismatch_abs_logp_diff = 2" in mismatch_alarm({"actor/mismatch_abs_logp_diff": 2.0}, 0.5)
    assert "mismatch/abs_logp_diff_mean" in mismatch_alarm({"mismatch/abs_logp_diff_mean": 0.9}, 0.5)
    assert mismatch_alarm({"mismatch/abs_logp_diff_mean": 9.0}, 0.0) is None  # 0: off


def _corrupting(engine):
    """The engine keeps only half of what it is sent (a stale/broken sync)."""
    load = engine.load_weights

    def load_half(named):
        load([(n, t * 0.5) for n, t in named])

    engine.load_weights = load_half


@pytest.mark.parametrize("verify, on_alarm", [(True, "warn"), (False, "stop"), (False, "warn")])
def test_a_stale_engine_is_caught(verify, on_alarm, tmp_path, tiny_task_overrides, capsys):
    cfg = load_config("quickstart", tiny_task_overrides + [
        f"run.output_dir={tmp_path}", "run.steps=2", "checkpoint.at_end=false", f"sync.verify={str(verify).lower()}",
        f"sync.on_alarm={on_alarm}", "sync.max_logp_diff=0.2",
    ])
    trainer = build_trainer(cfg)
    try:
        _corrupting(trainer.colocation.engine)
        if verify:
            with pytest.raises(WeightSyncError, match="does not hold .* of the weights it was sent"):
                trainer.fit()  # step 1's sync is read back
        elif on_alarm == "stop":
            with pytest.raises(WeightSyncError, match="> sync.max_logp_diff = 0.2"):
                trainer.fit()  # step 2 samples from the halved weights
        else:
            metrics = trainer.fit()
            assert metrics["sync/alarms"] == 1.0 and "warning: actor/mismatch_abs_logp_diff" in capsys.readouterr().out
    finally:
        shutdown()
