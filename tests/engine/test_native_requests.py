"""The native engine's incremental requests (add / step / abort / resume) on CPU, against
uninterrupted generation and reference forwards of the Hugging Face model."""

import dataclasses

import pytest
import torch

from tidal.engine.base import Completion, Request, SamplingParams, require_incremental, supports_incremental
from tidal.engine.sampler import process_logits
from tidal.engine.stepping import GroupsComplete, run_steps

from .helpers import PROMPTS, engine_for, hf_greedy, tiny_hf

GREEDY = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)


def _requests(params, n=1, prompts=PROMPTS):
    return [Request(request_id=i * n + j, prompt_ids=p, params=params, group_id=i)
            for i, p in enumerate(prompts) for j in range(n)]


def _run(engine, steps=None):
    """Step ``engine`` (``steps`` times, or until nothing is unfinished); completions by request id."""
    out = {}
    while engine.has_unfinished() and (steps is None or steps > 0):
        out.update((c.request_id, c) for c in engine.step())
        steps = None if steps is None else steps - 1
    return out


def _reference_logprobs(hf, prompt, tokens, temperature=0.0, top_k=0, top_p=1.0):
    logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    return process_logits(logits, temperature, top_k, top_p).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


def test_the_engines_say_whether_they_take_incremental_requests():
    from tidal.engine.hf import HFEngine

    native = engine_for(tiny_hf("qwen2"))
    assert supports_incremental(native) and require_incremental(native, "partial rollout") is native
    hf = HFEngine(tiny_hf("qwen2").config, native.cfg, device=torch.device("cpu"), dtype=torch.float32)
    assert not supports_incremental(hf)
    with pytest.raises(NotImplementedError, match="partial rollout needs incremental requests .* HFEngine .* engine.backend=native"):
        require_incremental(hf, "partial rollout")


@pytest.mark.parametrize("overlap", [True, False])
def test_abort_and_resume_equals_an_uninterrupted_generation(overlap):
    """Greedy, weights unchanged: stop after a few steps, resume the partial completions (prefilled
    again), and get the tokens of an uninterrupted run; the resumed tokens' logprobs are kept as they
    were, the new ones are those of the model."""
    hf = tiny_hf("llama")
    engine = engine_for(hf, overlap_scheduling=overlap)
    whole = engine.generate(PROMPTS, GREEDY)
    engine.add(_requests(GREEDY))
    done = _run(engine, steps=5)
    partial = engine.abort()
    assert not engine.has_unfinished() and not done  # 12 tokens take more than 5 steps
    assert [c.request_id for c in partial] == [0, 1, 2, 3] and {c.finish_reason for c in partial} == {"abort"}
    assert all(0 < len(c.token_ids) < 12 and c.versions == [0] * len(c.token_ids) for c in partial)
    hits = engine.stats["prefix_hit_tokens"]
    engine.add([Request.resume(c, GREEDY) for c in partial])
    resumed = _run(engine)
    assert engine.stats["prefix_hit_tokens"] > hits  # the prompt and old tokens' full blocks were still cached
    for w, p in zip(whole, partial):
        r = resumed[p.request_id]
        assert r.token_ids == w.token_ids == hf_greedy(hf, r.prompt_ids, 12) and r.finish_reason == "length"
        k = len(p.token_ids)
        assert r.logprobs[:k] == p.logprobs  # kept, bit for bit
        assert r.logprobs == pytest.approx(w.logprobs, abs=1e-5)
        assert r.token_ids[:k] == p.token_ids and r.versions == [0] * 12


SAMPLED = SamplingParams(temperature=1.0, top_k=40, max_new_tokens=12, ignore_eos=True, seed=3)


def test_a_sequence_sampled_alone_equals_it_sampled_in_a_batch_with_others():
    """Each token's uniform is keyed by (seed, request id, position): request 7 samples the same
    tokens alone, in a batch with other requests (added before and after it, joining mid-way), and
    after a preemption-free abort and resume; another id or seed samples others."""
    hf = tiny_hf("llama")
    engine = engine_for(hf)
    mine = Request(request_id=7, prompt_ids=PROMPTS[0], params=SAMPLED)
    engine.add([mine])
    alone = _run(engine)[7]
    others = [Request(request_id=100 + i, prompt_ids=p, params=dataclasses.replace(SAMPLED, seed=50 + i))
              for i, p in enumerate(PROMPTS)]
    engine.add(others[:2] + [mine])
    got = _run(engine, steps=3)
    engine.add(others[2:])  # join while request 7 decodes
    got.update(_run(engine))
    assert got[7].token_ids == alone.token_ids
    torch.testing.assert_close(torch.tensor(got[7].logprobs), torch.tensor(alone.logprobs), rtol=0, atol=1e-5)
    engine.add(others + [mine])
    _run(engine, steps=4)
    partial = {c.request_id: c for c in engine.abort()}
    engine.add([Request.resume(partial[7], SAMPLED)])
    assert _run(engine)[7].token_ids == alone.token_ids  # resumed: its stream goes on at its positions
    for other in (dataclasses.replace(mine, request_id=8), dataclasses.replace(mine, params=dataclasses.replace(SAMPLED, seed=4))):
        engine.add([other])
        assert _run(engine)[other.request_id].token_ids != alone.token_ids


