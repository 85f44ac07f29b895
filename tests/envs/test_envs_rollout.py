"""Multi-turn rollouts with a scripted model: exact token-in/token-out, limits, failures, rows,
and decoding that goes on while a tool runs."""

import threading
import time
import types

import pytest
import torch

from tidal.engine.base import Completion, SamplingParams
from tidal.envs import EnvConfig, EnvError, EnvRollout, Environment, Observation, StepResult, pack_trajectories
from tidal.envs.calculator import CalculatorEnv
from tidal.envs.tool_calls import format_tool_call, tool_message
from tidal.envs.tool_env import ToolEnv
from tidal.envs.tools import FunctionTool, ToolFailure

from tests.e2e import plain_rollout
from tests.envs.helpers import ScriptedEngine, char_ids, chat_row

CALL = format_tool_call("calculator", {"expression": "347*29"})
TURN1 = "Zyx: let me compute.\n" + CALL
TURN2 = "The answer is 10063."


def calculator_policy(text, turn):
    return TURN1 if turn == 0 else TURN2


def _run(tok, cfg, policy, rows=None, n=1, env_factory=None, max_new_tokens=256, on_generate=None):
    engine = ScriptedEngine(tok, policy, on_generate)
    rows = rows or [chat_row(tok, "Calculate 347*29", reference="10063")]
    rollout = EnvRollout(cfg, tok, env_factory=env_factory)
    result = rollout.run(engine.generate, rows, SamplingParams(max_new_tokens=max_new_tokens, n=n))
    return result, engine


# ---- exact token-in/token-out ------------------------------------------------------------------------
def test_sequence_is_prompt_turns_and_observations_appended(qwen25_tok):
    tok = qwen25_tok
    result, engine = _run(tok, EnvConfig(name="calculator"), calculator_policy)
    (traj,) = result.trajectories
    r = EnvRollout(EnvConfig(name="calculator"), tok).renderer
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    prompt = r.prompt_ids([{"role": "user", "content": "Calculate 347*29"}], CalculatorEnv(EnvConfig()).toolset.schemas())
    t1, t2 = char_ids(tok, TURN1) + [eos], char_ids(tok, TURN2) + [eos]
    obs1 = r.encode(r.observation_text([tool_message("10063")]))[1:]  # minus the <|im_end|> the model sampled
    assert t1 != tok(TURN1 + "<|im_end|>", add_special_tokens=False)["input_ids"]  # a re-encoding would show
    (row,) = traj.rows
    assert row.input_ids == prompt + t1 + obs1 + t2
    assert row.action_mask == [1] * len(t1) + [0] * len(obs1) + [1] * len(t2)
    # The engine saw exactly the trajectory's prefix at each turn.
    assert [c.prompts for c in engine.calls] == [[prompt], [prompt + t1 + obs1]]
    # Logprobs: the engine's, in order, on the sampled tokens only.
    sampled_logps = [x for x, m in zip(row.logprobs, row.action_mask) if m]
    assert sampled_logps == [-(k + 1) / 1000 for k in range(len(t1) + len(t2))]
    assert all(x == 0.0 for x, m in zip(row.logprobs, row.action_mask) if not m)
    # Turn boundaries, conversation, finish.
    assert [(t.start, t.num_sampled, t.num_observation) for t in traj.turns] == [(0, len(t1), len(obs1)), (len(t1) + len(obs1), len(t2), 0)]
    assert traj.finish_reason == "done" and traj.valid
    assert [m["role"] for m in traj.messages] == ["user", "assistant", "tool", "assistant"]
    assert traj.messages[2]["content"] == "10063" and traj.messages[3]["content"] == TURN2
    sample = traj.reward_sample(0)
    assert sample.response == TURN2 and sample.response_ids == t2 and sample.messages == traj.messages
    assert result.metrics["env/tool_calls"] == 1 and result.metrics["env/turns_mean"] == 2


def test_packed_rows_match_the_trajectory(qwen25_tok):
    result, _ = _run(qwen25_tok, EnvConfig(name="calculator"), calculator_policy, n=2)
    packed = pack_trajectories(result.trajectories, pad_id=qwen25_tok.pad_token_id)
    assert packed.sequences_BT.shape[0] == 2 and not packed.multi_row and packed.advantage_trajectory_ids() is None
    for b, traj in enumerate(result.trajectories):
        row = traj.rows[0]
        P, L = len(row.prompt_ids), len(row.token_ids)
        assert packed.sequences_BT[b, : P + L].tolist() == row.input_ids
        assert packed.action_mask_BT[b].tolist() == [0.0] * P + [float(m) for m in row.action_mask] + [0.0] * (packed.sequences_BT.shape[1] - P - L)
        assert torch.allclose(packed.rollout_logp_BT[b, P: P + L], torch.tensor(row.logprobs))
    assert packed.group_ids_B.tolist() == [0, 0] and packed.valid_B.all()


