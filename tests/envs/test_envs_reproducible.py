"""Multi-turn rollouts with sampling on the real native engine (a tiny model) are the same for the
same seed whatever the tools' timing, with ``env.lockstep`` off (turns join the running batch as
their tools answer) and on (every round waits for all its tools): each token's uniform is keyed
by (seed, trajectory, position), never drawn for a step's batch as a whole. A key that depends on
arrival order (what a batch-wide stream amounts to) fails the same test."""

import random
import time

import pytest
import torch

from tidal.engine.base import SamplingParams
from tidal.engine.native import engine as native_engine
from tidal.envs import EnvConfig, EnvRollout, EnvRow, Environment, Observation, StepResult

from tests.engine.helpers import engine_for, tiny_hf

pytestmark = pytest.mark.usefixtures("one_thread")

OBSERVATION = [7, 8, 9]
TURNS = 4


class JitteryEnv(Environment):
    """``TURNS`` turns; each step answers three fixed observation tokens after a latency drawn from
    the class's ``schedule`` (a seeded source per run: two schedules, two different timings), 0-25 ms."""

    schedule: random.Random | None = None

    def reset(self, row):
        self.row = row
        return Observation(token_ids=list(row.prompt_ids))

    def step(self, turn):
        time.sleep(self.schedule.uniform(0.0, 0.025))
        if turn.index + 1 >= TURNS:
            return StepResult(done=True, reward=1.0)
        return StepResult(observation=Observation(token_ids=OBSERVATION), reward=0.5)


@pytest.fixture(scope="module")
def model():
    return tiny_hf("qwen2", vocab_size=128, max_position_embeddings=512)


def _rows():
    g = torch.Generator().manual_seed(3)
    return [EnvRow(prompt_ids=torch.randint(20, 120, (int(k),), generator=g).tolist(), prompt_text="", where=f"r:{i}")
            for i, k in enumerate(torch.randint(3, 9, (6,), generator=g))]


def _run(model, lockstep: bool, schedule_seed: int):
    from tidal.tasks.chatml import train_chatml_tokenizer

    cfg = EnvConfig(name="single_turn", max_turns=TURNS, max_tokens_per_turn=5, lockstep=lockstep, workers=8)
    schedule = random.Random(schedule_seed)

    def factory():
        env = JitteryEnv(cfg)
        env.schedule = schedule
        return env

    engine = engine_for(model, kv_cache_max_tokens=4096)
    adds = []
    add = engine.add
    engine.add = lambda requests: (adds.append(len(requests)), add(requests))[1]
    rollout = EnvRollout(cfg, train_chatml_tokenizer(["a b c d e"] * 4), env_factory=factory)
    result = rollout.run(engine.generate, _rows(), SamplingParams(temperature=1.0, max_new_tokens=5, n=2, seed=7))
    assert not engine.has_unfinished()
    trajs = [(t.rows[0].input_ids, t.rows[0].action_mask, t.finish_reason) for t in result.trajectories]
    logps = [t.rows[0].logprobs for t in result.trajectories]
    return trajs, logps, adds


def _same(a, b):
    assert a[0] == b[0]
    for x, y in zip(a[1], b[1]):
        torch.testing.assert_close(torch.tensor(x), torch.tensor(y), rtol=0, atol=1e-5)


def test_same_seed_same_trajectories_under_two_latency_schedules_lockstep_off_and_on(model):
    free = [_run(model, lockstep=False, schedule_seed=s) for s in (1, 2)]
    _same(free[0], free[1])
    assert {reason for _, _, reason in free[0][0]} == {"done"}  # every trajectory ran its TURNS turns
    assert max(len(ids) for ids, _, _ in free[0][0]) > 20  # several turns of sampled tokens each
    assert free[0][2] != free[1][2] or len(free[0][2]) > TURNS  # turns were added as tools answered
    locked = _run(model, lockstep=True, schedule_seed=3)
    _same(locked, free[0])
    assert locked[2] == [12] * TURNS  # lockstep: every round adds all 12 trajectories' turns at once


def test_a_key_by_arrival_order_fails_the_same_check(model, monkeypatch):
    """The check has power: keyed by the order requests reach the engine (a batch-wide stream's
    behaviour), the two schedules give different trajectories."""
    arrivals = iter(range(10**6))
    monkeypatch.setattr(native_engine, "request_key", lambda request_id: next(arrivals))
    a, b = (_run(model, lockstep=False, schedule_seed=s) for s in (1, 2))
    assert a[0] != b[0]
