"""rollout.partial (tidal.trainer.partial): group completion, carry selection, staleness accounting,
restarts, drop mode and the checkpoint round trip, on a scripted incremental engine whose every
sequence has a known length, so each expectation is counted by hand."""

import dataclasses
import json

import pytest
import torch

from tidal.algorithms.config import MismatchConfig
from tidal.algorithms.mismatch import mismatch_weights
from tidal.config import load_config
from tidal.config_base import ConfigError
from tidal.engine.base import Completion, SamplingParams, supports_incremental
from tidal.trainer.config import PartialRolloutConfig
from tidal.trainer.experience import STEP_GROUPS
from tidal.trainer.partial import SAMPLE_SLOTS, LongTailRollout, dropped_note, in_flight_groups, per_rank_states

from tests.runtimes import lone_runtime


@dataclasses.dataclass
class Item:
    prompt_ids: list
    mm_inputs: None = None
    prompt_text: str = ""
    messages: None = None
    reference: str = ""
    label: str = ""
    metadata: dict = dataclasses.field(default_factory=dict)
    source: str = "mem"
    row: int = 0


class ScriptedEngine:
    """An incremental engine where sequence j of dataset row i is ``lengths[(i, j)]`` tokens long
    (it stops there; 1 when not listed), sampling token ``10 + its position + 100 * policy_version``
    with logprob ``-(policy_version + 1)``: a token shows which weights sampled it. The prompt's
    first id is the row index."""

    def __init__(self, lengths: dict):
        self.lengths = lengths
        self.policy_version = 0
        self.live: dict = {}  # request id -> [request, tokens, logprobs, versions]
        self.added: list = []

    def add(self, requests):
        self.added.append(list(requests))
        for r in requests:
            self.live[r.request_id] = [r, list(r.token_ids), list(r.logprobs), list(r.versions)]

    def has_unfinished(self):
        return bool(self.live)

    def _completion(self, rid, reason):
        r, t, lp, v = self.live.pop(rid)
        return Completion(prompt_ids=r.prompt_ids, token_ids=t, logprobs=lp, versions=v, finish_reason=reason,
                          request_id=rid, group_id=r.group_id)

    def step(self):
        done = []
        for rid, (r, t, lp, v) in list(self.live.items()):
            t.append(10 + len(t) + 100 * self.policy_version)
            lp.append(-(self.policy_version + 1.0))
            v.append(self.policy_version)
            if len(t) >= self.lengths.get((r.prompt_ids[0], rid % SAMPLE_SLOTS), 1):
                done.append(self._completion(rid, "stop"))
        return done

    def abort(self, request_ids=None):
        return [self._completion(rid, "abort") for rid in list(self.live)]


def rollout(n=2, G=2, rows=100, start=0, **kw):
    """A LongTailRollout whose sampler hands out rows start.. in order, G at a time."""
    cfg = PartialRolloutConfig(**kw)
    dataset = [Item(prompt_ids=[i, 1, 2]) for i in range(rows)]
    state = {"next": start}

    def draw():  # the sampler: G rows at a time, in order
        start = state["next"]
        state["next"] += G
        return list(range(start, start + G))

    lt = LongTailRollout(cfg, groups_per_step=G, n_samples=n, rank=0, runtime=lone_runtime(), dataset=dataset, draw=draw)
    lt.sampler = state  # the test's view of the sampler position
    return lt


PARAMS = SamplingParams(max_new_tokens=8, n=2, seed=1)


def test_in_flight_groups():
    assert in_flight_groups(2, 0.5) == 3
    assert in_flight_groups(4, 0.5) == 6
    assert in_flight_groups(3, 0.1) == 4  # ceil(3.3)
    assert in_flight_groups(10, 0.1) == 11  # 11.000000000000002 is 11
    assert in_flight_groups(4, 0.0) == 4


