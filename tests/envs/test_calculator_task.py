"""The calculator task: data, demonstrations laid out exactly as rollouts build them, the reward,
the environment end to end with a scripted model, and (slow) the warm-started model."""

import json
import re

import pytest
from transformers import AutoTokenizer

from tidal.config_base import ConfigError, build
from tidal.engine.base import Completion, SamplingParams
from tidal.envs import ChatRenderer, EnvRollout, EnvRow
from tidal.envs.tool_calls import format_tool_call
from tidal.tasks.calculator import (
    CalculatorTaskConfig, Product, _corpus, answer_text, calculator_reward, env_config, messages_of, prepare_calculator,
    split_products, transcript,
)
from tidal.tasks import TaskConfig, prepare
from tidal.tasks.store import settings_hash
from tidal.tasks.chatml import train_chatml_tokenizer
from tidal.tasks.tokenizer import save_tokenizer


@pytest.fixture(scope="module")
def tok():
    train, _ = split_products(CalculatorTaskConfig(num_train=200, num_eval=10))
    return train_chatml_tokenizer(_corpus(train))


def _row(tok, p: Product, i=0) -> EnvRow:
    r = ChatRenderer(tok)
    return EnvRow(prompt_ids=r.prompt_ids(messages_of(p)), prompt_text=p.prompt, messages=[messages_of(p)[1]],
                  reference=str(p.answer), where=f"t:{i}")


@pytest.mark.parametrize("data, key", [({"a_digits": 0}, "a_digits"), ({"direct_rate": 1.5}, "direct_rate"),
                                       ({"num_train": 10**6}, "num_train"), ({"sft_direct_steps": -1}, "sft_direct_steps"),
                                       ({"num_heads": 3}, "num_heads")])
def test_config_validation(data, key):
    with pytest.raises(ConfigError) as e:
        build(CalculatorTaskConfig, data)
    assert e.value.key == key


@pytest.mark.parametrize("data, key", [
    ({"name": "calculator", "digits": 3}, "digits"),  # an arithmetic setting does nothing for the calculator task
    ({"name": "calculator", "sft_steps": 10}, "sft_steps"),
    ({"name": "arithmetic", "calculator": {"a_digits": 3}}, "calculator.a_digits"),
    ({"name": "calculator", "calculator": {"direct_rate": 2.0}}, "calculator.direct_rate"),
])
def test_task_section_refuses_the_other_tasks_settings(data, key):
    with pytest.raises(ConfigError) as e:
        build(TaskConfig, data)
    assert e.value.key == key


def test_calculator_is_a_task_name():
    cfg = build(TaskConfig, {"name": "calculator", "workdir": "/tmp/x", "sft_threads": 1, "calculator": {"a_digits": 3}})
    assert cfg.calculator.a_digits == 3 and cfg.calculator.b_digits == 2


def test_problems_are_distinct_disjoint_and_seeded():
    cfg = CalculatorTaskConfig(num_train=300, num_eval=50)
    train, held = split_products(cfg)
    assert len(set(train)) == 300 and not set(train) & set(held) and split_products(cfg) == (train, held)
    assert all(10 <= p.a < 100 and 10 <= p.b < 100 for p in train)
    assert train[0].row() == {"prompt": f"Calculate {train[0].a}*{train[0].b}", "reference": str(train[0].a * train[0].b),
                              "label": "calculator"}