def test_sampled_tokens_are_never_re_encoded(qwen25_tok, monkeypatch):
    tok = qwen25_tok
    encoded = []
    original = type(tok).__call__

    def spy(self, text, *a, **k):
        encoded.append(text)
        return original(self, text, *a, **k)

    monkeypatch.setattr(type(tok), "__call__", spy)
    _run(tok, EnvConfig(name="calculator"), calculator_policy)
    assert encoded and not [t for t in encoded if "Zyx" in t or "The answer" in t]


def test_single_turn_is_a_plain_rollout(qwen25_tok):
    """single_turn: one generate call with each row's prompt ids and the sampler's n, and the
    packed tensors equal what the trainer packed from those completions before environments."""
    tok = qwen25_tok
    rows = [chat_row(tok, "Calculate 1+2", where="a:0"), chat_row(tok, "Calculate 3+4", where="a:1")]
    result, engine = _run(tok, EnvConfig(), lambda text, turn: "3", rows=rows, n=3)
    assert len(engine.calls) == 1
    assert engine.calls[0].prompts == [rows[0].prompt_ids, rows[1].prompt_ids] and engine.calls[0].params.n == 3
    assert [t.group_id for t in result.trajectories] == [0, 0, 0, 1, 1, 1]
    packed = pack_trajectories(result.trajectories, pad_id=tok.pad_token_id)
    comps = [Completion(prompt_ids=t.rows[0].prompt_ids, token_ids=t.rows[0].token_ids, logprobs=t.rows[0].logprobs,
                        finish_reason="stop") for t in result.trajectories]
    reference = plain_rollout.pack(comps, [types.SimpleNamespace(mm_inputs=None)] * len(rows), tok.pad_token_id)
    for key in ("sequences_BT", "attention_mask_BT", "action_mask_BT", "rollout_logp_BT"):
        assert torch.equal(getattr(packed, key), reference[key]), key
    assert result.trajectories[0].reward_sample(0).response == "3"


def test_duplicate_prompts_keep_the_samplers_n(qwen25_tok):
    """Two rows with the same prompt are still two prompts of n samples each (the call a plain
    rollout makes), not one prompt of 2n."""
    tok = qwen25_tok
    rows = [chat_row(tok, "same", where="a:0"), chat_row(tok, "same", where="a:1")]
    _, engine = _run(tok, EnvConfig(), lambda text, turn: "3", rows=rows, n=2)
    assert engine.calls[0].prompts == [rows[0].prompt_ids, rows[1].prompt_ids] and engine.calls[0].params.n == 2


# ---- rows: templates that rewrite history -----------------------------------------------------------------
class FeedbackEnv(Environment):
    """Answer, get "try again" once as a USER message, answer again."""

    def reset(self, row):
        return Observation(messages=row.messages)

    def step(self, turn):
        if turn.index == 0:
            return StepResult(observation=Observation(messages=[{"role": "user", "content": "Try again."}]), reward=-0.5)
        return StepResult(done=True, reward=1.0)


def _feedback_policy(text, turn):
    return f"<think>\nhmm {turn}\n</think>\n\nanswer {turn}"


def test_history_template_starts_a_new_row_per_turn(qwen3_tok):
    tok = qwen3_tok
    factory = lambda: FeedbackEnv(EnvConfig(history="template"))  # noqa: E731
    result, engine = _run(tok, EnvConfig(history="template"), _feedback_policy, env_factory=factory)
    (traj,) = result.trajectories
    assert len(traj.rows) == 2
    # Row 1's prompt is the conversation re-rendered: Qwen3 dropped turn 0's <think> block.
    assert "hmm 0" not in tok.decode(traj.rows[1].prompt_ids) and "answer 0" in tok.decode(traj.rows[1].prompt_ids)
    assert engine.calls[1].prompts == [traj.rows[1].prompt_ids]
    for row in traj.rows:  # each row: its prompt, then only sampled tokens
        assert row.action_mask == [1] * len(row.token_ids)
    # In append mode the same conversation is one row that keeps the earlier <think>.
    appended, _ = _run(tok, EnvConfig(), _feedback_policy, env_factory=lambda: FeedbackEnv(EnvConfig()))
    assert len(appended.trajectories[0].rows) == 1 and "hmm 0" in tok.decode(appended.trajectories[0].rows[0].input_ids)
    packed = pack_trajectories(result.trajectories + appended.trajectories, pad_id=tok.pad_token_id)
    assert packed.multi_row and packed.advantage_trajectory_ids().tolist() == [0, 0, 1]
    # Per-turn reward -0.5 at the last sampled token of turn 0; outcome 1.0 on the trajectory.
    b0 = packed.token_rewards_BT[0]
    last0 = len(traj.rows[0].prompt_ids) + traj.turns[0].num_sampled - 1
    assert b0[last0] == -0.5 and b0.abs().sum() == 0.5 and packed.token_rewards_BT[1].abs().sum() == 0
    assert traj.outcome_reward == 1.0


