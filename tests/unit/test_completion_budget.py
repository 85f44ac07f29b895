"""Per-sequence generation budgets (``ExperienceMaker.completion_budget``): one engine call at the
longest budget, each completion cut at its own, budget forcing of the end token, the checks, and the real native engine on CPU."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from tidal.data import PromptItem
from tidal.distributed.generate import _merged_budgets, cut_to_budget, force_end, gather_and_generate
from tidal.engine.base import Completion, SamplingParams
from tidal.envs import EnvConfig, EnvRollout
from tidal.logging import PhaseObserver, PhaseTimer
from tidal.trainer.budget import CompletionBudget
from tidal.trainer.experience_maker import ExperienceMaker

from tests.runtimes import lone_runtime

ONE_RANK = lone_runtime()


class RecordingEngine:
    """Completes each prompt with ``max_new_tokens`` tokens (finish "length"), except that a prompt
    starting with 9 stops after 2 tokens (finish "stop")."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, params):
        self.calls.append((len(prompts), params))
        out = []
        for p in prompts:
            for j in range(params.n):
                n = 2 if p[0] == 9 else params.max_new_tokens
                out.append(Completion(prompt_ids=p, token_ids=[p[0]] * n, logprobs=[-1.0 - j] * n,
                                      finish_reason="stop" if p[0] == 9 else "length"))
        return out


def test_budgets_are_one_call_at_the_longest_budget_then_cut():
    engine = RecordingEngine()
    params = SamplingParams(max_new_tokens=8, n=2, seed=10)
    comps = gather_and_generate(engine, [[1], [2], [9]], params, ONE_RANK, max_new_tokens=[5, 2, 2, 5, 1, 4])
    assert [(n, p.max_new_tokens, p.n, p.seed) for n, p in engine.calls] == [(3, 5, 2, 10)]  # one call, n kept
    assert [(c.prompt_ids[0], len(c.token_ids), c.finish_reason) for c in comps] == [
        (1, 5, "length"), (1, 2, "length"), (2, 2, "length"), (2, 5, "length"),
        (9, 1, "length"),  # cut before its own stop
        (9, 2, "stop"),  # stopped within its budget: as generated
    ]
    assert [c.logprobs for c in comps[:2]] == [[-1.0] * 5, [-2.0] * 2]


def test_cut_to_budget_keeps_a_completion_within_it():
    c = Completion(prompt_ids=[1], token_ids=[4, 5, 6], logprobs=[-1.0, -2.0, -3.0], finish_reason="length")
    assert cut_to_budget(c, 3) is c and cut_to_budget(c, 7) is c
    cut = cut_to_budget(c, 2)
    assert (cut.token_ids, cut.logprobs, cut.finish_reason) == ([4, 5], [-1.0, -2.0], "length")
    import numpy as np  # an MoE completion's routing covers the tokens fed: prompt and all but the last

    routed = np.arange(3 * 2 * 1, dtype=np.int16).reshape(3, 2, 1)
    cut = cut_to_budget(Completion(prompt_ids=[1], token_ids=[4, 5, 6], logprobs=[0.0] * 3, finish_reason="length",
                                   routed_experts=routed), 2)
    assert np.array_equal(cut.routed_experts, routed[:2])


@pytest.mark.parametrize("budgets, match", [([1, 2, 3], "3 budgets for 4 sequences"), ([1, 2, 9, 1], r"in 1\.\.8"),
                                            ([0, 1, 1, 1], r"in 1\.\.8")])
def test_bad_budgets_are_refused(budgets, match):
    with pytest.raises(ValueError, match=match):
        gather_and_generate(RecordingEngine(), [[1], [2]], SamplingParams(max_new_tokens=8, n=2), ONE_RANK,
                            max_new_tokens=budgets)


def test_force_end_replaces_the_last_token_only_at_the_budget():
    cut = Completion(prompt_ids=[1], token_ids=[4, 5, 6], logprobs=[-1.0, -2.0, -3.0], finish_reason="length")
    forced = force_end(cut, 3, 99)
    assert (forced.token_ids, forced.logprobs, forced.finish_reason) == ([4, 5, 99], [-1.0, -2.0, 0.0], "stop")
    assert force_end(cut, 4, 99) is cut  # the context cut it short of its budget: left as it is
    stopped = Completion(prompt_ids=[1], token_ids=[4, 2], logprobs=[-1.0, -0.5], finish_reason="stop")
    assert force_end(stopped, 2, 99) is stopped  # ended on its own


class Events(PhaseObserver):
    def __init__(self):
        self.seen = []

    def event(self, name, info=None):
        self.seen.append((name, info))


def _maker(timer):
    from tidal.tasks.tokenizer import train_tokenizer

    maker = ExperienceMaker.__new__(ExperienceMaker)  # only what trajectories() reads
    maker.timer, maker.colocation = timer, types.SimpleNamespace(runtime=ONE_RANK)
    maker.env = EnvRollout(EnvConfig(), train_tokenizer(["seven eight"]))
    return maker