class Canonical:
    """A scripted model that writes the demonstration's turns, tokenized canonically."""

    def __init__(self, tok, use_tool=True):
        self.tok, self.use_tool, self.r = tok, use_tool, ChatRenderer(tok)

    def reply(self, text):
        expr = re.search(r"Calculate (\d+\*\d+)", text).group(1)
        responses = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text)
        if self.use_tool and not responses:
            return format_tool_call("calculator", {"expression": expr})
        a, b = map(int, expr.split("*"))
        return answer_text(int(responses[-1]) if responses else a * b + 1)  # alone it gets it wrong

    def generate(self, prompts, params: SamplingParams):
        out = []
        for p in prompts:
            ids = self.r.encode(self.reply(self.tok.decode(p))) + [self.tok.eos_token_id]
            out += [Completion(prompt_ids=p, token_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop")] * params.n
        return out


def test_demonstrations_have_the_layout_of_rollouts(tok):
    """SFT trains on exactly the sequence (and mask) a rollout of the same turns produces."""
    p = Product(47, 87)
    result = EnvRollout(env_config(), tok).run(Canonical(tok).generate, [_row(tok, p)], SamplingParams(max_new_tokens=32))
    (traj,) = result.trajectories
    ids, mask = transcript(ChatRenderer(tok), p, use_tool=True)
    assert traj.rows[0].input_ids == ids
    assert [0] * len(traj.rows[0].prompt_ids) + traj.rows[0].action_mask == mask
    ids, mask = transcript(ChatRenderer(tok), p, use_tool=False)
    assert tok.decode(ids).endswith(f"<|im_start|>assistant\nThe answer is {p.answer}.<|im_end|>") and sum(mask) == len(tok(answer_text(p.answer))["input_ids"]) + 1


@pytest.mark.parametrize("use_tool, reward", [(True, 1.0), (False, 0.0)])
def test_environment_end_to_end_with_a_scripted_model(tok, use_tool, reward):
    problems = [Product(47, 87), Product(12, 34)]
    rows = [_row(tok, p, i) for i, p in enumerate(problems)]
    result = EnvRollout(env_config(), tok).run(Canonical(tok, use_tool).generate, rows, SamplingParams(max_new_tokens=32, n=2))
    assert len(result.trajectories) == 4
    for i, traj in enumerate(result.trajectories):
        assert traj.finish_reason == "done" and len(traj.turns) == (2 if use_tool else 1)
        assert calculator_reward(traj.reward_sample(i)) == reward
    # counters are means per trajectory; _frac: the share of trajectories with at least one
    assert result.metrics["env/tool_calls"] == result.metrics["env/tool_calls_frac"] == (1.0 if use_tool else 0.0)


def test_saved_tokenizer_keeps_the_tags_and_template(tok, tmp_path):
    save_tokenizer(tok, str(tmp_path))
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    text = format_tool_call("calculator", {"expression": "1*2"}) + "<|im_end|>"
    assert loaded(text, add_special_tokens=False)["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    assert loaded.decode(tok(text, add_special_tokens=False)["input_ids"], skip_special_tokens=True).startswith("<tool_call>")
    assert loaded.chat_template == tok.chat_template and loaded.eos_token == "<|im_end|>"


@pytest.mark.slow
def test_warm_start_learns_the_procedure_and_the_habit(tmp_path, task_workdir):
    """Phase 1 learns to call the tool and copy its result; phase 2 adds the habit of answering
    alone, which wins greedily (wrong), while sampling still calls the tool and is then right."""
    cfg = CalculatorTaskConfig(num_train=1500, num_eval=50)
    assets = prepare_calculator(cfg, workdir=str(task_workdir))
    report = json.loads((task_workdir / f"calculator-{settings_hash(cfg)}" / "task.json").read_text())
    assert report["tool_accuracy"] >= 0.8, report
    assert report["sft_accuracy"] <= 0.2 and report["tool_call_rate"] <= 0.2, report
    assert 0.1 <= report["sampled_tool_call_rate"] <= 0.7 and report["sampled_accuracy"] >= 0.1, report
    assert prepare_calculator(cfg, workdir=str(task_workdir)) == assets  # built once
    assert prepare(TaskConfig(name="calculator", workdir=str(task_workdir), calculator=cfg)) == assets  # task.name=calculator
    assert AutoTokenizer.from_pretrained(assets.model_path).chat_template
    other = CalculatorTaskConfig(num_train=1500, num_eval=50, seed=1)
    (tmp_path / f"calculator-{settings_hash(other)}").mkdir()
    with pytest.raises(ConfigError, match="was not built by Tidal"):
        prepare_calculator(other, workdir=str(tmp_path))