def test_history_template_needs_message_observations(qwen3_tok):
    class TokenObsEnv(FeedbackEnv):
        def step(self, turn):
            return StepResult(observation=Observation(token_ids=[1, 2])) if turn.index == 0 else StepResult(done=True)

    with pytest.raises(EnvError, match="observations must be messages"):
        _run(qwen3_tok, EnvConfig(history="template"), _feedback_policy, env_factory=lambda: TokenObsEnv(EnvConfig()))


# ---- limits -------------------------------------------------------------------------------------------------
def test_max_turns(qwen25_tok):
    result, _ = _run(qwen25_tok, EnvConfig(name="calculator", max_turns=3), lambda text, turn: CALL)
    (traj,) = result.trajectories
    assert traj.finish_reason == "max_turns" and len(traj.turns) == 3 and traj.valid
    assert traj.turns[-1].num_observation == 0  # nothing appended after the last allowed turn
    assert result.metrics["env/finish/max_turns_frac"] == 1.0


def test_max_tokens_per_turn(qwen25_tok):
    policy = lambda text, turn: CALL if turn == 0 else TURN2  # noqa: E731
    result, engine = _run(qwen25_tok, EnvConfig(name="calculator", max_tokens_per_turn=20), policy)
    assert all(c.params.max_new_tokens == 20 for c in engine.calls)
    (traj,) = result.trajectories
    assert traj.turns[0].finish_reason == "length" and traj.turns[0].num_sampled == 20
    # A cut turn has an unclosed call: the model is told, and the template closes its turn.
    assert traj.messages[2]["content"].startswith("error: tool call 1 is not closed")


def test_max_total_tokens(qwen25_tok):
    first_turn = len(char_ids(qwen25_tok, TURN1)) + 1
    cfg = EnvConfig(name="calculator", max_total_tokens=first_turn + 5)
    result, engine = _run(qwen25_tok, cfg, calculator_policy)
    (traj,) = result.trajectories
    assert engine.calls[0].params.max_new_tokens == first_turn + 5
    assert traj.finish_reason == "max_total_tokens" and len(traj.turns) == 1 and traj.num_response_tokens <= first_turn + 5


# ---- failures -----------------------------------------------------------------------------------------------
class BrokenEnv(Environment):
    def __init__(self, cfg, where="step"):
        super().__init__(cfg)
        self.where = where

    def reset(self, row):
        if self.where == "reset":
            raise KeyError("no such row field")
        return Observation(messages=row.messages)

    def step(self, turn):
        if self.where == "hang":
            time.sleep(3)
        raise ValueError("boom")


@pytest.mark.parametrize("where, stage", [("reset", "reset"), ("step", "step of turn 0")])
def test_an_environment_that_raises_stops_the_run_naming_env_and_row(qwen25_tok, where, stage):
    with pytest.raises(EnvError, match=rf"environment 'environment' failed on row rows.jsonl:7 \({stage}\)"):
        _run(qwen25_tok, EnvConfig(), calculator_policy, rows=[chat_row(qwen25_tok, "q", where="rows.jsonl:7")],
             env_factory=lambda: BrokenEnv(EnvConfig(), where))


def test_an_environment_that_raises_is_a_counted_drop(qwen25_tok):
    cfg = EnvConfig(on_error="drop")
    result, _ = _run(qwen25_tok, cfg, calculator_policy, n=2, env_factory=lambda: BrokenEnv(cfg, "step"))
    assert all(t.finish_reason == "env_error" and not t.valid and "ValueError: boom" in t.error for t in result.trajectories)
    assert result.metrics["env/errors"] == 1.0 and result.metrics["env/errors_frac"] == 1.0  # per trajectory
    assert result.metrics["env/invalid_frac"] == result.metrics["env/finish/env_error_frac"] == 1.0
    assert not pack_trajectories(result.trajectories, 0).valid_B.any()


