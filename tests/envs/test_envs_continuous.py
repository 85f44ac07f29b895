"""Continuous multi-turn rollouts on an engine with incremental requests (the native engine): a
trajectory's next turn is added the moment its observation is appended, the engine steps while
tools run. Same trajectories as the round-based loop; turns join a running batch; errors leave the
engine idle."""

import threading
import time
import types

import pytest
import torch

from tidal.distributed.generate import GroupGenerator
from tidal.engine.base import SamplingParams
from tidal.engine.config import EngineConfig
from tidal.engine.hf import HFEngine
from tidal.envs import EnvConfig, EnvError, EnvRollout, EnvRow, Environment, Observation, StepResult
from tidal.envs.rollout import LocalGenerator, incremental_engine

from tests.engine.helpers import engine_for, tiny_hf
from tests.runtimes import lone_runtime

OBSERVATION = [7, 8, 9]


class CountdownEnv(Environment):
    """``row.metadata["turns"]`` turns; each step answers with three fixed observation tokens
    (``gate`` first, when given), the last one is done with reward 1."""

    gate = None  # called with (row, turn) before answering (runs on the pool's thread)

    def reset(self, row):
        self.row = row
        return Observation(token_ids=list(row.prompt_ids))

    def step(self, turn):
        if self.gate is not None:
            self.gate(self.row, turn)
        if turn.index + 1 >= self.row.metadata["turns"]:
            return StepResult(done=True, reward=1.0)
        return StepResult(observation=Observation(token_ids=OBSERVATION), reward=0.5)


class Spy:
    """Wraps a native engine's incremental API: how many ``add`` calls the rollout made (``adds``;
    those of the engine's own ``generate``, which is built on ``add``, counted apart in
    ``generate_calls``), how many requests were added while others were still decoding
    (``joins``), and how many steps ran while an environment step was in flight."""

    def __init__(self, engine):
        self.engine, self.adds, self.joins, self.steps, self.steps_while_tools = engine, 0, 0, 0, 0
        self.tools_in_flight = self.generate_calls = 0
        self.in_generate = False
        self.lock = threading.Lock()
        self.on_step = None
        add, step, generate = engine.add, engine.step, engine.generate

        def spy_add(requests):
            self.adds += not self.in_generate
            self.joins += len(requests) if engine.has_unfinished() else 0
            return add(requests)

        def spy_generate(_engine, *args, **kwargs):  # a bound method named generate, as the rollout looks for
            self.generate_calls += 1
            self.in_generate = True
            try:
                return generate(*args, **kwargs)
            finally:
                self.in_generate = False

        spy_generate.__name__ = "generate"
        engine.generate = types.MethodType(spy_generate, engine)

        def spy_step():
            self.steps += 1
            with self.lock:
                self.steps_while_tools += self.tools_in_flight > 0
            out = step()
            if self.on_step is not None:
                self.on_step()
            return out

        engine.add, engine.step = spy_add, spy_step


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_hf("qwen2", vocab_size=128, max_position_embeddings=512)


def _rows(turns):
    g = torch.Generator().manual_seed(3)
    return [EnvRow(prompt_ids=torch.randint(20, 120, (int(k),), generator=g).tolist(), prompt_text="",
                   metadata={"turns": t}, where=f"r:{i}")
            for i, (k, t) in enumerate(zip(torch.randint(3, 9, (len(turns),), generator=g), turns))]


def _rollout(cfg, factory=None):
    from tidal.tasks.chatml import train_chatml_tokenizer

    tok = train_chatml_tokenizer(["a b c d e"] * 4)
    return EnvRollout(cfg, tok, env_factory=factory or (lambda: CountdownEnv(cfg)))


def _key(result):
    return [(t.rows[0].input_ids, t.rows[0].action_mask, [x.finish_reason for x in t.turns], [x.reward for x in t.turns],
             t.finish_reason, t.outcome_reward, t.group_id) for t in result.trajectories]