def test_resumed_tokens_are_prefilled_under_the_new_weights_and_keep_their_logprobs_and_versions():
    hf_a, hf_b = tiny_hf("qwen2", seed=0), tiny_hf("qwen2", seed=1)
    engine = engine_for(hf_a)
    params = SamplingParams(temperature=0.8, top_k=20, max_new_tokens=10, seed=3, ignore_eos=True)
    engine.add(_requests(params, n=2, prompts=PROMPTS[:2]))
    _run(engine, steps=4)
    partial = engine.abort()
    engine.load_weights(hf_b.state_dict().items())
    engine.policy_version = 7
    engine.add([Request.resume(c, params) for c in partial])
    resumed = _run(engine)
    for p in partial:
        r, k = resumed[p.request_id], len(p.token_ids)
        assert len(r.token_ids) == 10 and r.token_ids[:k] == p.token_ids and r.logprobs[:k] == p.logprobs
        assert r.versions == [0] * k + [7] * (10 - k)
        # old tokens: the logprobs of the weights that sampled them; new ones: of the new weights,
        # conditioned on the old tokens (which the new weights prefilled)
        old = _reference_logprobs(hf_a, r.prompt_ids, p.token_ids, 0.8, 20)
        assert torch.allclose(torch.tensor(p.logprobs), old, atol=1e-4)
        new = _reference_logprobs(hf_b, r.prompt_ids, r.token_ids, 0.8, 20)[k:]
        assert torch.isfinite(new).all() and torch.allclose(torch.tensor(r.logprobs[k:]), new, atol=1e-4)


def test_greedy_resume_under_new_weights_continues_like_the_new_model():
    hf_a, hf_b = tiny_hf("qwen3", seed=0), tiny_hf("qwen3", seed=1)
    engine = engine_for(hf_a)
    engine.add(_requests(GREEDY, prompts=PROMPTS[:3]))
    _run(engine, steps=4)
    partial = engine.abort()
    engine.load_weights(hf_b.state_dict().items())
    engine.add([Request.resume(c, GREEDY) for c in partial])
    for p, r in zip(partial, _run(engine).values()):
        k = len(p.token_ids)
        assert r.token_ids[k:] == hf_greedy(hf_b, p.prompt_ids + p.token_ids, 12 - k)


def test_a_next_turn_joins_while_other_sequences_decode_and_reuses_the_earlier_turn():
    """Continuous batching of a multi-turn shape: the second turn of a conversation (its first turn,
    the answer and new tokens) is added while other requests decode; its earlier turn is a prefix
    cache hit, and every output is exactly what a fresh greedy run gives."""
    hf = tiny_hf("qwen2")
    engine = engine_for(hf, block_size=4)
    params = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    long = dataclasses.replace(params, max_new_tokens=20)
    engine.add([Request(request_id="turn1", prompt_ids=PROMPTS[2], params=params)]
               + [Request(request_id=f"other{i}", prompt_ids=p, params=long) for i, p in enumerate(PROMPTS[:2])])
    out = {}
    while "turn1" not in out:
        out.update((c.request_id, c) for c in engine.step())
    turn1 = out["turn1"]
    assert engine.has_unfinished()  # the others still decode
    prompt2 = turn1.prompt_ids + turn1.token_ids + [5, 6, 7]
    hits = engine.stats["prefix_hit_tokens"]
    engine.add([Request(request_id="turn2", prompt_ids=prompt2, params=params)])
    out.update(_run(engine))
    full_blocks = (len(turn1.prompt_ids) + len(turn1.token_ids) - 1) // 4  # computed KV of turn 1
    assert engine.stats["prefix_hit_tokens"] - hits == full_blocks * 4
    assert out["turn2"].token_ids == hf_greedy(hf, prompt2, 6) and out["turn2"].prompt_ids == prompt2
    for i, p in enumerate(PROMPTS[:2]):
        assert out[f"other{i}"].token_ids == hf_greedy(hf, p, 20)


def test_aborting_some_requests_leaves_the_others_exact():
    hf = tiny_hf("qwen2")
    engine = engine_for(hf)
    engine.add(_requests(GREEDY))
    _run(engine, steps=4)
    (gone,) = engine.abort([2, "unknown"])
    assert gone.request_id == 2 and gone.finish_reason == "abort"
    rest = _run(engine)
    assert sorted(rest) == [0, 1, 3]
    for i in (0, 1, 3):
        assert rest[i].token_ids == hf_greedy(hf, PROMPTS[i], 12)