def test_a_reset_that_raises_keeps_the_prompt_as_an_invalid_row(qwen25_tok):
    """A trajectory without any turn still packs as one row (its prompt, nothing sampled, invalid),
    so every prompt keeps its n rows."""
    cfg = EnvConfig(on_error="drop")
    rows = [chat_row(qwen25_tok, "q", where="r:0")]
    result, engine = _run(qwen25_tok, cfg, calculator_policy, rows=rows, n=2, env_factory=lambda: BrokenEnv(cfg, "reset"))
    assert not engine.calls and all(not t.turns and t.finish_reason == "env_error" for t in result.trajectories)
    packed = pack_trajectories(result.trajectories, 0)
    assert packed.sequences_BT.shape[0] == 2 and not packed.valid_B.any() and packed.action_mask_BT.sum() == 0
    assert packed.sequences_BT[0].tolist() == rows[0].prompt_ids and packed.group_ids_B.tolist() == [0, 0]


def test_a_step_past_its_limit_is_an_environment_error(qwen25_tok):
    cfg = EnvConfig(step_timeout_s=0.5, tool_timeout_s=0.1)
    with pytest.raises(EnvError, match="step_timeout_s=0.5"):
        _run(qwen25_tok, cfg, calculator_policy, env_factory=lambda: BrokenEnv(cfg, "hang"))


class FlakyToolEnv(ToolEnv):
    def make_tools(self):
        def fail(expression):
            raise ToolFailure("the calculator backend is down")

        return [FunctionTool(fail, name="calculator", description="d",
                             parameters={"type": "object", "properties": {"expression": {"type": "string"}}})]


@pytest.mark.parametrize("mode", ["observation", "drop"])
def test_a_failing_tool_is_an_observation_or_a_counted_drop(qwen25_tok, mode):
    cfg = EnvConfig(tool_failure=mode)
    result, _ = _run(qwen25_tok, cfg, calculator_policy, env_factory=lambda: FlakyToolEnv(cfg))
    (traj,) = result.trajectories
    assert result.metrics["env/tool_failures"] == 1
    if mode == "observation":
        assert traj.valid and traj.finish_reason == "done" and "backend is down" in traj.messages[2]["content"]
    else:
        assert not traj.valid and traj.finish_reason == "tool_failure" and len(traj.turns) == 1
        assert result.metrics["env/tool_failure_drops"] == 1


def test_a_malformed_call_is_an_observation(qwen25_tok):
    policy = lambda text, turn: "<tool_call>{oops}</tool_call>" if turn == 0 else TURN2  # noqa: E731
    result, _ = _run(qwen25_tok, EnvConfig(name="calculator"), policy)
    (traj,) = result.trajectories
    assert traj.valid and "not valid JSON" in traj.messages[2]["content"] and traj.messages[3]["content"] == TURN2
    assert result.metrics["env/tool_errors"] == 1


# ---- tools do not block the batch ---------------------------------------------------------------------------
def test_other_trajectories_keep_decoding_while_a_tool_runs(qwen25_tok):
    """Row "slow" calls a tool that returns only once row "fast" has been decoded for its third
    turn: a loop that waited for every tool before decoding again could never get there."""
    released = threading.Event()

    class GatedEnv(ToolEnv):
        def make_tools(self):
            def gate(expression):
                if expression == "slow":
                    assert released.wait(10), "the fast trajectory was not decoded while the tool waited"
                return "ok"

            return [FunctionTool(gate, name="calculator", description="d",
                                 parameters={"type": "object", "properties": {"expression": {"type": "string"}}})]

    def policy(text, turn):
        slow = "slow one" in text
        if turn == 0 or (not slow and turn < 3):
            return format_tool_call("calculator", {"expression": "slow" if slow else "fast"})
        return "done"

    def on_generate(texts):
        if any("fast one" in t and t.count("<|im_start|>assistant") == 3 for t in texts):
            released.set()

    cfg = EnvConfig(tool_timeout_s=15, step_timeout_s=70)
    rows = [chat_row(qwen25_tok, "the slow one", where="r:0"), chat_row(qwen25_tok, "the fast one", where="r:1")]
    result, _ = _run(qwen25_tok, cfg, policy, rows=rows, env_factory=lambda: GatedEnv(cfg), on_generate=on_generate)
    slow, fast = result.trajectories
    assert slow.valid and fast.valid and len(fast.turns) == 4 and len(slow.turns) == 2
    assert result.metrics["env/wait_s"] >= 0.0