@pytest.mark.parametrize("limits", [dict(max_tokens_per_turn=5), dict(max_tokens_per_turn=6, max_total_tokens=14)])
def test_continuous_equals_rounds_under_greedy(model, limits):
    cfg = EnvConfig(name="single_turn", max_turns=3, **limits)
    rollout = _rollout(cfg, lambda: CountdownEnv(cfg))
    rows = _rows([3, 1, 2, 4])
    params = SamplingParams(temperature=0.0, max_new_tokens=16, n=2)
    engine = engine_for(model, kv_cache_max_tokens=4096)
    spy = Spy(engine)
    rounds = rollout.run(LocalGenerator(engine.generate), rows, params)
    assert spy.adds == 0 and spy.generate_calls > 0  # a plain generate callable: rounds
    engine = engine_for(model, kv_cache_max_tokens=4096)  # a fresh one: its prefix cache holds this rollout only
    spy = Spy(engine)
    cont = rollout.run(engine.generate, rows, params)
    assert spy.adds >= 2 and not engine.has_unfinished()  # turns added as they come (how many calls: thread timing)
    assert _key(cont) == _key(rounds)
    for a, b in zip(cont.trajectories, rounds.trajectories):
        assert torch.allclose(torch.tensor(a.rows[0].logprobs), torch.tensor(b.rows[0].logprobs), atol=1e-5)
    limit = "max_total_tokens" if "max_total_tokens" in limits else "max_turns"  # both end some trajectories
    assert {t.finish_reason for t in cont.trajectories} == {"done", limit}
    if "max_total_tokens" in limits:
        assert all(t.num_response_tokens <= 14 for t in cont.trajectories)
    assert set(cont.metrics) == set(rounds.metrics)  # the metric keys are those of the round-based loop
    assert cont.metrics["env/generate_calls"] == spy.adds
    # each turn's prompt is the trajectory so far: the full KV blocks of the previous turn's prompt
    # come from the prefix cache (block_size 4), and the n=2 samples of a prompt share its prefill
    earlier = 0
    for t in cont.trajectories:
        starts = [len(t.rows[0].prompt_ids) + x.start for x in t.turns]  # each turn's context length
        earlier += sum(4 * (n // 4) for n in starts[:-1])
    first = sum(4 * ((len(r.prompt_ids) - 1) // 4) for r in rows)  # the second sample of each prompt
    assert engine.stats["prefix_hit_tokens"] >= earlier + first


def test_a_turn_joins_while_others_decode(model):
    """Trajectory 1's tool answers only once trajectory 0's second turn has been stepped twice: the
    continuous loop adds trajectory 1's next turn while trajectory 0 is still decoding, and steps
    the engine while the tool is pending. The round-based loop can only do that across calls."""
    cfg = EnvConfig(name="single_turn", max_turns=3, max_tokens_per_turn=8)
    params = SamplingParams(temperature=0.0, max_new_tokens=8, n=1, ignore_eos=True)
    rows = _rows([3, 2])
    for path in ("continuous", "rounds"):
        engine = engine_for(model, kv_cache_max_tokens=4096)
        spy = Spy(engine)
        released, answered, steps_of_0 = threading.Event(), threading.Event(), []

        def gate(row, turn, spy=spy, released=released, answered=answered):
            with spy.lock:
                spy.tools_in_flight += 1
            try:
                if row.where == "r:1" and turn.index == 0:
                    assert released.wait(10), "trajectory 0 was not decoded while trajectory 1's tool waited"
                    answered.set()
            finally:
                with spy.lock:
                    spy.tools_in_flight -= 1

        def on_step(engine=engine, released=released, answered=answered, steps_of_0=steps_of_0):
            if 0 in engine._requests and len(engine._requests[0].prompt_ids) > len(rows[0].prompt_ids):
                steps_of_0.append(1)  # trajectory 0 is decoding a later turn
                if len(steps_of_0) == 2:  # release the tool, and let its answer land before the next step
                    released.set()
                    answered.wait(10)
                    time.sleep(0.05)

        spy.on_step = on_step

        def factory(gate=gate):
            env = CountdownEnv(cfg)
            env.gate = gate
            return env

        rollout = _rollout(cfg, factory)
        gen = engine.generate if path == "continuous" else LocalGenerator(engine.generate)
        result = rollout.run(gen, rows, params)
        assert [len(t.turns) for t in result.trajectories] == [3, 2]
        if path == "continuous":
            assert spy.joins >= 1 and spy.steps_while_tools >= 2
        else:
            assert spy.joins == 0 and spy.adds == 0  # one generate per round: nothing joins a running batch


class LatencyEnv(CountdownEnv):
    """A tool of fixed latency per row (``row.metadata["latency_s"]``) between turns; counts the
    tool calls in flight on the spy."""

    spy = None

    def step(self, turn):
        with self.spy.lock:
            self.spy.tools_in_flight += 1
        try:
            time.sleep(self.row.metadata["latency_s"])
            return super().step(turn)
        finally:
            with self.spy.lock:
                self.spy.tools_in_flight -= 1


def test_fixed_latency_tools_overlap_with_decoding(model):
    """Row r:0's tool answers at once, row r:1's after 30 ms; an engine step takes >= 5 ms (a
    device step's scale), so a 20-token turn takes >= 100 ms. Continuous: r:1's next turn joins
    while r:0 decodes, the engine steps while tools are pending, and the two trajectories' turns
    share steps. Rounds: each round decodes the trajectories ready at its start only, so r:0's and
    r:1's later turns take steps of their own."""
    cfg = EnvConfig(name="single_turn", max_turns=3, max_tokens_per_turn=20)
    params = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)
    rows = _rows([3, 3])
    rows[0].metadata["latency_s"], rows[1].metadata["latency_s"] = 0.0, 0.03
    out = {}
    for path in ("continuous", "rounds"):
        engine = engine_for(model, kv_cache_max_tokens=4096)
        spy = Spy(engine)
        spy.on_step = lambda: time.sleep(0.005)

        def factory(spy=spy):
            env = LatencyEnv(cfg)
            env.spy = spy
            return env

        gen = engine.generate if path == "continuous" else LocalGenerator(engine.generate)
        out[path] = (_rollout(cfg, factory).run(gen, rows, params), spy)
    (cont, c), (rounds, r) = out["continuous"], out["rounds"]
    assert _key(cont) == _key(rounds) and [len(t.turns) for t in cont.trajectories] == [3, 3]
    assert c.joins >= 1 and c.steps_while_tools >= 1 and r.joins == 0
    assert c.steps < r.steps  # shared steps: decoding overlapped instead of queueing behind a round
    assert set(cont.metrics) == set(rounds.metrics)


class RaisingEnv(CountdownEnv):
    """Row r:1's first step raises, once row r:0 is decoding its second turn (``decoding`` set)."""

    decoding = raised = None

    def step(self, turn):
        if self.row.where == "r:1":
            if self.decoding is not None:
                assert self.decoding.wait(10)
                self.raised.set()
            raise ValueError("boom")
        return super().step(turn)


def test_an_environment_error_aborts_the_requests_in_flight(model):
    cfg = EnvConfig(name="single_turn", max_turns=3, max_tokens_per_turn=6)
    params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    engine = engine_for(model, kv_cache_max_tokens=4096)
    spy, decoding, aborted = Spy(engine), threading.Event(), []
    rows = _rows([3, 2])
    raised = threading.Event()

    def on_step():  # once r:0 decodes its second turn, let r:1's error land before the next step
        if not decoding.is_set() and 0 in engine._requests and len(engine._requests[0].prompt_ids) > len(rows[0].prompt_ids):
            decoding.set()
            raised.wait(10)
            time.sleep(0.05)

    spy.on_step = on_step
    abort = engine.abort
    engine.abort = lambda ids=None: aborted.append(len(engine._requests)) or abort(ids)

    def factory():
        env = RaisingEnv(cfg)
        env.decoding, env.raised = decoding, raised
        return env

    with pytest.raises(EnvError, match=r"environment 'environment' failed on row r:1 \(step of turn 0\).*boom"):
        _rollout(cfg, factory).run(engine.generate, rows, params)
    assert aborted == [1] and not engine.has_unfinished()  # r:0's turn was in flight: aborted, the engine idle
    dropped = EnvConfig(name="single_turn", max_turns=3, max_tokens_per_turn=6, on_error="drop")
    result = _rollout(dropped, lambda: RaisingEnv(dropped)).run(engine.generate, rows, params)
    assert [t.finish_reason for t in result.trajectories] == ["done", "env_error"]
    assert [len(t.turns) for t in result.trajectories] == [3, 1] and not result.trajectories[1].valid
    assert result.metrics["env/errors"] == 0.5 and not engine.has_unfinished()


def test_a_busy_engine_is_refused(model):
    from tidal.engine.base import Request

    engine = engine_for(model, kv_cache_max_tokens=4096)
    engine.add([Request(request_id="other", prompt_ids=[5, 6], params=SamplingParams(max_new_tokens=4))])
    cfg = EnvConfig(name="single_turn", max_turns=2)
    with pytest.raises(RuntimeError, match="needs an idle engine"):
        _rollout(cfg).run(engine.generate, _rows([2]), SamplingParams(temperature=0.0, max_new_tokens=4))
    engine.abort()


def test_which_engines_run_continuously(model):
    native = engine_for(model, kv_cache_max_tokens=1024)
    hf = HFEngine(model.config, EngineConfig(backend="hf"), device=torch.device("cpu"), dtype=torch.float32)
    assert incremental_engine(native.generate) is native
    assert incremental_engine(GroupGenerator(native, lone_runtime())) is native
    assert incremental_engine(GroupGenerator(native, lone_runtime(tp_size=2, tp_rank=1))) is native  # TP groups too
    assert incremental_engine(hf.generate) is None and incremental_engine(LocalGenerator(native.generate)) is None
    # single_turn (the real one) keeps the plain rollout's one generate call
    spy = Spy(native)
    rows = _rows([1, 1])
    out = EnvRollout(EnvConfig(), _rollout(EnvConfig()).renderer.tokenizer).run(
        native.generate, rows, SamplingParams(temperature=0.0, max_new_tokens=4, n=2))
    assert spy.adds == 0 and spy.generate_calls == 1 and len(out.trajectories) == 4


# ---- single turn: rewards while decoding ----------------------------------------------------------
def test_single_turn_reports_each_sequence_as_it_finishes_and_scores_as_at_the_end(model):
    """Through a GroupGenerator over the native engine, a single-turn rollout hands each sequence to
    its trajectory as it finishes (``run_steps``' ``on_finished``): some groups are reported, and
    scored by the reward stream, while the batch's last sequence still decodes; the trajectories are
    those of the plain ``generate`` call (the same request numbering, the same keyed draws) and the
    streamed rewards equal one scoring call at the end."""
    from tidal.rewards import RewardConfig, RewardEngine
    from tidal.rewards.stream import RewardStream
    from tidal.trainer.experience_maker import GroupScoring

    cfg = EnvConfig(name="single_turn")
    rows = _rows([1] * 6)
    params = SamplingParams(temperature=1.0, max_new_tokens=24, n=2, seed=5)
    engine = engine_for(model, kv_cache_max_tokens=4096)
    engine.eos_token_ids = {3, 4, 5, 6}  # sequences end at different steps
    plain = _rollout(cfg).run(LocalGenerator(engine.generate), rows, params)
    lengths = [t.num_sampled_tokens for t in plain.trajectories]
    assert min(lengths) < max(lengths) == 24  # some finish early, one runs to the end
    reward_cfg = RewardConfig(components={"len": {"type": "length_penalty", "max_tokens": 8}}, recipes={"default": [["len", 1.0]]})
    with RewardEngine(reward_cfg, device=torch.device("cpu")) as rewards:
        stream = RewardStream(rewards)
        feed = GroupScoring(stream, n=2)
        decoding_at_report = []

        def on_trajectory(i, traj):
            decoding_at_report.append(engine.has_unfinished())
            feed(i, traj)

        result = _rollout(cfg).run(GroupGenerator(engine, lone_runtime()), rows, params, on_trajectory=on_trajectory)
        samples = [t.reward_sample(i) for i, t in enumerate(result.trajectories)]
        got, want = stream.results(samples), rewards.score(samples)
    assert sum(decoding_at_report) >= 4 and not decoding_at_report[-1]  # most reported while the batch decoded
    assert _key(result) == _key(plain)
    for a, b in zip(result.trajectories, plain.trajectories):  # the prefix cache now serves the prompts: rounding differs
        torch.testing.assert_close(torch.tensor(a.rows[0].logprobs), torch.tensor(b.rows[0].logprobs), rtol=0, atol=1e-5)
    assert torch.equal(got.total_B, want.total_B) and torch.equal(got.valid_B, want.valid_B)
