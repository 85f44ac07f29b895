"""rollout.partial.mode=carry with a multi-turn environment (tidal.trainer.partial with
tidal.envs.rollout.InFlightTrajectories): trajectories whose tools run keep going across the rollout
boundary, each token keeping the logprob and policy version of the weights that sampled it (a turn
cut by a rollout's end too), the staleness bound, the engine filled with new groups while every
trajectory waits for its tool, and the per-token correction of a trajectory started under weights
k and finished under k + 1 (its direction checked: the inverted ratio gives other weights)."""

import math
import threading
import time

import pytest
import torch

from tidal.algorithms.config import MismatchConfig
from tidal.algorithms.mismatch import mismatch_weights
from tidal.config import load_config
from tidal.config_base import ConfigError
from tidal.engine.base import SamplingParams
from tidal.envs import EnvConfig, EnvRollout, Environment, Observation, StepResult, pack_trajectories
from tidal.trainer.config import PartialRolloutConfig
from tidal.trainer.partial import LongTailRollout

from tests.runtimes import lone_runtime
from tests.unit.test_partial_rollout import Item, ScriptedEngine

OBS = [3, 4]


class ToolEnv(Environment):
    """Row ``r`` (its prompt's first id) has ``TURNS[r]`` turns; the tool between two turns answers
    the observation ``OBS`` after ``GATES[r]`` is set (at once when the row has no gate)."""

    TURNS: dict = {}
    GATES: dict = {}

    def reset(self, row):
        self.r = row.prompt_ids[0]
        return Observation(token_ids=list(row.prompt_ids))

    def step(self, turn):
        if turn.index + 1 >= self.TURNS.get(self.r, 1):
            return StepResult(done=True, reward=1.0)
        gate = self.GATES.get(self.r)
        if gate is not None:
            gate.wait(10)
        return StepResult(observation=Observation(token_ids=OBS))


class SlowEngine(ScriptedEngine):
    """The scripted engine (token ``10 + position + 100 * version``, logprob ``-(version + 1)``),
    each step taking ``step_s`` (so a tool answering at once lands within a step or two)."""

    def __init__(self, lengths, step_s=0.01):
        super().__init__(lengths)
        self.step_s = step_s
        self.steps = 0

    def step(self):
        time.sleep(self.step_s)
        self.steps += 1
        return super().step()


def _tokenizer():
    from tidal.tasks.chatml import train_chatml_tokenizer

    return train_chatml_tokenizer(["a b c d e"] * 4)


def _long_tail(cfg: PartialRolloutConfig, *, G=1, n=2, rows=50):
    env_cfg = EnvConfig(name="single_turn", max_turns=4, max_tokens_per_turn=16, workers=64)
    env = EnvRollout(env_cfg, _tokenizer(), env_factory=lambda: ToolEnv(env_cfg))
    env.single_turn = False  # a multi-turn environment (name only matters to the config checks)
    dataset = [Item(prompt_ids=[i, 1, 2]) for i in range(rows)]
    state = {"next": 0}

    def draw():
        start = state["next"]
        state["next"] += G
        return list(range(start, start + G))

    return LongTailRollout(cfg, groups_per_step=G, n_samples=n, rank=0, runtime=lone_runtime(), dataset=dataset,
                           draw=draw, env=env)


PARAMS = SamplingParams(max_new_tokens=16, n=2, seed=1)


@pytest.fixture(autouse=True)
def _envs():
    ToolEnv.TURNS, ToolEnv.GATES = {}, {}
    yield
    for gate in ToolEnv.GATES.values():
        gate.set()


def _check_tokens(traj):
    """Every sampled token shows the weights that sampled it (scripted engine), and its row's
    logprob is theirs: ``-(version + 1)``; observation tokens have version -1 and logprob 0."""
    for row in traj.rows:
        for tok, a, lp, v in zip(row.token_ids, row.action_mask, row.logprobs, row.versions):
            if a:
                assert v >= 0 and tok // 100 == v and lp == -(v + 1.0), (tok, lp, v)
            else:
                assert v == -1 and lp == 0.0 and tok in OBS


