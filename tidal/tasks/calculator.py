"""The calculator task: a tiny model learns to call a calculator tool for products it cannot
compute alone (the CPU quickstart of multi-turn tool use; docs/agentic.md).

A problem is ``a*b`` with ``a`` of ``a_digits`` and ``b`` of ``b_digits`` digits; the reference is
the exact product. A good trajectory (Qwen2.5 chat template, exact tokens of :mod:`tidal.envs`)::

    <|im_start|>system\\nUse the calculator tool.<|im_end|>\\n<|im_start|>user\\nCalculate 347*29<|im_end|>\\n
    <|im_start|>assistant\\n<tool_call>\\n{"name": "calculator", "arguments": {"expression": "347*29"}}\\n</tool_call><|im_end|>
    \\n<|im_start|>user\\n<tool_response>\\n10063\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n10063<|im_end|>

The warm start is supervised on such transcripts (loss on the assistant's tokens only, the same
mask RL uses). Phase 1 teaches the procedure on tool demonstrations only (call the tool with the
prompt's expression, copy its result). Phase 2 mixes in demonstrations that answer directly,
without the tool (a fraction ``direct_rate``): the model keeps the procedure but picks up the
habit of answering alone, which greedily wins (``The answer is ...`` starts the same way every
time) and is almost always wrong (it cannot multiply), while sampling still calls the tool now
and then and is then right. An exact-answer reward teaches it to call the tool. The reward is
``tidal.tasks.calculator:calculator_reward`` (the final turn's first integer equals the product).
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from pathlib import Path

import torch

from tidal.engine.base import SamplingParams
from tidal.engine.config import EngineConfig
from tidal.envs import ChatRenderer, EnvConfig, EnvRollout, EnvRow, TrajectoryBuilder
from tidal.envs.tool_calls import format_tool_call, tool_message
from tidal.rewards.types import RewardSample
from tidal.tasks.arithmetic import is_correct
from tidal.tasks.store import MARKER, TaskAssets, built, write_jsonl
from tidal.tasks.chatml import train_chatml_tokenizer
from tidal.tasks.config import CalculatorTaskConfig
from tidal.tasks.model import build_model, model_config
from tidal.tasks.sft import build_threads, kept_phase, train_masked, whole_build
from tidal.tasks.tokenizer import save_tokenizer

LABEL = "calculator"  # the rows' recipe label (CalculatorTaskConfig.name)
SYSTEM_PROMPT = "Use the calculator tool."
MAX_POSITIONS = 256


@dataclasses.dataclass(frozen=True)
class Product:
    a: int
    b: int

    @property
    def expression(self) -> str:
        return f"{self.a}*{self.b}"

    @property
    def prompt(self) -> str:
        return f"Calculate {self.expression}"

    @property
    def answer(self) -> int:
        return self.a * self.b

    def row(self) -> dict:
        return {"prompt": self.prompt, "reference": str(self.answer), "label": LABEL}


def split_products(cfg: CalculatorTaskConfig) -> tuple[list[Product], list[Product]]:
    """(train, eval): distinct problems drawn without replacement (seeded), disjoint."""
    lo_a, lo_b = 10 ** (cfg.a_digits - 1), 10 ** (cfg.b_digits - 1)
    n_b = 10**cfg.b_digits - lo_b
    picks = random.Random(cfg.seed).sample(range((10**cfg.a_digits - lo_a) * n_b), cfg.num_train + cfg.num_eval)
    problems = [Product(lo_a + i // n_b, lo_b + i % n_b) for i in picks]
    return problems[cfg.num_eval:], problems[: cfg.num_eval]


def calculator_reward(sample: RewardSample) -> float:
    """1.0 when the final turn's first integer equals the reference product, else 0.0 (scored on
    ``sample.response``, the final turn; the conversation in ``sample.messages`` is not needed)."""
    return 1.0 if is_correct(sample.response, sample.reference) else 0.0


def env_config(**overrides) -> EnvConfig:
    """The ``env`` section of the task: the calculator environment with a short system prompt and
    no tool schema in the prompt (a tiny model's context is short), at most 3 turns of 32 tokens."""
    settings = dict(name="calculator", kwargs={"system_prompt": SYSTEM_PROMPT, "tools_in_prompt": False}, max_turns=3,
                    max_tokens_per_turn=32)
    return EnvConfig(**{**settings, **overrides})


def answer_text(value: int) -> str:
    """How a demonstration states its final answer (the same words with or without the tool, so
    that answering directly starts with one likely token and greedy decoding shows the habit)."""
    return f"The answer is {value}."


def messages_of(problem: Product) -> list[dict]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": problem.prompt}]


def transcript(renderer: ChatRenderer, problem: Product, *, use_tool: bool) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of one demonstration, laid out exactly as a rollout builds it (the turns'
    tokens are what the model should sample; the observation is rendered by the template)."""
    eos = renderer.tokenizer.eos_token_id
    b = TrajectoryBuilder(renderer.prompt_ids(messages_of(problem)), messages_of(problem))
    if use_tool:
        call = format_tool_call("calculator", {"expression": problem.expression})
        ids = renderer.encode(call) + [eos]
        turn = b.add_turn(ids, [0.0] * len(ids), "stop", call)
        obs = [tool_message(str(problem.answer))]
        b.add_observation(renderer.observation_ids(obs, turn), obs)
    answer = answer_text(problem.answer)
    ids = renderer.encode(answer) + [eos]
    b.add_turn(ids, [0.0] * len(ids), "stop", answer)
    row = b.rows[0]
    return row.input_ids, [0] * len(row.prompt_ids) + row.action_mask


def _corpus(problems: list[Product]) -> list[str]:
    fixed = [SYSTEM_PROMPT, "Calculate", format_tool_call("calculator", {"expression": "1*2"}), answer_text(0)]
    return fixed * 50 + [f"{p.prompt} {answer_text(p.answer)}" for p in problems]


def evaluate(model, tokenizer, problems: list[Product], *, greedy: bool = True, seed: int = 0) -> dict[str, float]:
    """Roll the model out in the calculator environment (HF engine on the CPU): accuracy of the
    final answers and the fraction of trajectories that called the tool."""
    from tidal.engine.hf import HFEngine

    engine = HFEngine(model.config, EngineConfig(backend="hf", max_num_seqs=256), device=torch.device("cpu"), dtype=torch.float32)
    engine.load_weights(model.named_parameters())
    renderer = ChatRenderer(tokenizer)
    rows = [EnvRow(prompt_ids=renderer.prompt_ids(messages_of(p)), prompt_text=p.prompt, messages=[messages_of(p)[1]],
                   reference=str(p.answer), label=LABEL, where=f"eval:{i}") for i, p in enumerate(problems)]
    params = SamplingParams(temperature=0.0 if greedy else 1.0, max_new_tokens=32, seed=seed)
    result = EnvRollout(env_config(), tokenizer).run(engine.generate, rows, params)
    trajs = result.trajectories
    correct = sum(calculator_reward(t.reward_sample(i)) for i, t in enumerate(trajs) if t.turns)
    return {"accuracy": correct / len(trajs), "tool_call_rate": sum(t.counters.get("tool_calls", 0) > 0 for t in trajs) / len(trajs)}


def _warm_start(cfg: CalculatorTaskConfig, model, tokenizer, train: list[Product], held_out: list[Product], whole,
                phases: Path) -> dict:
    """The two SFT phases (see module docstring; phase 1 kept once finished, for a stopped build:
    :func:`tidal.tasks.sft.kept_phase`); returns their losses and held-out accuracies. ``whole``:
    the build's progress (:func:`tidal.tasks.sft.whole_build`)."""
    renderer = ChatRenderer(tokenizer)
    sft = dict(pad_id=tokenizer.pad_token_id, lr=cfg.sft_lr, batch_size=cfg.sft_batch_size, whole=whole)

    def phase_1() -> dict:
        tool = train_masked(model, [transcript(renderer, p, use_tool=True) for p in train], steps=cfg.sft_steps, seed=cfg.seed, **sft)
        return {"sft_loss": tool[-1] if tool else float("nan"), "tool_accuracy": evaluate(model, tokenizer, held_out)["accuracy"]}

    first = kept_phase(phases, "1", model, phase_1, steps=cfg.sft_steps, whole=whole)
    rng = random.Random(cfg.seed + 1)
    mixed = [transcript(renderer, p, use_tool=rng.random() >= cfg.direct_rate) for p in train]
    direct = train_masked(model, mixed, steps=cfg.sft_direct_steps, seed=cfg.seed + 1, **sft)
    greedy, sampled = evaluate(model, tokenizer, held_out), evaluate(model, tokenizer, held_out, greedy=False, seed=cfg.seed)
    return {
        **first,
        "direct_loss": direct[-1] if direct else float("nan"), "sft_accuracy": greedy["accuracy"],
        "tool_call_rate": greedy["tool_call_rate"], "sampled_accuracy": sampled["accuracy"],
        "sampled_tool_call_rate": sampled["tool_call_rate"],
    }


def prepare_calculator(cfg: CalculatorTaskConfig, *, workdir: str = "~/.cache/tidal/tasks", threads: int = 0,
                       run_threads: int = 0) -> TaskAssets:
    """The task's assets (train/eval JSONL, tokenizer + warm-started model), built once under
    ``workdir/calculator-<hash of cfg>`` with ``threads`` torch CPU threads, or when 0 the run's
    (:func:`tidal.tasks.sft.build_threads`; ``task.workdir``, ``task.sft_threads`` and
    ``run.cpu_threads`` in a run)."""
    return built(cfg, workdir, lambda c, out, phases: _build(c, out, phases, threads, run_threads))


def model_config_and_tokenizer(cfg: CalculatorTaskConfig):
    """(the Hugging Face config, the tokenizer) of the task's model as its build makes them, without
    building the model (:func:`tidal.tasks.assets.model_config_and_tokenizer`)."""
    tokenizer = train_chatml_tokenizer(_corpus(split_products(cfg)[0]), template="qwen2_5")
    return model_config(cfg, tokenizer, max_positions=MAX_POSITIONS), tokenizer


def _build(cfg: CalculatorTaskConfig, out: Path, phases: Path, sft_threads: int, run_threads: int) -> None:
    start = time.perf_counter()
    train, held_out = split_products(cfg)
    write_jsonl(out / "train.jsonl", [p.row() for p in train])
    write_jsonl(out / "eval.jsonl", [p.row() for p in held_out])
    tokenizer = train_chatml_tokenizer(_corpus(train), template="qwen2_5")
    with build_threads(sft_threads, run_threads), whole_build(cfg.name, cfg.sft_steps + cfg.sft_direct_steps) as whole:
        torch.manual_seed(cfg.seed)
        model = build_model(cfg, tokenizer, max_positions=MAX_POSITIONS)
        report = _warm_start(cfg, model, tokenizer, train, held_out, whole, phases)
    model.save_pretrained(out / "model")
    save_tokenizer(tokenizer, str(out / "model"))
    report["build_seconds"] = time.perf_counter() - start
    print(f"[tidal.tasks] built 'calculator' in {report['build_seconds']:.1f}s: {cfg.sft_steps} SFT steps on tool use "
          f"(held-out greedy accuracy {report['tool_accuracy']:.3f}), then {cfg.sft_direct_steps} with {cfg.direct_rate:.0%} "
          f"direct answers: held-out greedy accuracy {report['sft_accuracy']:.3f}, sampled accuracy "
          f"{report['sampled_accuracy']:.3f}, sampled tool-call rate {report['sampled_tool_call_rate']:.3f}", flush=True)
    (out / MARKER).write_text(json.dumps({"settings": dataclasses.asdict(cfg), **report}, indent=2))
