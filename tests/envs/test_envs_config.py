"""``env.*``: validation naming the key, environments by name or import path, and the settings
not covered by the rollout tests (tool_timeout_s, max_tool_calls_per_turn, workers, kwargs,
chat_template_kwargs, sandbox)."""

import sys
import threading
import time

import pytest

from tidal.config_base import ConfigError, build
from tidal.engine.base import SamplingParams
from tidal.envs import EnvConfig, EnvRollout, SandboxConfig, TemplateError, Environment, Observation, StepResult, make_env_factory
from tidal.envs.base import env_class
from tidal.envs.calculator import CalculatorEnv
from tidal.envs.python_tool import PythonToolEnv
from tidal.envs.single_turn import SingleTurnEnv
from tidal.envs.tool_calls import format_tool_call
from tidal.envs.tool_env import ToolEnv
from tidal.envs.tools import FunctionTool

from tests.envs.helpers import ScriptedEngine, chat_row


@pytest.mark.parametrize("data, key", [
    ({"name": "nope"}, "env.name"),
    ({"name": ""}, "env.name"),
    ({"max_turns": 0}, "env.max_turns"),
    ({"max_tokens_per_turn": -1}, "env.max_tokens_per_turn"),
    ({"max_total_tokens": -1}, "env.max_total_tokens"),
    ({"tool_timeout_s": 0}, "env.tool_timeout_s"),
    ({"name": "calculator", "step_timeout_s": 30}, "env.step_timeout_s"),  # 4 calls x 10 s do not fit
    ({"tool_failure": "ignore"}, "env.tool_failure"),
    ({"max_tool_calls_per_turn": 0}, "env.max_tool_calls_per_turn"),
    ({"workers": 0}, "env.workers"),
    ({"on_error": "skip"}, "env.on_error"),
    ({"history": "rewrite"}, "env.history"),
    ({"sandbox": {"memory_mb": 8}}, "env.sandbox.memory_mb"),
    ({"sandbox": {"cpu_seconds": 0}}, "env.sandbox.cpu_seconds"),
    ({"sandbox": {"network": "on"}}, "env.sandbox.network"),
    ({"sandbox": {"max_output_chars": 5}}, "env.sandbox.max_output_chars"),
    ({"sandbox": {"file_mb": -1}}, "env.sandbox.file_mb"),
    ({"bogus": 1}, "env.bogus"),
])
def test_invalid_settings_name_the_key(data, key):
    with pytest.raises(ConfigError) as e:
        build(EnvConfig, data, prefix="env")
    assert e.value.key == key


class MyEnv(Environment):
    def __init__(self, cfg, greeting="hi"):
        super().__init__(cfg)
        self.greeting = greeting

    def reset(self, row):
        return Observation(token_ids=row.prompt_ids)

    def step(self, turn):
        return StepResult(done=True, reward=len(self.greeting))


def test_a_step_limit_below_the_tools_budget_is_fine_without_tools():
    """Only an environment that calls tools needs step_timeout_s > max_tool_calls_per_turn x tool_timeout_s."""
    assert build(EnvConfig, {"name": "single_turn", "step_timeout_s": 5, "tool_timeout_s": 10}).step_timeout_s == 5
    cfg = build(EnvConfig, {"name": "tests.envs.test_envs_config:_ToolUser", "step_timeout_s": 5, "tool_timeout_s": 10})
    with pytest.raises(ConfigError, match="env.step_timeout_s.*which calls tools"):
        env_class(cfg)


class _ToolUser(ToolEnv):
    def make_tools(self):
        return []


def test_environments_by_name_and_import_path():
    assert isinstance(make_env_factory(EnvConfig())(), SingleTurnEnv)
    assert isinstance(make_env_factory(EnvConfig(name="calculator"))(), CalculatorEnv)
    env = make_env_factory(EnvConfig(name="tests.envs.test_envs_config:MyEnv", kwargs={"greeting": "hello"}))()
    assert isinstance(env, MyEnv) and env.greeting == "hello" and env.name == "tests.envs.test_envs_config:MyEnv"
    with pytest.raises(TypeError, match="unexpected keyword"):
        make_env_factory(EnvConfig(name="tests.envs.test_envs_config:MyEnv", kwargs={"colour": 1}))
    with pytest.raises(ConfigError, match=r"does not take the settings \['x'\]"):
        make_env_factory(EnvConfig(kwargs={"x": 1}))
    with pytest.raises(ConfigError, match=r"'calculator' does not take the settings \['colour'\]"):
        make_env_factory(EnvConfig(name="calculator", kwargs={"colour": 1, "system_prompt": "hi"}))
    with pytest.raises(ConfigError, match="not a subclass"):
        make_env_factory(EnvConfig(name="tidal.envs.calculator:calculate"))
    with pytest.raises(ConfigError, match="cannot import module"):
        make_env_factory(EnvConfig(name="no_such_module:Env"))


def _gate_env(cfg, tool):
    class Gate(ToolEnv):
        def make_tools(self):
            return [FunctionTool(tool, name="calculator", description="d",
                                 parameters={"type": "object", "properties": {"expression": {"type": "string"}}})]

    return Gate(cfg)


