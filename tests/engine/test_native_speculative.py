"""Speculative rollouts (``engine.speculative``) are lossless: the same tokens (greedy), the same
distribution (sampling, by a chi-square test that a biased acceptance rule fails), the target's
logprobs, and the KV cache and block tables a plain run leaves; through resumes, weight loads,
sleep/wake and TP lockstep. Drafts come from an oracle (:class:`OracleDrafter`) where a test needs
drafts that always/never/partly match, from the real n-gram index elsewhere."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tidal.sampling_filter import SamplingFilter
from tidal.engine.base import Request, SamplingParams
from tidal.engine.native import model_runner
from tidal.engine.native.speculative import acceptance
from tidal.engine.native.speculative.draft_index import DraftIndex
from tidal.engine.native.speculative.policy import MAX_DRAFT, SeqDraftState, SpecPolicy
from tidal.engine.sampler import process_logits, sample

from .helpers import PROMPTS, OracleDrafter, engine_for, tiny_hf

GREEDY = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True, n=2)
REPEATING = [[5, 6, 7, 8] * 4, [9, 10, 11] * 3 + [12], [20, 21, 22, 23, 24, 20, 21, 22]]


def _tokens(completions):
    return [c.token_ids for c in completions]


def _assert_logprobs_close(got, want, atol=1e-5):
    for g, w in zip(got, want):
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), rtol=0, atol=atol)


# ---- greedy ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["always", "never", "partly"])
def test_greedy_is_bit_identical_with_drafts_that_always_never_or_partly_match(mode):
    hf = tiny_hf("qwen2")
    plain_engine = engine_for(hf, speculative="off")
    plain = plain_engine.generate(PROMPTS, GREEDY)
    refs = {tuple(p): plain[2 * i].token_ids for i, p in enumerate(PROMPTS)}
    eng = engine_for(hf, speculative="on")
    eng.spec.index = OracleDrafter(refs, mode, 128, skip=lambda seq_id: seq_id % 3 == 2)  # plain rows beside verify rows
    got = eng.generate(PROMPTS, GREEDY)
    assert _tokens(got) == _tokens(plain)
    _assert_logprobs_close(got, plain)
    st = eng.stats
    assert st["spec_steps"] > 0 and st["spec_drafted"] > 0
    if mode == "always":
        assert st["spec_accepted"] == st["spec_drafted"]
    elif mode == "never":
        assert st["spec_accepted"] == 0
    else:
        assert 0 < st["spec_accepted"] < st["spec_drafted"]
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks  # nothing leaked


def test_a_stop_token_inside_accepted_drafts_ends_the_sequence_there():
    hf = tiny_hf("qwen2")
    ref = engine_for(hf, speculative="off").generate([PROMPTS[0]], GREEDY)[0].token_ids
    params = dataclasses.replace(GREEDY, ignore_eos=False, stop_token_ids=(ref[6],), n=1)
    plain = engine_for(hf, speculative="off").generate([PROMPTS[0]], params)
    eng = engine_for(hf, speculative="on")
    eng.spec.index = OracleDrafter({tuple(PROMPTS[0]): ref}, "always", 128)
    got = eng.generate([PROMPTS[0]], params)
    assert _tokens(got) == _tokens(plain) and got[0].finish_reason == "stop" and len(got[0].token_ids) <= 7


def test_greedy_with_the_real_index_is_identical_and_drafts_get_accepted():
    # a random model's text has no structure of its own: the drafts that match come from the
    # responses of an earlier round (epoch) of the same prompts
    hf = tiny_hf("qwen2")
    params = dataclasses.replace(GREEDY, max_new_tokens=40, n=3)
    plain = engine_for(hf, speculative="off").generate(REPEATING, params)
    for mode in ("on", "auto"):
        eng = engine_for(hf, speculative=mode)
        eng.spec.policy.latency_bound = True  # as on a GPU (auto never speculates on a CPU)
        for _ in range(2):
            got = eng.generate(REPEATING, params)
            assert _tokens(got) == _tokens(plain)
            _assert_logprobs_close(got, plain)
        assert eng.stats["spec_accepted"] > 0


# ---- sampling: the distribution ---------------------------------------------------------------------
def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's chi-square goodness-of-fit p-value; cells expecting fewer than 5 pooled."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] < 5:  # pool the small cells into the smallest big one instead
        obs, exp = obs[:-1], exp[:-1]
        j = int(np.argmin(exp))
        obs[j] += counts[~big].sum()
        exp[j] += expected[~big].sum()
    x = float(((obs - exp) ** 2 / exp).sum())
    return float(torch.special.gammaincc(torch.tensor((len(obs) - 1) / 2, dtype=torch.float64),
                                         torch.tensor(x / 2, dtype=torch.float64)))


SAMPLING = [dict(temperature=1.0), dict(temperature=0.8, top_k=5), dict(temperature=1.0, top_p=0.7)]
PROMPT = [3, 7, 1, 5, 2]


def _exact_second_token(hf, params: dict):
    """The exact marginal of the second sampled token (and the conditionals), from plain forwards
    processed by the sampler's own function."""
    kw = dict(temperature=params["temperature"], top_k=params.get("top_k", 0), top_p=params.get("top_p", 1.0))
    with torch.no_grad():
        p0 = process_logits(hf(torch.tensor([PROMPT])).logits[:, -1], **kw).exp()[0].double()
        V = p0.shape[0]
        ids = torch.tensor([PROMPT + [t] for t in range(V)])
        logp1 = process_logits(hf(ids).logits[:, -1], **kw).double()
    return (p0[:, None] * logp1.exp()).sum(0).numpy(), logp1.numpy()