def test_experience_maker_trajectories_apply_the_budget_and_report_it():
    timer, events = PhaseTimer(sync=lambda: None), Events()
    timer.add_observer(events)
    items = [PromptItem(prompt_ids=[i], prompt_text=t, reference=None, label="", metadata={}, images=None, source="rows", row=r)
             for r, (i, t) in enumerate([(7, "seven"), (8, "eight")])]
    seen_params = []

    def lengths(its, params):
        seen_params.append(params)
        return [1, 3, 2, 3]

    budget = CompletionBudget(lengths=lengths, end_token_id=0)
    engine = RecordingEngine()
    result = _maker(timer).trajectories(engine, items, SamplingParams(max_new_tokens=3, n=2), 0, budget)
    assert [t.turn_ids(t.turns[-1]) for t in result.trajectories] == [[0], [7, 7, 0], [8, 0], [8, 8, 0]]
    assert [t.rows[0].logprobs[-1] for t in result.trajectories] == [0.0] * 4  # the forced token
    assert {t.turns[-1].finish_reason for t in result.trajectories} == {"stop"} and seen_params[0].n == 2
    assert [(n, p.max_new_tokens, p.n) for n, p in engine.calls] == [(2, 3, 2)]  # one call, the prompts shared by n
    assert events.seen == [("generate:done", {"prompts": 2, "completion_lengths": [1, 3, 2, 3],
                                              "finish_reasons": ["stop"] * 4})]
    with pytest.raises(ValueError, match="ExperienceMaker.completion_budget: max_new_tokens: 3 budgets for 4"):
        _maker(timer).trajectories(RecordingEngine(), items, SamplingParams(max_new_tokens=3, n=2), 0,
                                   CompletionBudget(lengths=lambda its, p: [1, 2, 3]))


def test_native_engine_on_cpu_ends_each_sequence_at_its_budget():
    from tests.engine.helpers import engine_for, tiny_hf

    engine = engine_for(tiny_hf("qwen2"), kv_cache_max_tokens=512)
    eos = 127
    params = SamplingParams(max_new_tokens=6, n=3, ignore_eos=True, seed=3)
    budgets = [6, 1, 4, 2, 6, 3]
    comps = gather_and_generate(engine, [[3, 17, 99, 5], [11, 12]], params, ONE_RANK, max_new_tokens=budgets)
    forced = [force_end(c, b, eos) for c, b in zip(comps, budgets)]
    assert [len(c.token_ids) for c in forced] == budgets
    assert all(c.token_ids[-1] == eos and c.logprobs[-1] == 0.0 and c.finish_reason == "stop" for c in forced)
    assert all(torch.isfinite(torch.tensor(c.logprobs)).all() for c in forced)
    assert [c.prompt_ids for c in forced] == [[3, 17, 99, 5]] * 3 + [[11, 12]] * 3


def test_tp_group_gathers_budgets_with_their_prompts():
    """Rank 1 of a TP group of 2 (the runtime's TP gather answers with what rank 0 brings): one call
    for the group's prompts at the group's longest budget; a rank without budgets gets ``max_new_tokens``."""
    params = SamplingParams(max_new_tokens=6, n=2)
    rank0 = ([([[1]], params, None, [2, 3], None)], False, None)  # (batches, busy, failure)
    tp2 = lone_runtime(tp_size=2, tp_rank=1)
    tp2.tp_gather_objects = lambda obj: [rank0, obj]
    engine = RecordingEngine()
    comps = gather_and_generate(engine, [[2], [3]], params, tp2, max_new_tokens=[1, 1, 4, 2])
    assert [(n, p.max_new_tokens) for n, p in engine.calls] == [(3, 4)]
    assert [(c.prompt_ids[0], len(c.token_ids)) for c in comps] == [(2, 1), (2, 1), (3, 4), (3, 2)]
    owners = [(0, 0, [[1]], None, None, None), (1, 0, [[2], [3]], None, [1, 1, 4, 2], None)]
    assert _merged_budgets(owners, params) == [6, 6, 1, 1, 4, 2]
    assert _merged_budgets([o[:4] + (None, None) for o in owners], params) is None
    rank0 = ([([[1]], params, None, None, None)], False, None)  # no rank 0 budgets: one call at max_new_tokens; rank 1's are still cut
    engine = RecordingEngine()
    comps = gather_and_generate(engine, [[2], [3]], params, tp2, max_new_tokens=[1, 1, 4, 2])
    assert [(n, p.max_new_tokens) for n, p in engine.calls] == [(3, 6)] and [len(c.token_ids) for c in comps] == [1, 1, 4, 2]


def test_an_incremental_engine_spends_no_step_past_the_longest_running_budget():
    """The native engine takes one request per sequence with its own budget: when only short budgets
    remain it stops early (decode steps = the longest budget - 1), and tokens equal the cut-down
    generation of a call at the longest budget (greedy)."""
    from tests.engine.helpers import engine_for, tiny_hf

    engine = engine_for(tiny_hf("qwen2"), kv_cache_max_tokens=512)
    params = SamplingParams(temperature=0.0, max_new_tokens=32, n=2, ignore_eos=True)
    before = engine.stats["decode_steps"]
    comps = gather_and_generate(engine, [[3, 17, 99, 5], [11, 12]], params, ONE_RANK, max_new_tokens=[3, 2, 4, 1])
    assert [len(c.token_ids) for c in comps] == [3, 2, 4, 1]
    assert engine.stats["decode_steps"] - before == 3  # not 31: no step past the longest budget
    full = gather_and_generate(engine, [[3, 17, 99, 5], [11, 12]], dataclasses.replace(params, max_new_tokens=4), ONE_RANK)
    assert [c.token_ids for c in comps] == [f.token_ids[:b] for f, b in zip(full, [3, 2, 4, 1])]