def test_max_tokens_per_turn_replaces_the_samplers_limit(qwen25_tok):
    _, engine = _run(qwen25_tok, EnvConfig(name="calculator", max_tokens_per_turn=300), calculator_policy, max_new_tokens=16)
    assert engine.calls[0].params.max_new_tokens == 300
    _, engine = _run(qwen25_tok, EnvConfig(name="calculator"), calculator_policy, max_new_tokens=200)
    assert engine.calls[0].params.max_new_tokens == 200


def test_image_inputs_reach_the_engine_with_every_turn(qwen25_tok):
    """A row with images: single_turn passes its pixel inputs exactly as a plain rollout does;
    rows without images pass none (engines without image support never see the argument)."""
    seen = []

    class VisionEngine(ScriptedEngine):
        def generate(self, prompts, params, **kw):
            seen.append(kw.get("mm_inputs", "absent"))
            return super().generate(prompts, params)

    pix = {"pixel_values": torch.ones(1)}
    rows = [chat_row(qwen25_tok, "one"), chat_row(qwen25_tok, "two")]
    rows[0].mm_inputs = pix
    engine = VisionEngine(qwen25_tok, lambda text, turn: "3")
    EnvRollout(EnvConfig(), qwen25_tok).run(engine.generate, rows, SamplingParams(max_new_tokens=8, n=2))
    assert seen == [[pix, None]] and engine.calls[0].params.n == 2
    seen.clear()
    EnvRollout(EnvConfig(), qwen25_tok).run(engine.generate, rows[1:], SamplingParams(max_new_tokens=8))
    assert seen == ["absent"]


# ---- trajectories reported as they end (rewards scored while decoding) ------------------------------------
def test_each_trajectory_is_reported_when_it_ends_and_scored_as_at_the_end(qwen25_tok):
    """Row 0 answers at once, row 1 calls the calculator first: each trajectory is reported (and its
    group handed to the reward stream) once it ends, during the run; the streamed rewards equal one
    scoring call at the end, in the same order."""
    from tidal.rewards import RewardConfig, RewardEngine
    from tidal.rewards.stream import RewardStream
    from tidal.trainer.experience_maker import GroupScoring

    tok = qwen25_tok
    rows = [chat_row(tok, "quick: 2+2", reference="4", where="a:0"), chat_row(tok, "Calculate 347*29", reference="10063", where="a:1")]
    policy = lambda text, turn: "The answer is \\boxed{4}." if "quick" in text else calculator_policy(text, turn)  # noqa: E731
    reported, calls_at_report = [], []
    engine = ScriptedEngine(tok, policy)
    cfg = RewardConfig(components={"fmt": {"type": "think_answer_format"}, "len": {"type": "length_penalty", "max_tokens": 8}},
                       recipes={"default": [["fmt", 1.0], ["len", 0.5]]})
    with RewardEngine(cfg, device=torch.device("cpu")) as rewards:
        stream = RewardStream(rewards)
        feed = GroupScoring(stream, n=2)

        def on_trajectory(i, traj):
            reported.append((i, traj))
            calls_at_report.append(len(engine.calls))
            feed(i, traj)

        result = EnvRollout(EnvConfig(name="calculator"), tok).run(
            engine.generate, rows, SamplingParams(max_new_tokens=256, n=2), on_trajectory=on_trajectory)
        samples = [t.reward_sample(i) for i, t in enumerate(result.trajectories)]
        got, want = stream.results(samples), rewards.score(samples)
    assert sorted(i for i, _ in reported) == [0, 1, 2, 3]
    assert all(traj is result.trajectories[i] for i, traj in reported)
    at = {i: calls for (i, _), calls in zip(reported, calls_at_report)}
    # each reported once it ended, during the run: row 1's after its second turn's call
    assert at[0] >= 1 and at[1] >= 1 and at[2] >= 2 and at[3] >= 2
    assert torch.equal(got.total_B, want.total_B) and torch.equal(got.valid_B, want.valid_B)
    assert got.components["len"].tolist() == want.components["len"].tolist() and want.components["len"].min() < 0