def _second_tokens(hf, params: dict, draft: list[int], n: int = 3000, seed: int = 1):
    eng = engine_for(hf, speculative="on")
    eng.spec.index = OracleDrafter({tuple(PROMPT): draft}, "fixed", hf.config.vocab_size)
    sp = SamplingParams(max_new_tokens=4, ignore_eos=True, n=n, seed=seed, **params)
    out = eng.generate([PROMPT], sp)
    assert eng.stats["spec_drafted"] >= n  # every sequence verified the draft at its second token
    return out


@pytest.mark.parametrize("params", SAMPLING, ids=["t1", "topk", "topp"])
def test_sampled_distribution_equals_the_plain_one_and_a_biased_rule_fails(params, monkeypatch):
    hf = tiny_hf("qwen2", vocab_size=16)
    marginal, logp1 = _exact_second_token(hf, params)
    d = int(np.argmax(marginal))  # draft the likeliest second token: the rule's error would show most there
    out = _second_tokens(hf, params, [d, d])
    second = np.array([c.token_ids[1] for c in out])
    assert marginal[second].min() > 0  # never a token outside the processed support
    assert _chi2_pvalue(np.bincount(second, minlength=16), marginal) > 1e-3
    # the returned logprob is the target's conditional of that token, also for accepted drafts
    for c in out[:200]:
        assert abs(c.logprobs[1] - logp1[c.token_ids[0], c.token_ids[1]]) < 1e-4
    # a biased rule (accept the draft on an independent coin of probability p(d), else emit the
    # target's own draw, which may be the draft again) over-samples the draft: the same test rejects it
    monkeypatch.setattr(model_runner, "accept", _independent_coin_accept)
    biased = np.array([c.token_ids[1] for c in _second_tokens(hf, params, [d, d])])
    assert _chi2_pvalue(np.bincount(biased, minlength=16), marginal) < 1e-6


def _independent_coin_accept(logits_TV, draft_T, group_T, u_T, *, sampling):
    temperature, top_k, top_p = sampling.temperature, sampling.top_k, sampling.top_p
    token_T, logp_T = sample(logits_TV, temperature, top_k, top_p, u_T)
    p_d_T = process_logits(logits_TV, temperature, top_k, top_p).exp().gather(-1, draft_T.clamp_min(0)[:, None])[:, 0]
    coin_T = (draft_T >= 0) & (torch.rand(len(draft_T)) < p_d_T)
    token_T = torch.where(coin_T, draft_T, token_T)
    logp_T = process_logits(logits_TV, temperature, top_k, top_p).gather(-1, token_T[:, None])[:, 0]
    ok_T = (draft_T >= 0) & (token_T == draft_T)
    return torch.where(acceptance.emitted(ok_T, group_T), token_T, acceptance.VOID), logp_T