def _rollout(tok, cfg, policy, factory, rows=None, n=1):
    engine = ScriptedEngine(tok, policy)
    rows = rows or [chat_row(tok, "Calculate 2+2")]
    return EnvRollout(cfg, tok, env_factory=factory).run(engine.generate, rows, SamplingParams(max_new_tokens=256, n=n)), engine


def _two_calls(text, turn):
    call = format_tool_call("calculator", {"expression": "2+2"})
    return call + call if turn == 0 else "4"


def test_tool_timeout_s(qwen25_tok):
    cfg = EnvConfig(tool_timeout_s=0.2, max_tool_calls_per_turn=1, step_timeout_s=5)
    result, _ = _rollout(qwen25_tok, cfg, _two_calls, lambda: _gate_env(cfg, lambda expression: time.sleep(3)))
    msgs = result.trajectories[0].messages
    assert msgs[2]["content"] == "error: tool 'calculator' timed out after 0.2 s"
    assert msgs[3]["content"] == "error: not run, at most 1 tool calls per turn"  # max_tool_calls_per_turn


def test_workers_run_steps_concurrently(qwen25_tok):
    def run(workers):
        active, peak, lock = [0], [0], threading.Lock()

        def tool(expression):
            with lock:
                active[0] += 1
                peak[0] = max(peak[0], active[0])
            time.sleep(0.2)
            with lock:
                active[0] -= 1
            return "4"

        cfg = EnvConfig(workers=workers)
        _rollout(qwen25_tok, cfg, lambda text, turn: format_tool_call("calculator", {"expression": "2+2"}) if turn == 0 else "4",
                 lambda: _gate_env(cfg, tool), n=4)
        return peak[0]

    assert run(1) == 1 and run(4) == 4


def test_tool_env_kwargs(qwen25_tok):
    cfg = EnvConfig(name="calculator", kwargs={"system_prompt": "Use the tool.", "tools_in_prompt": False})
    result, engine = _rollout(qwen25_tok, cfg, lambda text, turn: "4", None)
    prompt = qwen25_tok.decode(engine.calls[0].prompts[0])
    assert prompt.startswith("<|im_start|>system\nUse the tool.<|im_end|>") and "<tools>" not in prompt
    result, engine = _rollout(qwen25_tok, EnvConfig(name="calculator"), lambda text, turn: "4", None)
    assert '"name": "calculator"' in qwen25_tok.decode(engine.calls[0].prompts[0])  # default: tools listed


def test_chat_template_kwargs(qwen3_tok):
    call = format_tool_call("calculator", {"expression": "2+2"})
    for kwargs, want in (({}, False), ({"enable_thinking": False}, True)):
        cfg = EnvConfig(name="calculator", chat_template_kwargs=kwargs)
        result, engine = _rollout(qwen3_tok, cfg, lambda text, turn: call if turn == 0 else "4", None)
        second = qwen3_tok.decode(engine.calls[1].prompts[0])
        assert second.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") is want


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux")
def test_python_env_uses_the_sandbox_settings():
    cfg = EnvConfig(name="python", sandbox=SandboxConfig(max_output_chars=100))
    env = PythonToolEnv(cfg)
    (tool,) = env.toolset.tools.values()
    assert tool.call({"code": "print('z' * 500)"}, timeout_s=20).count("z") == 100


def test_tool_environments_refuse_a_template_without_tool_messages():
    from tidal.tasks.tokenizer import train_tokenizer

    with pytest.raises(TemplateError, match="<tool_response>"):
        EnvRollout(EnvConfig(name="calculator"), train_tokenizer(["Calculate 1+2"]))
    EnvRollout(EnvConfig(), train_tokenizer(["Calculate 1+2"]))  # single_turn needs no tool template


def test_multi_turn_refuses_the_sglang_adapter():
    from tidal.envs.base import check_engine_backend

    for backend in ("native", "hf", "vllm"):  # vllm: tests/engine/test_vllm_adapter.py (multi-turn, token exact)
        check_engine_backend(EnvConfig(name="calculator"), backend)
    check_engine_backend(EnvConfig(), "sglang")  # single_turn: today's path on every engine
    with pytest.raises(ConfigError, match="the sglang adapter generates single completions") as e:
        check_engine_backend(EnvConfig(name="python"), "sglang")
    assert e.value.key == "engine.backend"


def test_env_row_from_a_dataset_item(qwen25_tok, tmp_path):
    import json

    from tidal.data.config import DataConfig, DataSource
    from tidal.data.dataset import PromptDataset
    from tidal.envs import EnvRow

    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "Calculate 2+2", "reference": "4", "label": "calc", "extra": 1}) + "\n")
    data = PromptDataset([DataSource(path=str(path))], qwen25_tok, DataConfig(system_prompt="Be brief."), seed=0)
    row = EnvRow.from_prompt_item(data[0])
    assert row.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Calculate 2+2"}]
    assert row.prompt_ids == data[0].prompt_ids and row.reference == "4" and row.label == "calc"
    assert row.metadata == {"extra": 1} and row.where == f"{path}:0"
    data[0].messages.append({"role": "user", "content": "x"})  # a copy per access
    assert len(data[0].messages) == 2