def test_a_trajectory_started_under_k_finishes_under_k_plus_1_with_per_token_versions_and_correction():
    # row 0: 2 turns of 4 tokens, its tool waits for a gate; row 1: one turn of 1 token (done at once);
    # the rows after them: one turn of 16 tokens
    ToolEnv.TURNS = {0: 2, 1: 1}
    ToolEnv.GATES = {0: threading.Event()}
    lt = _long_tail(PartialRolloutConfig(mode="carry", oversample=1.0))
    engine = SlowEngine({(0, 0): 4, (0, 1): 4, **{(i, j): 16 for i in range(2, 50) for j in range(2)}})
    trained, m1, v = lt.collect(engine, 1, PARAMS)
    # rollout 1 stops as soon as row 1's group is complete: row 0 is cut mid-turn or waits for its tool
    assert [g.index for g in trained] == [1] and v == 0
    assert m1["partial/carried_groups"] == 1 and m1["partial/new_groups"] == 2
    items, trajs = lt.trajectories(trained, None)
    assert [t.finish_reason for t in trajs] == ["done", "done"] and all(t.sampled_versions == [0] for t in trajs)
    carried = lt.groups[0]
    assert carried.index == 0 and not carried.complete
    assert all(s.versions and set(s.versions) == {0} for s in carried.seqs)  # tokens sampled under version 0 so far
    # the weights change (a step trained); the tool answers while "training"
    engine.policy_version = 1
    ToolEnv.GATES[0].set()
    trained, m2, v = lt.collect(engine, 2, PARAMS)
    assert v == 1 and 0 in [g.index for g in trained]
    assert m2["partial/staleness_max"] == 1 and m2["partial/span_max"] == 2 and m2["partial/stale_token_frac"] > 0
    items, trajs = lt.trajectories(trained, None)
    row0 = [t for t in trajs if t.row.prompt_ids[0] == 0]
    assert len(row0) == 2
    for t in row0:
        _check_tokens(t)
        assert len(t.turns) == 2 and t.finish_reason == "done"
        versions = t.sampled_versions
        assert versions == sorted(versions) and versions[0] == 0 and versions[-1] == 1  # started under 0, finished under 1
        second = t.rows[0].versions[t.turns[1].start : t.turns[1].start + t.turns[1].num_sampled]
        assert set(second) == {1}  # the turn after the tool: all under the new weights
    # the trainer's per-token correction: w_t = min(pi_old(t) / pi_behaviour(t), cap), pi_behaviour the
    # logprob of the weights that sampled token t (-1 under version 0, -2 under version 1); the current
    # policy (pi_old) gives every token -1.5. Inverted, the ratio would swap the two kinds of tokens.
    packed = pack_trajectories(row0, pad_id=0)
    old_BT = torch.full_like(packed.rollout_logp_BT, -1.5) * packed.action_mask_BT
    w_BT, _ = mismatch_weights(old_BT, packed.rollout_logp_BT, packed.action_mask_BT, MismatchConfig(mode="token_truncate", cap=2.0))
    for b, t in enumerate(row0):
        P = len(t.rows[0].prompt_ids)
        expected = [0.0] * P + [min(math.exp(-1.5 + (v + 1.0)), 2.0) if v >= 0 else 0.0 for v in t.rows[0].versions]
        inverted = [0.0] * P + [min(math.exp(1.5 - (v + 1.0)), 2.0) if v >= 0 else 0.0 for v in t.rows[0].versions]
        got = w_BT[b, : len(expected)].tolist()
        assert got == pytest.approx(expected, rel=1e-6)
        assert got != pytest.approx(inverted, rel=1e-3)  # the inverted correction fails this test
    lt.close()