@pytest.mark.parametrize("params", SAMPLING, ids=["t1", "topk", "topp"])
def test_sampled_tokens_equal_the_plain_path_with_the_same_seed(params):
    """Each verify row draws with the plain path's keyed uniform: speculation changes no token."""
    hf = tiny_hf("qwen2")
    sp = SamplingParams(max_new_tokens=30, n=3, seed=11, ignore_eos=True, **params)
    plain = engine_for(hf, speculative="off").generate(REPEATING, sp)
    eng = engine_for(hf, speculative="on")
    eng.spec.index = OracleDrafter({tuple(p): plain[3 * i].token_ids for i, p in enumerate(REPEATING)}, "partly", 128)
    got = eng.generate(REPEATING, sp)
    assert 0 < eng.stats["spec_accepted"] < eng.stats["spec_drafted"]
    assert _tokens(got) == _tokens(plain)
    _assert_logprobs_close(got, plain)


def test_sampled_logprobs_equal_a_plain_forward():
    hf = tiny_hf("qwen2")
    eng = engine_for(hf, speculative="on")
    params = SamplingParams(temperature=0.5, max_new_tokens=30, n=4, seed=3, ignore_eos=True)
    eng.generate(REPEATING, params)  # an earlier round: the drafts of the next
    out = eng.generate(REPEATING, dataclasses.replace(params, seed=4))
    assert eng.stats["spec_accepted"] > 0
    with torch.no_grad():
        for i, c in enumerate(out):
            ids = torch.tensor([c.prompt_ids + c.token_ids])
            logp = torch.log_softmax(hf(ids).logits[0, len(c.prompt_ids) - 1 : -1].float() / 0.5, -1)
            want = logp.gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)
            torch.testing.assert_close(torch.tensor(c.logprobs), want, rtol=0, atol=1e-4)