def test_group_completion_stop_keeps_the_long_tail_for_later():
    """Four groups of two; group 1's samples stop early (max_new_tokens 3), group 2's late (20), the
    others at 8: with two groups needed the run stops once groups 1 and 0/3 complete, long before
    group 2 would finish, and returns group 2's sequences unfinished. Each completion reaches
    ``on_finished`` in the step it finishes, before the next step runs."""
    hf = tiny_hf("qwen2")
    engine = engine_for(hf)
    lengths = [8, 3, 20, 8]
    requests = [Request(request_id=f"{g}/{j}", prompt_ids=PROMPTS[g], group_id=g,
                        params=dataclasses.replace(GREEDY, max_new_tokens=lengths[g])) for g in range(4) for j in range(2)]
    seen = []  # (request id, decode steps the engine had run when it was reported)
    rule = GroupsComplete(requests, 2)
    got = run_steps(engine, requests, stop=rule,
                    on_finished=lambda c: seen.append((c.request_id, engine.stats["decode_steps"])))
    assert rule.completed == [1, 0, 3]  # 0 and 3 complete in the same step
    assert [c.request_id for c in got.finished] == ["1/0", "1/1", "0/0", "0/1", "3/0", "3/1"]  # step order
    assert [rid for rid, _ in seen] == [c.request_id for c in got.finished]
    # group 1 (3 tokens) is reported before group 0/3 (8 tokens) are decoded: 5 decode steps apart at least
    assert seen[2][1] - seen[0][1] >= 5
    assert [c.request_id for c in got.unfinished] == ["2/0", "2/1"]
    assert all(len(c.token_ids) == 8 for c in got.unfinished) and not engine.has_unfinished()
    assert got.steps < 20
    # resumed in the next call, they finish with the tokens an uninterrupted run gives
    resumed = [Request.resume(c, dataclasses.replace(GREEDY, max_new_tokens=20)) for c in got.unfinished]
    rule = GroupsComplete(resumed, 2)
    rest = run_steps(engine, resumed, stop=rule)
    assert [c.token_ids for c in rest.finished] == [hf_greedy(hf, PROMPTS[2], 20)] * 2 and rule.completed == [2]


def test_generate_numbers_its_requests_and_stamps_versions():
    engine = engine_for(tiny_hf("qwen2"))
    engine.policy_version = 3
    out = engine.generate(PROMPTS[:2], dataclasses.replace(GREEDY, n=2, max_new_tokens=3))
    assert [(c.request_id, c.group_id) for c in out] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert all(c.versions == [3, 3, 3] and c.finished for c in out)


def test_bad_requests_are_refused_before_anything_is_queued():
    engine = engine_for(tiny_hf("qwen2"))
    with pytest.raises(ValueError, match="params.n must be 1"):
        Request(request_id=0, prompt_ids=[1], params=dataclasses.replace(GREEDY, n=2))
    with pytest.raises(ValueError, match="one entry per resumed token"):
        Request(request_id=0, prompt_ids=[1], params=GREEDY, token_ids=[3], logprobs=[-1.0])
    with pytest.raises(ValueError, match="leave nothing to generate"):
        Request(request_id=0, prompt_ids=[1], params=GREEDY, token_ids=[3] * 12, logprobs=[0.0] * 12, versions=[0] * 12)
    done = Completion(prompt_ids=[1], token_ids=[2], logprobs=[0.0], finish_reason="stop", request_id=0, versions=[0])
    with pytest.raises(ValueError, match="only an aborted completion resumes"):
        Request.resume(done, GREEDY)
    with pytest.raises(ValueError, match="already in flight"):
        engine.add([Request(request_id=0, prompt_ids=[1], params=GREEDY)] * 2)
    with pytest.raises(ValueError, match=">= max_position_embeddings"):
        engine.add([Request(request_id=0, prompt_ids=[1] * 256, params=GREEDY)])
    assert not engine.has_unfinished()
    engine.add([Request(request_id=0, prompt_ids=[1], params=GREEDY)])
    with pytest.raises(ValueError, match="share one distribution"):
        engine.add([Request(request_id=1, prompt_ids=[1], params=dataclasses.replace(GREEDY, temperature=1.0))])
    with pytest.raises(RuntimeError, match="policy_version with 1 unfinished"):
        engine.policy_version = 2
    assert len(_run(engine)) == 1


def test_stop_tokens_are_per_request():
    hf = tiny_hf("qwen2")
    free = hf_greedy(hf, PROMPTS[0], 10)
    stop = free[4]
    engine = engine_for(hf)
    engine.add([Request(request_id="stops", prompt_ids=PROMPTS[0], params=dataclasses.replace(GREEDY, stop_token_ids=(stop,))),
                Request(request_id="runs", prompt_ids=PROMPTS[0], params=dataclasses.replace(GREEDY, max_new_tokens=10))])
    out = _run(engine)
    assert out["stops"].token_ids == free[: free.index(stop) + 1] and out["stops"].finish_reason == "stop"
    assert out["runs"].token_ids == free and out["runs"].finish_reason == "length"


def test_a_failed_generate_leaves_the_engine_idle(monkeypatch):
    engine = engine_for(tiny_hf("qwen2"))
    calls = []

    def failing_wait(handle, wait=engine.runner.wait):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device lost")
        return wait(handle)

    monkeypatch.setattr(engine.runner, "wait", failing_wait)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.generate(PROMPTS, GREEDY)
    assert not engine.has_unfinished() and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    monkeypatch.undo()
    assert len(engine.generate(PROMPTS, GREEDY)) == 4