def test_max_staleness_zero_finishes_every_trajectory_in_the_rollout_that_starts_it():
    ToolEnv.TURNS = {0: 3, 1: 1, 2: 2}
    lt = _long_tail(PartialRolloutConfig(mode="carry", oversample=1.0, max_staleness=0))
    engine = SlowEngine({(0, 0): 4, (0, 1): 4}, step_s=0.0)
    restarted = 0
    for step in (1, 2, 3):
        trained, m, v = lt.collect(engine, step, PARAMS)
        assert m["partial/staleness_max"] == 0 and m["partial/carried"] == 0  # every group in flight was due: it completed
        _, trajs = lt.trajectories(trained, None)
        assert all(t.finish_reason == "done" and set(t.sampled_versions) == {step - 1} for t in trajs)
        restarted += m["partial/restarted"]
        engine.policy_version = step
    # the complete group not trained at a step lags 1 > 0 at the next: its trajectories start again from the prompt
    assert restarted >= 2
    lt.close()


def test_the_engine_takes_new_groups_while_every_trajectory_waits_for_its_tool():
    # every row: 2 turns, its tool answering after 0.2 s (the engine would idle); oversample auto admits new groups
    class Slow(ToolEnv):
        def step(self, turn):
            if turn.index == 0:
                time.sleep(0.2)
            return super().step(turn)

    ToolEnv.TURNS = {i: 2 for i in range(50)}
    lt = _long_tail(PartialRolloutConfig(mode="carry", max_staleness=2), G=1)
    lt.env.env_factory = lambda: Slow(lt.env.cfg)
    engine = SlowEngine({}, step_s=0.005)
    trained, m, _ = lt.collect(engine, 1, PARAMS)
    # ceil(1.5) = 2 groups at the start; more started while both waited for their tools, within the cap G * (2 + 2)
    assert m["partial/new_groups"] > 2 and len(lt.groups) + len(trained) <= 4
    env = lt.env_metrics(trained)
    assert len(trained) == 1 and env["env/turns_mean"] == 2.0 and env["env/wait_s"] < 0.2
    lt.trajectories(trained, None)
    lt.close()


def test_checkpoint_of_trajectories_in_flight_restarts_them_from_their_prompts():
    ToolEnv.TURNS = {0: 2, 1: 1}
    ToolEnv.GATES = {0: threading.Event()}
    lt = _long_tail(PartialRolloutConfig(mode="carry", oversample=1.0))
    engine = SlowEngine({(0, 0): 8, (0, 1): 8, **{(i, j): 16 for i in range(2, 50) for j in range(2)}})
    lt.collect(engine, 1, PARAMS)
    state = lt.state_dict()
    assert [g["index"] for g in state["groups"]] == [0]
    assert all(not s["versions"] and s["finish_reason"] is None for s in state["groups"][0]["seqs"])
    ToolEnv.GATES[0].set()
    lt.close()
    resumed = _long_tail(PartialRolloutConfig(mode="carry", oversample=1.0))
    resumed.load_state_dict(state)
    engine.policy_version = 1
    trained, m, _ = resumed.collect(engine, 2, PARAMS)
    _, trajs = resumed.trajectories(trained, None)
    for t in (t for t in trajs if t.row.prompt_ids[0] == 0):  # started again from its prompt under version 1
        assert set(t.sampled_versions) == {1} and len(t.turns) == 2
    resumed.close()


def test_config_accepts_carry_for_multi_turn_and_refuses_what_it_cannot_do():
    base = ["env.name=calculator", "rollout.partial.mode=carry", "algorithm.mismatch.mode=token_truncate"]
    cfg = load_config("quickstart", base)
    assert cfg.rollout.partial.mode == "carry" and cfg.env.name == "calculator"
    with pytest.raises(ConfigError, match="drop applies to single-turn"):
        load_config("quickstart", ["env.name=calculator", "rollout.partial.mode=drop"])
    with pytest.raises(ConfigError, match="env.lockstep"):
        load_config("quickstart", base + ["env.lockstep=true"])
    with pytest.raises(ConfigError, match="algorithm.mismatch.mode"):
        load_config("quickstart", ["env.name=calculator", "rollout.partial.mode=carry"])