def test_carry_trains_first_complete_groups_and_resumes_the_rest():
    # G=2, n=2, 3 groups in flight (rows 0, 1, 2). Row 0: lengths 1 and 5; row 1: 2 and 2; row 2: 3 and 1.
    eng = ScriptedEngine({(0, 0): 1, (0, 1): 5, (1, 0): 2, (1, 1): 2, (2, 0): 3, (2, 1): 1,
                          (3, 0): 1, (3, 1): 1, (4, 0): 1, (4, 1): 1})
    lt = rollout(mode="carry", oversample=0.5)
    trained, m, version = lt.collect(eng, 1, PARAMS)
    # step 1 completes row 1 (after 2 engine steps), row 2 (after 3): both trained, row 0 carried
    assert [g.index for g in trained] == [1, 2] and version == 0
    assert [g.gid for g in trained] == [1 * STEP_GROUPS + 1, 1 * STEP_GROUPS + 2]
    assert m["partial/engine_steps"] == 3 and m["partial/new_groups"] == 3
    assert m["partial/carried_groups"] == 1 and m["partial/carried"] == 1  # row 0: its unfinished sequence
    assert m["partial/staleness_max"] == 0 and m["partial/span_max"] == 1
    (carried,) = lt.groups
    assert carried.index == 0 and carried.seqs[0].finished and carried.seqs[1].token_ids == [10, 11, 12]
    assert carried.seqs[1].versions == [0, 0, 0] and not carried.seqs[1].finished
    eng.policy_version = 1  # the weights were updated
    trained, m, version = lt.collect(eng, 2, PARAMS)
    # the carried row 0 resumes first (3 tokens, re-prefilled), then rows 3 and 4 refill the slots
    first = eng.added[-1][0]
    assert first.request_id == carried.gid * SAMPLE_SLOTS + 1 and first.token_ids == [10, 11, 12] and first.versions == [0, 0, 0]
    assert [r.group_id // STEP_GROUPS for r in eng.added[-1]] == [1, 2, 2, 2, 2]
    # rows 3 and 4 complete in one step; row 0 needs 2 more: rows 3, 4 trained, row 0 carried again
    assert [g.index for g in trained] == [3, 4] and m["partial/resumed"] == 1 and m["partial/engine_steps"] == 1
    eng.policy_version = 2
    trained, m, version = lt.collect(eng, 3, PARAMS)  # row 0 (4 tokens: 3 of v0, 1 of v1) finishes 1 step later
    assert trained[0].index == 0 and trained[0].seqs[1].versions == [0, 0, 0, 1, 2]
    assert trained[0].seqs[1].token_ids == [10, 11, 12, 113, 214]  # each token from the weights that sampled it
    assert trained[0].seqs[1].logprobs == [-1.0, -1.0, -1.0, -2.0, -3.0]
    # trained tokens: row 0's 1 + 5, and row 5's or 6's tokens (all fresh); lags of row 0: 2 2 (seq 0: 1 token at v0) ...
    lags = [2 - v for g in trained for s in g.seqs for v in s.versions]
    assert m["partial/staleness_max"] == 2 == max(lags)
    assert m["partial/staleness_mean"] == pytest.approx(sum(lags) / len(lags))
    assert m["partial/stale_token_frac"] == pytest.approx(sum(x > 0 for x in lags) / len(lags))
    assert m["partial/span_max"] == 3  # row 0 started at step 1, trained at step 3


def test_a_due_group_completes_before_the_rollout_stops():
    # max_staleness 1: a group may span 2 rollouts. Row 0's second sequence is 6 tokens long.
    eng = ScriptedEngine({(0, 0): 1, (0, 1): 6, (1, 0): 1, (1, 1): 1, (2, 0): 1, (2, 1): 1,
                          (3, 0): 1, (3, 1): 1, (4, 0): 1, (4, 1): 1, (5, 0): 1, (5, 1): 1, (6, 0): 1, (6, 1): 1})
    lt = rollout(mode="carry", oversample=0.5, max_staleness=1)
    trained, m, _ = lt.collect(eng, 1, PARAMS)  # rows 1, 2 done in 1 step; row 0 carried with 1 token of v0
    assert [g.index for g in trained] == [1, 2] and m["partial/engine_steps"] == 1
    eng.policy_version = 1
    # row 0 is due (trained any later, its v0 tokens would lag 2 > 1): rows 3, 4 complete after 1 step
    # but the rollout goes on until row 0's 6th token, 5 steps; row 0 (oldest) and row 3 are trained
    trained, m, _ = lt.collect(eng, 2, PARAMS)
    assert m["partial/engine_steps"] == 5 and m["partial/restarted"] == 0 and m["partial/resumed"] == 1
    assert [g.index for g in trained] == [0, 3] and trained[0].seqs[1].versions == [0, 1, 1, 1, 1, 1]
    assert m["partial/staleness_max"] == 1 and m["partial/carried_complete_groups"] == 1
    eng.policy_version = 2
    trained, m, _ = lt.collect(eng, 3, PARAMS)  # row 4 (complete, lag 1) goes first, then row 5
    assert [g.index for g in trained] == [4, 5] and m["partial/restarted"] == 0 and m["partial/staleness_max"] == 1


def test_a_complete_group_past_the_cap_restarts_from_the_prompt():
    # every sequence is 1 token: 3 groups complete in the first step, 2 are trained; the third waits
    # complete, and with max_staleness 0 its tokens would lag 1 > 0 in the next batch: it restarts
    eng = ScriptedEngine({(i, j): 1 for i in range(10) for j in range(2)})
    lt = rollout(mode="carry", oversample=0.5, max_staleness=0)
    lt.collect(eng, 1, PARAMS)
    eng.policy_version = 1
    trained, m, _ = lt.collect(eng, 2, PARAMS)
    assert m["partial/restarted"] == 2 and all(r.token_ids == [] for r in eng.added[-1])
    assert [g.index for g in trained] == [2, 3] and m["partial/staleness_max"] == 0


def test_max_staleness_zero_restarts_every_carried_sequence():
    eng = ScriptedEngine({(0, 0): 1, (0, 1): 3, **{(i, j): 1 for i in range(1, 9) for j in range(2)}})
    lt = rollout(mode="carry", oversample=0.5, max_staleness=0)
    lt.collect(eng, 1, PARAMS)
    eng.policy_version = 1
    _, m, _ = lt.collect(eng, 2, PARAMS)
    assert m["partial/restarted"] == 2 and m["partial/staleness_max"] == 0


def test_drop_mode_discards_the_slowest_groups():
    eng = ScriptedEngine({(0, 0): 1, (0, 1): 5, (1, 0): 2, (1, 1): 2, (2, 0): 3, (2, 1): 1,
                          **{(i, j): 1 for i in range(3, 9) for j in range(2)}})
    lt = rollout(mode="drop", oversample=0.5)
    trained, m, _ = lt.collect(eng, 1, PARAMS)
    assert [g.index for g in trained] == [1, 2] and m["partial/dropped_groups"] == 1 and lt.groups == []
    assert "partial/carried" not in m
    trained, m, _ = lt.collect(eng, 2, PARAMS)  # three fresh rows (3, 4, 5): row 0 is gone
    assert [g.index for g in trained] == [3, 4] and m["partial/new_groups"] == 3
    assert lt.queue == []  # drawn: 0-3 (step 1, 3 wait), 4-5 (step 2)


def test_extra_complete_groups_are_carried_and_trained_first():
    # all three groups complete in the same step: two are trained, the third waits, complete, and is
    # trained first in the next rollout (before any engine step)
    eng = ScriptedEngine({(i, j): 1 for i in range(10) for j in range(2)})
    lt = rollout(mode="carry", oversample=0.5)
    trained, m, _ = lt.collect(eng, 1, PARAMS)
    assert [g.index for g in trained] == [0, 1] and [g.index for g in lt.groups] == [2]
    eng.policy_version = 1
    trained, m, _ = lt.collect(eng, 2, PARAMS)
    assert [g.index for g in trained] == [2, 3]  # row 2 (complete before the run), then row 3 (first of 3, 4)
    assert m["partial/staleness_max"] == 1


def test_oversample_zero_is_the_plain_rollout_request_list():
    eng = ScriptedEngine({(i, j): 1 + (i + j) % 3 for i in range(10) for j in range(3)})
    lt = rollout(mode="carry", oversample=0.0, G=2, n=3)
    trained, m, _ = lt.collect(eng, 5, dataclasses.replace(PARAMS, n=3))
    # what NativeEngine.generate adds for prompts [0, 1] with n=3: the same order, group ids, seed
    reqs = eng.added[0]
    assert [(r.group_id - 5 * STEP_GROUPS, r.request_id % SAMPLE_SLOTS) for r in reqs] == [(i, j) for i in range(2) for j in range(3)]
    assert all(r.params == dataclasses.replace(PARAMS, n=1) for r in reqs)
    assert [g.index for g in trained] == [0, 1] and lt.groups == [] and m["partial/carried"] == 0


def test_checkpoint_round_trip_resumes_identically():
    lengths = {(i, j): 1 + (3 * i + j) % 5 for i in range(60) for j in range(2)}
    a, ea = rollout(mode="carry", oversample=1.0), ScriptedEngine(lengths)
    for step in (1, 2):
        ea.policy_version = step - 1
        a.collect(ea, step, PARAMS)
    state = json.loads(json.dumps(a.state_dict()))  # the checkpoint is JSON
    assert any(s["token_ids"] and s["finish_reason"] is None for g in state["groups"] for s in g["seqs"])
    b, eb = rollout(mode="carry", oversample=1.0, start=a.sampler["next"]), ScriptedEngine(lengths)
    b.load_state_dict(state)
    assert b.groups == a.groups and b.queue == a.queue
    for step in (3, 4, 5):
        ea.policy_version = eb.policy_version = step - 1
        assert a.collect(ea, step, PARAMS) == b.collect(eb, step, PARAMS)
        assert ea.added[-1] == eb.added[-1]


def test_checkpoint_from_another_shape_is_refused():
    a = rollout(mode="carry", oversample=1.0)
    b = rollout(mode="carry", oversample=0.5)
    with pytest.raises(ValueError, match="groups in flight"):
        b.load_state_dict(a.state_dict())
    saved = [{"groups": [{}, {}], "queue": [4]}, {"groups": [{}], "queue": []}]
    assert per_rank_states(saved, 1, 2) == saved[1]
    assert per_rank_states(saved, 0, 1) is None  # another number of ranks: dropped, with a warning
    assert dropped_note(saved, 1).startswith("the checkpoint's partial rollout state is of 2 ranks and this run has 1: "
                                             "its 3 group(s) in flight and 1 queued prompt(s) are dropped")


def test_stale_tokens_get_the_mismatch_weight():
    # a token sampled by older weights (log pi_rollout = -2.0) that the current weights give -1.0:
    # rho = e^1 = 2.718 truncated to the cap 2; a fresh token (equal logprobs) gets weight 1
    old = torch.tensor([[-1.0, -0.5]])
    rollout_lp = torch.tensor([[-2.0, -0.5]])
    mask = torch.ones(1, 2)
    w, m = mismatch_weights(old, rollout_lp, mask, MismatchConfig(mode="token_truncate", cap=2.0))
    assert w.tolist() == [[2.0, 1.0]] and m["mismatch_corrected_frac"].item() == pytest.approx(0.5)


def test_config_validation():
    with pytest.raises(ConfigError, match="algorithm.mismatch.mode"):
        load_config("quickstart", ["rollout.partial.mode=carry"])
    with pytest.raises(ConfigError, match="engine.backend=native"):
        load_config("quickstart", ["rollout.partial.mode=drop", "engine.backend=hf", "engine.kv_cache_max_tokens=0"])
    with pytest.raises(ConfigError, match="dynamic_sampling"):
        load_config("quickstart", ["rollout.partial.mode=drop", "algorithm.dynamic_sampling.enabled=true"])
    with pytest.raises(ConfigError, match="rollout.partial.oversample"):
        load_config("quickstart", ["rollout.partial.oversample=1.0"])
    with pytest.raises(ConfigError, match="rollout.partial.max_staleness"):
        load_config("quickstart", ["rollout.partial.mode=drop", "rollout.partial.max_staleness=1"])
    with pytest.raises(ConfigError, match="rollout.partial.oversample"):
        load_config("quickstart", ["rollout.partial.mode=drop", "rollout.partial.oversample=-1"])
    cfg = load_config("quickstart", ["rollout.partial.mode=carry", "algorithm.mismatch.mode=token_truncate",
                                     "rollout.partial.max_staleness=2"])
    assert cfg.rollout.partial.max_staleness == 2


def test_engine_contract():
    assert supports_incremental(ScriptedEngine({}))


def _heavy_tail(rows: int, n: int, cap: int, seed: int = 0) -> dict:
    """Scripted lengths with a heavy tail: most sequences short (lognormal around cap/16), about
    one in ten runs to the cap, so most groups of 8 hold a capped sequence."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(rows):
        for j in range(n):
            if torch.rand((), generator=gen).item() < 0.1:
                out[(i, j)] = cap
            else:
                out[(i, j)] = int(min(cap, max(1, torch.empty(()).log_normal_(mean=1.4, std=0.6, generator=gen).item())))
    return out


def _grpo_advantages(lengths: list[int]) -> list[float]:
    r = torch.tensor(lengths, dtype=torch.float64)  # reward: the response length
    return ((r - r.mean()) / (r.std() + 1e-6)).tolist()


@pytest.mark.parametrize("max_staleness", [1, 4])
def test_auto_carry_cuts_a_heavy_tail_and_trains_whole_groups(max_staleness):
    G, n, cap, steps = 4, 8, 64, 24
    lengths = _heavy_tail(G * (steps + 20) * 4, n, cap)
    plain_steps = [max(lengths[(i, j)] for i in range(k * G, (k + 1) * G) for j in range(n)) for k in range(steps)]
    assert sum(s == cap for s in plain_steps) >= 0.8 * steps  # a plain rollout runs to the cap nearly every time
    eng = ScriptedEngine(lengths)
    lt = rollout(mode="carry", G=G, n=n, rows=len(lengths) // n, max_staleness=max_staleness)
    params = SamplingParams(max_new_tokens=cap, n=n, seed=1)
    engine_steps, restarted, mixed = [], [], 0
    for step in range(1, steps + 1):
        eng.policy_version = step - 1
        trained, m, version = lt.collect(eng, step, params)
        assert len(trained) == G and all(g.complete and len(g.seqs) == n for g in trained)
        assert m["partial/staleness_max"] <= max_staleness
        restarted.append(m["partial/restarted"])
        for g in trained:
            plain = [lengths[(g.index, j)] for j in range(n)]
            for s in g.seqs:  # each token (and logprob) is the one its stamped version sampled, in order
                assert s.token_ids == [10 + t + 100 * v for t, v in enumerate(s.versions)]
                assert s.logprobs == [-(v + 1.0) for v in s.versions] and s.versions == sorted(s.versions)
                assert step - 1 - s.versions[0] <= max_staleness
                mixed += len(set(s.versions)) > 1
            # the lengths (the reward here) are the plain rollout's, so the advantages are too
            assert _grpo_advantages([len(s.token_ids) for s in g.seqs]) == _grpo_advantages(plain)
        engine_steps.append(m["partial/engine_steps"])
    assert mixed > 0  # carried sequences were trained, sampled by several versions
    steady = engine_steps[steps // 2:]
    # each rollout runs about cap / (max_staleness + 1) steps instead of the cap
    assert sum(steady) / len(steady) <= 1.5 * cap / (max_staleness + 1) + 2, engine_steps
    # work thrown away (a complete group that found no batch in time) only while in-flight grows
    assert sum(restarted) <= 0.02 * steps * G * n and sum(restarted[steps // 2:]) == 0, restarted
    assert G <= lt.in_flight <= G * (max_staleness + 2)


def test_auto_in_flight_is_checkpointed():
    lengths = _heavy_tail(400, 4, 32, seed=1)
    a, ea = rollout(mode="carry", G=2, n=4, rows=100), ScriptedEngine(lengths)
    params = SamplingParams(max_new_tokens=32, n=4, seed=1)
    for step in (1, 2, 3, 4):
        ea.policy_version = step - 1
        a.collect(ea, step, params)
    state = json.loads(json.dumps(a.state_dict()))
    b, eb = rollout(mode="carry", G=2, n=4, rows=100, start=a.sampler["next"]), ScriptedEngine(lengths)
    b.load_state_dict(state)
    assert b.in_flight == a.in_flight and b.groups == a.groups
    for step in (5, 6, 7):
        ea.policy_version = eb.policy_version = step - 1
        assert a.collect(ea, step, params) == b.collect(eb, step, params)