# ---- the model's context bounds every trajectory (env.max_total_tokens: 0) -------------------------------
class VerboseEnv(Environment):
    """Answers every turn with an observation of ``size`` characters (a tool that prints a file)."""

    def __init__(self, cfg, size=200, first=None):
        super().__init__(cfg)
        self.size, self.first = size, first

    def reset(self, row):
        return Observation(messages=self.first or row.messages)

    def step(self, turn):
        return StepResult(observation=Observation(messages=[{"role": "user", "content": "y" * self.size}]))


class BoundedEngine(ScriptedEngine):
    """A scripted engine with the native engine's context rule: a prompt must leave room for one
    sampled token, and sampling stops at the context."""

    def __init__(self, tok, policy, positions):
        super().__init__(tok, policy)
        self.positions = positions

    def generate(self, prompts, params):
        for p in prompts:
            if len(p) >= self.positions:
                raise ValueError(f"{len(p)} prompt tokens >= max_position_embeddings={self.positions}")
        return [c if len(c.prompt_ids) + len(c.token_ids) <= self.positions else
                Completion(prompt_ids=c.prompt_ids, token_ids=c.token_ids[: self.positions - len(c.prompt_ids)],
                           logprobs=c.logprobs[: self.positions - len(c.prompt_ids)], finish_reason="length")
                for c in super().generate(prompts, params)]


@pytest.mark.parametrize("history", ["append", "template"])
def test_an_observation_beyond_the_context_ends_the_trajectory(qwen25_tok, history):
    """Was: the engine's ValueError ended the whole run (env.on_error: drop did not catch it)."""
    positions = 500
    cfg = EnvConfig(max_turns=50, history=history)
    engine = BoundedEngine(qwen25_tok, lambda text, turn: "ok", positions)
    rows = [chat_row(qwen25_tok, "q")]
    with pytest.raises(ValueError, match="max_position_embeddings=500"):  # without the bound: the engine refuses
        EnvRollout(cfg, qwen25_tok, env_factory=lambda: VerboseEnv(cfg)).run(engine.generate, rows, SamplingParams(max_new_tokens=64))
    engine = BoundedEngine(qwen25_tok, lambda text, turn: "ok", positions)
    rollout = EnvRollout(cfg, qwen25_tok, env_factory=lambda: VerboseEnv(cfg), max_context=positions)
    (traj,) = rollout.run(engine.generate, rows, SamplingParams(max_new_tokens=64)).trajectories
    assert traj.finish_reason == "max_total_tokens" and traj.valid and traj.truncated and len(traj.turns) > 1
    assert all(len(row.input_ids) <= positions for row in traj.rows)
    assert all(len(p) + c.params.max_new_tokens <= positions for c in engine.calls for p in c.prompts)


def test_each_turn_samples_at_most_what_the_context_has_left(qwen25_tok):
    positions = 60
    cfg = EnvConfig(max_turns=50)
    engine = BoundedEngine(qwen25_tok, lambda text, turn: "z" * 100, positions)
    rollout = EnvRollout(cfg, qwen25_tok, env_factory=lambda: VerboseEnv(cfg, size=1), max_context=positions)
    (traj,) = rollout.run(engine.generate, [chat_row(qwen25_tok, "q")], SamplingParams(max_new_tokens=64)).trajectories
    (call,) = engine.calls  # the first turn fills the context: nothing is left for an observation
    assert call.params.max_new_tokens == positions - len(call.prompts[0])
    assert traj.finish_reason == "max_total_tokens" and len(traj.rows[0].input_ids) == positions


@pytest.mark.parametrize("on_error", ["raise", "drop"])
def test_a_first_observation_beyond_the_context_is_an_environment_error(qwen25_tok, on_error):
    cfg = EnvConfig(on_error=on_error)
    long_prompt = [{"role": "user", "content": "w" * 600}]
    rollout = EnvRollout(cfg, qwen25_tok, env_factory=lambda: VerboseEnv(cfg, first=long_prompt), max_context=500)
    engine = BoundedEngine(qwen25_tok, lambda text, turn: "ok", 500)
    run = lambda: rollout.run(engine.generate, [chat_row(qwen25_tok, "q", where="rows.jsonl:3")], SamplingParams(max_new_tokens=8))  # noqa: E731
    if on_error == "raise":
        with pytest.raises(EnvError, match=r"rows.jsonl:3 \(reset\).*the model's context \(500 positions\) leaves no room"):
            run()
    else:
        (traj,) = run().trajectories
        assert traj.finish_reason == "env_error" and not traj.valid and not engine.calls
