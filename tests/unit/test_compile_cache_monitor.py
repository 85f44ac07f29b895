"""Cold start: where compiled code is cached (``strategy.compile_cache_dir``) and the compile monitor
(``time/compile``, a console message while compiling, recompiles counted after the first iteration)."""

import os

import pytest
import torch

from tidal.config_base import ConfigError
from tidal.logging.compile import CompileMonitor
from tidal.strategy import StrategyConfig
from tidal.strategy.compile_cache import resolve_compile_cache_dir, use_compile_cache


@pytest.fixture
def clean_env(monkeypatch):
    for k in ("TORCHINDUCTOR_CACHE_DIR", "TIDAL_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


def test_cache_dir_resolution(clean_env, tmp_path):
    clean_env.setenv("HOME", str(tmp_path))
    assert resolve_compile_cache_dir("auto") == str(tmp_path / ".cache" / "tidal" / "torch_compile")
    clean_env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert resolve_compile_cache_dir("auto") == str(tmp_path / "xdg" / "tidal" / "torch_compile")
    clean_env.setenv("TIDAL_CACHE_DIR", str(tmp_path / "t"))
    assert resolve_compile_cache_dir("auto") == str(tmp_path / "t" / "torch_compile")
    clean_env.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/else")  # the user's own choice wins
    assert resolve_compile_cache_dir("auto") == "/somewhere/else"
    assert resolve_compile_cache_dir("off") is None
    assert resolve_compile_cache_dir("~/cc") == os.path.join(str(tmp_path), "cc")
    with pytest.raises(ConfigError) as e:
        StrategyConfig(compile_cache_dir=" ")
    assert e.value.key == "compile_cache_dir"


def test_fsdp2_compiling_points_torch_caches_at_the_setting(clean_env, tmp_path):
    from transformers import AutoModelForCausalLM, Qwen2Config

    from tidal.distributed.runtime import init_runtime, shutdown
    from tidal.strategy import get_strategy

    rt = init_runtime(1, "cpu")
    try:
        cfg = Qwen2Config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                          intermediate_size=32, vocab_size=31)
        for compile in ("off", "on"):
            get_strategy(StrategyConfig(compile=compile, compile_cache_dir=str(tmp_path / "cc")), rt).prepare_frozen(
                AutoModelForCausalLM.from_config(cfg), offload=False)
            assert (os.environ.get("TORCHINDUCTOR_CACHE_DIR") == str(tmp_path / "cc")) == (compile == "on")
    finally:
        shutdown()


@pytest.mark.slow
def test_compiled_code_lands_in_the_cache_dir_and_is_reused(clean_env, tmp_path):
    """A compiled function's Inductor graph is written under the directory; compiled again from
    scratch (dynamo reset, in-memory caches cleared) it is a cache hit."""
    from torch._dynamo.utils import counters

    use_compile_cache(str(tmp_path / "cc"))

    def f(x):
        return torch.sin(x) * 2 + x.cos()

    for attempt in range(2):
        torch._dynamo.reset()
        counters.clear()
        torch.compile(f)(torch.randn(8))
        assert counters["inductor"]["fxgraph_cache_hit" if attempt else "fxgraph_cache_miss"] == 1, dict(counters["inductor"])
    assert any(p.is_file() for p in (tmp_path / "cc" / "fxgraph").rglob("*"))


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_monitor_times_compilations_and_flags_recompiles():
    clock, messages = _Clock(), []
    mon = CompileMonitor(messages.append, cache_dir="/cache", clock=clock)
    for start, end in [(1.0, 4.0), (5.0, 5.5)]:  # two compilations in the first iteration
        clock.t = start
        mon._on_start()
        clock.t = end
        mon._on_end()
    assert mon.pop() == {"time/compile": 3.5, "compile/graphs": 2.0, "compile/recompiles": 0.0}
    assert len(messages) == 1 and "first iteration" in messages[0] and "/cache" in messages[0]
    assert mon.pop() == {"time/compile": 0.0, "compile/graphs": 0.0, "compile/recompiles": 0.0}
    clock.t = 10.0
    mon._on_start()
    clock.t = 12.0
    mon._on_end()
    assert mon.pop() == {"time/compile": 2.0, "compile/graphs": 1.0, "compile/recompiles": 1.0}
    assert "recompiling in steady state" in messages[-1]


def test_monitor_hears_dynamo():
    messages = []
    torch._dynamo.reset()  # (also drops compile callbacks: install after it)
    with CompileMonitor(messages.append) as mon:
        torch.compile(lambda x: x * 3, backend="eager")(torch.ones(3))
        m = mon.pop()
    assert m["compile/graphs"] == 1 and m["time/compile"] > 0 and len(messages) == 1
    from torch._dynamo.callback import callback_handler

    assert mon._on_start not in callback_handler.start_callbacks  # removed on exit