# ---- KV cache and blocks ----------------------------------------------------------------------------
def _kv_of(engine, slot: int, n: int) -> torch.Tensor:
    """Every layer's K and V of positions ``0..n-1`` of ``slot``, gathered through its block table."""
    bs, bt = engine.cfg.block_size, engine.table.block_table[slot]
    pos = np.arange(n)
    blocks, offs = torch.tensor(bt[pos // bs].astype(np.int64)), torch.tensor(pos % bs)
    return torch.stack([layer[blocks, offs] for layer in engine.runner.kv_layers])


def test_kv_cache_and_block_tables_after_rejections_equal_a_plain_run():
    hf = tiny_hf("qwen2")
    prompt = PROMPTS[2]
    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    ref = engine_for(hf, speculative="off").generate([prompt], params)[0].token_ids
    spec = engine_for(hf, speculative="on", overlap_scheduling=False, kv_cache_max_tokens=256)
    spec.spec.index = OracleDrafter({tuple(prompt): ref}, "partly", 128)
    spec.add([Request(request_id=0, prompt_ids=prompt, params=params)])
    for _ in range(5):
        spec.step()
    assert spec.stats["spec_drafted"] > spec.stats["spec_accepted"] > 0  # rejections happened
    plain = engine_for(hf, speculative="off", overlap_scheduling=False, kv_cache_max_tokens=256)
    plain.add([Request(request_id=0, prompt_ids=prompt, params=params)])
    s = spec._requests[0].slot
    while plain.table.num_tokens[plain._requests[0].slot] < spec.table.num_tokens[s]:
        plain.step()
    p = plain._requests[0].slot
    t1, t2 = spec.table, plain.table
    for name in ("num_tokens", "num_cached", "num_blocks", "num_hashed", "last_hash", "status"):
        assert getattr(t1, name)[s] == getattr(t2, name)[p], name
    n = int(t1.num_tokens[s])
    assert t1.token_list(s) == t2.token_list(p)
    assert spec.block_manager.num_free_blocks == plain.block_manager.num_free_blocks
    assert (t1.block_table[s, t1.num_blocks[s] :] == 0).all()  # the draft blocks went back
    torch.testing.assert_close(_kv_of(spec, s, n - 1), _kv_of(plain, p, n - 1), rtol=0, atol=1e-5)


# ---- resume, weight updates, sleep ------------------------------------------------------------------
def _run(engine, requests):
    engine.add(requests)
    done = []
    while engine.has_unfinished():
        done += engine.step()
    return sorted(done, key=lambda c: c.request_id)


@pytest.mark.parametrize("reload", [False, True], ids=["resume", "weight_update"])
def test_a_carried_sequence_resumes_with_its_draft_index_under_old_or_new_weights(reload):
    hf, other = tiny_hf("qwen2"), tiny_hf("qwen2", seed=1)
    params = dataclasses.replace(GREEDY, n=1, max_new_tokens=40)
    full = engine_for(hf, speculative="off").generate(REPEATING, params)
    eng = engine_for(hf, speculative="on")
    eng.generate(REPEATING, params)  # an earlier round: the index holds these responses
    eng.add([Request(request_id=i, prompt_ids=p, params=params, group_id=i) for i, p in enumerate(REPEATING)])
    for _ in range(2):
        eng.step()
    partial = sorted(eng.abort(), key=lambda c: c.request_id)
    assert len(partial) == 3 and all(0 < len(c.token_ids) < 40 for c in partial)
    assert all(c.token_ids == f.token_ids[: len(c.token_ids)] for c, f in zip(partial, full))
    plain = engine_for(other if reload else hf, speculative="off")
    if reload:
        eng.load_weights(other.state_dict().items())
    before = dict(eng.stats)
    got = _run(eng, [Request.resume(c, params) for c in partial])
    want = _run(plain, [Request.resume(c, params) for c in partial])
    assert _tokens(got) == _tokens(want) and (reload or _tokens(got) == _tokens(full))
    _assert_logprobs_close(got, want)
    assert eng.stats["spec_drafted"] > before["spec_drafted"]  # the resumed sequences drafted from the index
    assert reload or eng.stats["spec_accepted"] > before["spec_accepted"]


def test_the_index_survives_sleep_and_drafts_a_prompts_next_epoch_from_its_earlier_responses():
    hf = tiny_hf("qwen2")
    prompt = PROMPTS[0]  # no repetition of its own: the second epoch's drafts come from the first's text
    params = dataclasses.replace(GREEDY, n=1, max_new_tokens=30)
    plain = engine_for(hf, speculative="off").generate([prompt], params)
    eng = engine_for(hf, speculative="on")
    first = eng.generate([prompt], params)
    eng.sleep(1)
    eng.wake_up()
    before = dict(eng.stats)
    second = eng.generate([prompt], params)
    assert _tokens(first) == _tokens(second) == _tokens(plain)
    accepted = eng.stats["spec_accepted"] - before["spec_accepted"]
    assert accepted >= 20 and eng.stats["decode_steps"] - before["decode_steps"] <= 10


# ---- the draft index and the policy -----------------------------------------------------------------
def test_draft_index_continues_the_most_recent_match_from_self_siblings_groups_and_history():
    idx = DraftIndex()
    idx.add(0, [1, 2, 3], group_id="g")
    idx.update(0, np.array([1, 2, 3, 4, 9, 8, 2, 3], dtype=np.int32))
    # own text: "2 3" last followed by "4 9 8"
    assert idx.propose(0, np.array([1, 2, 3, 4, 9, 8, 2, 3]), 3).tolist() == [4, 9, 8]
    # a sibling (same prompt) drafts from sequence 0's text, longest n-gram first
    idx.add(1, [1, 2, 3], group_id="g")
    idx.update(1, np.array([1, 2, 3, 4, 9], dtype=np.int32))
    assert idx.propose(1, np.array([1, 2, 3, 4, 9]), 2).tolist() == [8, 2]
    # a group member with another prompt (a later turn) sees both
    idx.add(2, [7, 7, 3, 4], group_id="g")
    idx.update(2, np.array([7, 7, 3, 4], dtype=np.int32))
    assert idx.propose(2, np.array([7, 7, 3, 4]), 4).tolist() == [9]  # "3 4" -> "9" (sequence 1, latest)
    # finished text stays for the prompt's next sequence (another epoch), unrelated prompts see nothing
    idx.finish(0, np.array([1, 2, 3, 4, 9, 8, 2, 3, 5], dtype=np.int32))
    idx.add(3, [1, 2, 3], group_id="h")
    idx.update(3, np.array([1, 2, 3, 9, 8], dtype=np.int32))
    assert idx.propose(3, np.array([1, 2, 3, 9, 8]), 2).tolist() == [2, 3]
    idx.add(4, [50, 51], group_id=None)
    idx.update(4, np.array([50, 51, 9, 8], dtype=np.int32))
    assert idx.propose(4, np.array([50, 51, 9, 8]), 2) is None


def test_draft_index_evicts_the_oldest_finished_prompts_beyond_its_budget():
    idx = DraftIndex(max_tokens=20)
    for i in range(5):
        idx.add(i, [100 + i, 1, 2], group_id=None)
    for i in range(5):
        idx.finish(i, np.array([100 + i, 1, 2, 3, 4, 5, 6], dtype=np.int32))  # 7 tokens each
    assert idx.num_tokens <= 20 and len(idx.stores) == 2  # the two most recent prompts are kept
    idx.add(9, [200, 1], group_id=None)  # a live sequence's store is never evicted
    idx.update(9, np.arange(40, dtype=np.int32))
    assert (40, hash(tuple([200, 1]))) not in idx.stores and len(idx.stores) == 3


def test_draft_length_adapts_and_failing_sequences_stop_drafting():
    s = SeqDraftState()
    s.observe(4, 4, step=1, adaptive_sleep=True)
    assert s.k == 6
    s.observe(6, 1, step=2, adaptive_sleep=True)
    assert s.k == 2
    for step in range(3, 3 + 10):
        s.observe(2, 2, step, True)
    assert s.k == MAX_DRAFT
    for step in (20, 21, 22):
        s.observe(MAX_DRAFT, 0, step, True)
    assert s.k == 1 and s.wake_step == 24  # three misses: a pause of 2 steps, then 4, 8, ...
    for step in (24, 25, 26):
        s.observe(0, 0, step, True)  # no draft found counts as a miss
    assert s.wake_step == 30


def test_auto_speculates_only_with_few_sequences_and_pauses_on_low_acceptance():
    on, off, auto = SpecPolicy("on"), SpecPolicy("off"), SpecPolicy("auto")
    assert on.allows(1, 10_000) and not off.allows(1, 1)
    assert auto.allows(1, 8) and not auto.allows(1, 4096)
    assert not SpecPolicy("auto", latency_bound=False).allows(1, 1) and SpecPolicy("on", latency_bound=False).allows(1, 1)
    for step in range(1, 5):
        auto.observe(step, drafting=8, accepted=0)
    assert not auto.allows(5, 8) and auto.allows(4 + 64, 8)  # paused for 64 decode steps
    with pytest.raises(ValueError, match="speculative"):
        SpecPolicy("maybe")


def test_acceptance_keeps_the_accepted_prefix_and_the_first_rejected_rows_token():
    # two sequences: rows 0-2 (drafts 5, 6), row 3 plain; greedy targets 5, 1, 2 | 3
    logits = torch.full((4, 8), -10.0)
    for r, tok in enumerate([5, 1, 2, 3]):
        logits[r, tok] = 10.0
    draft = torch.tensor([5, 6, -1, -1])
    group = torch.tensor([0, 0, 0, 1])
    tok, logp = acceptance.accept(logits, draft, group, None, sampling=SamplingFilter(temperature=0))
    assert tok.tolist() == [5, 1, -1, 3]
    assert torch.allclose(logp[[0, 1, 3]], torch.log_softmax(logits, -1)[[0, 1, 3], [5, 1, 3]])


def test_engine_speculative_config_is_checked():
    from tidal.config_base import ConfigError
    from tidal.engine.config import EngineConfig

    with pytest.raises(ConfigError, match="speculative"):
        EngineConfig(speculative="yes")
    with pytest.raises(ConfigError, match="speculative"):
        EngineConfig(backend="hf", speculative="on")
    assert EngineConfig().speculative == "off"  # auto is opt-in until it is measured faster (docs/engine.md)


def test_an_off_engine_keeps_no_index():
    eng = engine_for(tiny_hf("qwen2"), speculative="off")
    eng.generate(REPEATING, GREEDY)
    assert not eng.spec.index.stores and eng.stats["spec_steps"] == 0


# ---- TP lockstep ------------------------------------------------------------------------------------
# seed 8: a stream under which the sampled round accepts some of its drafts (1 of 23)
TP_PARAMS = [GREEDY, SamplingParams(temperature=0.9, top_k=20, max_new_tokens=20, n=2, seed=8, ignore_eos=True)]


def _tp_worker(rank: int, store_path: str, out_dir: str):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    group = dist.new_group([0, 1])
    from tidal.engine.config import EngineConfig
    from tidal.engine.native import NativeEngine

    hf = tiny_hf("qwen2")
    engine = NativeEngine(hf.config, EngineConfig(block_size=4, speculative="on"), device=torch.device("cpu"),
                          dtype=torch.float32, tp_group=group)
    engine.load_weights(hf.state_dict().items())
    out = [[(c.token_ids, c.logprobs) for c in engine.generate(REPEATING, p)] for p in TP_PARAMS]
    torch.save((out, engine.stats["spec_accepted"]), os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
def test_tp2_gloo_speculates_in_lockstep(tmp_path):
    mp.start_processes(_tp_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, start_method="spawn")
    (r0, acc0), (r1, acc1) = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert r0 == r1 and acc0 == acc1 > 0  # both ranks drafted, verified and accepted alike
    plain = engine_for(tiny_hf("qwen2"), speculative="off").generate(REPEATING, TP_PARAMS[0])
    assert [t for t, _ in r0[0]] == _tokens(plain)
    for (_, lp), c in zip(r0[0], plain):
        torch.testing.assert_close(torch.tensor(lp), torch.tensor(c.logprobs), rtol=0, atol=1e-4)


def test_auto_leaves_a_cpu_engine_on_the_plain_path():
    hf = tiny_hf("qwen2")
    eng = engine_for(hf, speculative="auto")
    assert eng.cfg.speculative == "auto"
    for _ in range(2):
        eng.generate(REPEATING, GREEDY)
    assert eng.stats["spec_steps"] == 0 and eng.stats["ahead_steps"] > 0 and not eng.spec.index.stores


def test_rollout_metrics_count_what_the_steps_did():
    from tidal.engine.native.speculative.metrics import speculation_metrics

    hf = tiny_hf("qwen2")
    plain = engine_for(hf, speculative="off")
    with speculation_metrics(plain) as m:
        plain.generate(PROMPTS, GREEDY)
    assert m == {}  # an engine that never speculates reports nothing
    eng = engine_for(hf, speculative="on")
    eng.spec.index = OracleDrafter({tuple(p): c.token_ids for p, c in zip(PROMPTS, plain.generate(PROMPTS, GREEDY)[::2])},
                                   "always", 128)
    with speculation_metrics(eng) as m:
        eng.generate(PROMPTS, GREEDY)
    st = eng.stats
    assert m["rollout/spec_acceptance_rate"] == 1.0
    assert m["rollout/spec_accepted_per_verify"] == st["spec_accepted"] / st["spec_seqs"] > 1
    assert m["rollout/spec_steps_frac"] == st["spec_steps"] / st["decode_steps"]
    assert m["rollout/spec_verify_overhead"] == pytest.approx(st["spec_rows"] / st["spec_plain_rows"] - 1)


@pytest.mark.parametrize("cache_tokens", [48, 96])
def test_drafts_are_cut_to_the_free_blocks_and_preemption_keeps_outputs(cache_tokens):
    hf = tiny_hf("qwen2")
    params = dataclasses.replace(GREEDY, max_new_tokens=20)
    plain = engine_for(hf, speculative="off").generate(PROMPTS[:2], params)
    eng = engine_for(hf, speculative="on", kv_cache_max_tokens=cache_tokens)
    eng.spec.index = OracleDrafter({tuple(p): c.token_ids for p, c in zip(PROMPTS[:2], plain[::2])}, "always", 128)
    got = eng.generate(PROMPTS[:2], params)
    assert _tokens(got) == _tokens(plain)
    _assert_logprobs_close(got, plain)
    assert eng.stats["spec_accepted"] > 0 and eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    assert cache_tokens > 48 or eng.stats["preemptions"] > 0


def test_a_next_turn_drafts_from_its_group_and_keeps_the_plain_tokens():
    """Multi-turn: the second turn's prompt holds the first turn and an observation; it drafts from
    its group (the other member's text under another prompt) and its own history."""
    hf = tiny_hf("qwen2")
    params = dataclasses.replace(GREEDY, n=1, max_new_tokens=16)

    def turns(engine):
        first = _run(engine, [Request(request_id=j, prompt_ids=PROMPTS[0], params=params, group_id=7) for j in range(2)])
        obs = [40, 41, 42]
        second = [Request(request_id=10 + j, prompt_ids=c.prompt_ids + c.token_ids + obs + ([43] if j else []),
                          params=params, group_id=7) for j, c in enumerate(first)]
        return first + _run(engine, second)

    plain = turns(engine_for(hf, speculative="off"))
    eng = engine_for(hf, speculative="on")
    got = turns(eng)
    assert _tokens(got) == _tokens(plain)
    _assert_logprobs_close(got, plain)
    assert eng.stats["spec_drafted"] > 0
