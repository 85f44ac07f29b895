"""Sliding-window layers' own block pool (issue 50 item 3): blocks that leave a sequence's window go
back to the pool while it decodes, nothing reads them afterwards (poisoned with NaN, the logits still
equal HF's), a tight window pool stays exact, an index that leaves its pool fails, and the sizing
rule shared by the engine and the plan gives the hand-computed split (CPU, the tiny Gemma 3 / OLMo 3
of ``test_families``: window 8, blocks of 4 tokens, layers ``[window, full, window, window]``)."""

import numpy as np
import pytest
import torch

from tidal.engine import sizing
from tidal.engine.base import Request, SamplingParams
from tidal.engine.native.sequence import Status

from .helpers import engine_for, hf_greedy
from .test_families import PROMPTS, WINDOW, WINDOWED, assert_logits_close, assert_logprobs_match, hf_logits, recording, tiny

GREEDY = dict(temperature=0, ignore_eos=True)


def _held(engine, slot: int) -> int:
    return len(engine.window_blocks.held(slot))


@pytest.mark.parametrize("family", WINDOWED)
def test_window_blocks_go_back_to_their_pool_as_the_window_moves(family):
    """One sequence of a 20-token prompt decoding 30 tokens (blocks of 4, window 8, no step ahead):
    after decode step d the step's query sat at position q = 19 + d, so the sequence holds window
    columns (q - 7) // 4 .. q // 4 (2 or 3 blocks) while its full layers hold q // 4 + 1; the pool's
    free count is its size less those."""
    hf = tiny(family)
    engine = engine_for(hf, block_size=4, overlap_scheduling=False)
    engine.add([Request(request_id="a", prompt_ids=PROMPTS[0], params=SamplingParams(max_new_tokens=30, **GREEDY))])
    engine.step()  # the prefill: all 5 prompt blocks held for its step
    win, bm = engine.window_blocks, engine.block_manager
    assert win is not None and engine.runner.window == WINDOW and engine.runner.num_window_layers == 3
    seen = []
    for d in range(1, 25):
        engine.step()
        q = 19 + d
        held = q // 4 + 1 - (q - 7) // 4
        assert _held(engine, 0) == held and win.num_free_blocks == win.num_blocks - held
        assert bm.num_free_blocks == bm.num_blocks - (q // 4 + 1)
        seen.append(held)
    assert set(seen) == {2, 3}  # bounded by the window, whatever the length (28 .. 44 tokens here)
    while engine.has_unfinished():
        engine.step()
    assert win.num_free_blocks == win.num_blocks and bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("family", WINDOWED)
def test_given_back_window_blocks_are_never_read(family):
    """Three sequences decode past the window; then every free block of the window pool is filled
    with NaN in every window layer: the rest of the decode (taking those blocks again) still gives
    HF's logits at every position, so no freed block is read (a kernel reading one would turn NaN)."""
    hf = tiny(family)
    engine = engine_for(hf, block_size=4, overlap_scheduling=False)
    steps = recording(engine)
    params = SamplingParams(max_new_tokens=24, **GREEDY)
    engine.add([Request(request_id=i, prompt_ids=p, params=params) for i, p in enumerate(PROMPTS)])
    for _ in range(14):
        engine.step()
    win = engine.window_blocks
    free = np.flatnonzero(win.bm.free.is_free)
    assert len(free) == win.num_free_blocks > 0
    for attn in engine.runner.window_attns:
        attn.k_cache[torch.from_numpy(free)] = float("nan")
        attn.v_cache[torch.from_numpy(free)] = float("nan")
    done = {}
    while engine.has_unfinished():
        for c in engine.step():
            done[c.request_id] = c
    for i, prompt in enumerate(PROMPTS):
        assert done[i].token_ids == hf_greedy(hf, prompt, 24)
        assert_logprobs_match(hf, prompt, done[i].token_ids, done[i].logprobs)
    assert all(torch.isfinite(s).all() for s in steps)


@pytest.mark.parametrize("family", WINDOWED)
def test_a_tight_window_pool_stays_exact(family, monkeypatch):
    """A window pool of 9 blocks (the least that admits a sequence of 34 tokens) beside a full pool of
    9 + 5 + 7 blocks (all three at full length): their prompts alone take 10 window blocks, so they
    wait for each other's windows to slide (or are preempted), and every output is still HF's
    greedy one."""
    monkeypatch.setattr(sizing, "window_blocks_for_lengths", lambda lengths, full, **kw: 9)
    hf = tiny(family)
    engine = engine_for(hf, block_size=4, max_num_batched_tokens=8)
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=14, **GREEDY))
    assert engine.window_blocks.num_blocks == 9 and engine.block_manager.num_blocks == 9 + 5 + 7
    for prompt, c in zip(PROMPTS, out):
        assert c.token_ids == hf_greedy(hf, prompt, 14)
        assert_logprobs_match(hf, prompt, c.token_ids, c.logprobs)
    assert engine.window_blocks.num_free_blocks == 9


@pytest.mark.parametrize("family", WINDOWED)
def test_a_window_pool_short_in_decode_preempts_and_stays_exact(family, monkeypatch):
    """Four short prompts (1 to 5 tokens) of 20 new tokens beside a full pool that holds all four
    (7 + 6 + 6 + 6 blocks) and a window pool of 10 blocks: all four start, and each grows to 3 window
    blocks as it decodes (12 > 10), so the window pool preempts the latest; resumed, every output is
    HF's greedy one."""
    monkeypatch.setattr(sizing, "window_blocks_for_lengths", lambda lengths, full, **kw: 10)
    hf = tiny(family)
    prompts = [[5, 9, 77, 2, 31], [11, 12], [7], [40, 41, 40]]
    engine = engine_for(hf, block_size=4, max_num_batched_tokens=8)
    out = engine.generate(prompts, SamplingParams(max_new_tokens=20, **GREEDY))
    assert engine.block_manager.num_blocks == 7 + 6 + 6 + 6 and engine.stats["preemptions"] > 0
    for prompt, c in zip(prompts, out):
        assert c.token_ids == hf_greedy(hf, prompt, 20)
        assert_logprobs_match(hf, prompt, c.token_ids, c.logprobs)
    assert engine.window_blocks.num_free_blocks == 10


@pytest.mark.parametrize("family", WINDOWED)
def test_forks_share_the_window_blocks_of_their_prompt(family):
    """Four samples of a 20-token prompt: the first prefills it; the others reuse its 4 full blocks
    and the window blocks of their last window (columns 2 and 3: positions 9..15 precede position
    16, their first computed one), so the window pool holds the prompt's columns 2..4 once plus
    each sample's own block 4 (3 + 3 = 6 more than the first alone after the prefill)."""
    hf = tiny(family)
    engine = engine_for(hf, block_size=4, overlap_scheduling=False)
    params = SamplingParams(max_new_tokens=8, seed=1, temperature=1.0, ignore_eos=True)
    engine.add([Request(request_id=j, prompt_ids=PROMPTS[0], params=params, group_id=0) for j in range(4)])
    engine.step()
    t = engine.table
    assert engine.stats["prefix_hit_tokens"] == 3 * 16
    rows = t.slots_with(Status.RUNNING)
    assert len(rows) == 4
    first = [t.window_table[s, 2:4].tolist() for s in rows.tolist()]
    assert all(f == first[0] for f in first)  # the shared window blocks of columns 2, 3
    assert t.win_lo[rows].tolist() == [0, 2, 2, 2]
    win = engine.window_blocks
    assert win.num_blocks - win.num_free_blocks == 5 + 3  # the first's 5 columns, and each fork's block 4
    out = []
    while engine.has_unfinished():
        out += engine.step()
    for c in out:
        assert_logprobs_match(hf, PROMPTS[0], c.token_ids, c.logprobs, temperature=1.0)


@pytest.mark.parametrize("family", WINDOWED)
def test_a_prefix_hit_needs_its_last_window_cached(family):
    """Turn 2 extends turn 1 (40 tokens computed). Its full blocks are all cached; once the window
    blocks of their last window are taken by other sequences, the hit stops at the longest boundary
    whose window is still cached (here none: nothing is reused), and the logits stay HF's."""
    hf = tiny(family)
    engine = engine_for(hf, block_size=4, kv_cache_max_tokens=256)
    greedy = SamplingParams(max_new_tokens=20, **GREEDY)
    (t1,) = engine.generate([PROMPTS[0]], greedy)
    win = engine.window_blocks
    win.bm.take(win.num_free_blocks)  # every free window block reallocated: their cached content is gone
    win.bm.release(np.flatnonzero(win.bm.ref_count).astype(np.int32))
    steps = recording(engine)
    prompt2 = PROMPTS[0] + t1.token_ids + [7, 8]
    hits = engine.stats["prefix_hit_tokens"]
    (t2,) = engine.generate([prompt2], SamplingParams(max_new_tokens=6, **GREEDY))
    assert engine.stats["prefix_hit_tokens"] == hits
    assert_logits_close(torch.cat(steps), hf_logits(hf, prompt2 + t2.token_ids)[len(prompt2) - 1 : -1])


def test_an_index_that_leaves_its_pool_fails():
    """CPU steps check every slot and block id against its own pool: a window block id past the
    window pool, or a step reading a window column already given back, raises IndexError."""
    hf = tiny("gemma3")
    for corrupt, match in [
        (lambda t, e: t.window_table.__setitem__((0, int(t.num_blocks[0]) - 1), e.window_blocks.num_blocks + 1), "sliding-window"),
        (lambda t, e: t.win_lo.__setitem__(0, t.win_lo[0] + 1), "given back"),
        (lambda t, e: t.block_table.__setitem__((0, 0), e.block_manager.num_blocks + 1), "full-attention"),
    ]:
        engine = engine_for(hf, block_size=4, overlap_scheduling=False)
        engine.add([Request(request_id="a", prompt_ids=PROMPTS[0], params=SamplingParams(max_new_tokens=20, **GREEDY))])
        for _ in range(10):
            engine.step()
        corrupt(engine.table, engine)
        with pytest.raises(IndexError, match=match):
            engine.step()


def test_the_pool_split_rule_by_hand():
    """``window_pool_blocks``: for sequences of 40 tokens (10 blocks of 4; a window of 8 spans at most
    3) the window pool holds 3 blocks per sequence the full pool holds, plus a prefill step's 2
    blocks (8 tokens) and one whole sequence (10), never more than the full pool. ``split_kv_pools``:
    the largest full pool whose cache (1 byte a full block, 2 a window block) fits 1000 bytes."""
    kw = dict(block_size=4, window=8, seq_len=40, max_num_batched_tokens=8)
    assert sizing.window_pool_blocks(100, **kw) == 10 * 3 + 2 + 10
    assert sizing.window_pool_blocks(101, **kw) == 11 * 3 + 2 + 10
    assert sizing.window_pool_blocks(15, **kw) == 15  # capped by the full pool (2 * 3 + 12 = 18)
    assert sizing.window_pool_blocks(100, **{**kw, "seq_len": None}) == 100
    # 610 + 2 * (61 * 3 + 12) = 1000; 611 + 2 * (62 * 3 + 12) = 1007
    assert sizing.split_kv_pools(lambda n, w: n + 2 * w, 1000, **kw) == (610, 195)
    assert sizing.split_kv_pools(lambda n, w: n + 2 * w, 2, **kw) == (0, 0)
    assert sizing.split_kv_pools(lambda n, w: 3 * n, 1000, **{**kw, "window": None}) == (333, 0)
    # CPU: the longest sequences that run together, each its window's blocks
    assert sizing.window_blocks_for_lengths([40, 12, 40], 100, block_size=4, window=8, max_seqs=None,
                                            max_num_batched_tokens=8) == 3 + 3 + 3 + 2 + 10


def test_more_sequences_fit_in_the_same_bytes():
    """Gemma 3 1B's layout (4 full layers, 22 with a window of 512; 1 KV head of 256; bf16; blocks of
    16) on a 10 GiB KV budget for sequences of 768 tokens (48 blocks, of which a window spans 33):
    one pool with every layer's full KV holds 10 GiB / (26 x 16 KiB) / 48 = 525 sequences; the split
    pools hold 700 (a third more): 33,600 full blocks and 700 x 33 + 560 window blocks (a prefill
    step's 512 and one whole sequence's 48)."""
    from tidal.families import LayerCache

    caches = [LayerCache(kind="full_kv" if i % 6 == 5 else "window_kv", kv_heads=1, head_dim=256,
                         window=None if i % 6 == 5 else 512) for i in range(26)]
    budget = 10 * 2**30
    kw = dict(block_size=16, window=512, seq_len=768, max_num_batched_tokens=8192)
    bytes_of = lambda n, w: sizing.kv_cache_bytes(caches, full_blocks=n, window_blocks=w, block_size=16, dtype_bytes=2, tp_size=1)  # noqa: E731
    full, window = sizing.split_kv_pools(bytes_of, budget, **kw)
    assert (full, window) == (33600, 700 * 33 + 560)
    assert bytes_of(full, window) <= budget < bytes_of(full + 1, sizing.window_pool_blocks(full + 1, **kw))
    assert budget // (26 * 2 * 16 * 256 * 2) // 48 == 525


def test_both_pools_follow_the_memory_at_fixed_addresses(monkeypatch):
    """Sized by memory (a CUDA engine's rule, fixed-address regions faked on the host), for sequences
    of 40 tokens: a full block is 1 layer x (K, V) x 4 tokens x 2 heads x 16 x 4 bytes = 1024 bytes,
    a window block 3072; W(n) = ceil(n / 10) x 3 + 12 window blocks beside n full ones. A budget of
    101 x 1024 + 43 x 3072 holds n = 100 (W = 42; n = 101 would need 102 x 1024 + 46 x 3072); half
    of it, n = 50 (W = 27). Each pool's regions keep their addresses across wake-ups."""
    from tidal.engine.config import EngineConfig
    from tidal.engine.native import NativeEngine

    from .test_native_memory import _FakeRegions, _memory_sized

    budgets = [101 * 1024 + 43 * 3072, 51 * 1024 + 28 * 3072]
    _memory_sized(monkeypatch, [2 * b for b in budgets], fixed=True)  # kv_cache_memory_fraction 0.5
    hf = tiny("gemma3")
    engine = NativeEngine(hf.config, EngineConfig(block_size=4, max_num_batched_tokens=8), device=torch.device("cpu"),
                          dtype=torch.float32, seq_len=40)
    engine.load_weights(hf.state_dict().items())
    want = [hf_greedy(hf, p, 6) for p in PROMPTS]
    ptrs = None
    for (full, window), budget in zip([(100, 42), (50, 27)], budgets):
        engine.wake_up()
        runner = engine.runner
        assert (runner.num_blocks, runner.num_window_blocks) == (full, window)
        assert (engine.block_manager.num_blocks, engine.window_blocks.num_blocks) == (full, window)
        assert engine.memory_report()["kv_cache"] == (full + 1) * 1024 + (window + 1) * 3072 == budget
        full_regions, window_regions = _FakeRegions.instances  # reserved once each: 2 and 6 regions
        assert (full_regions.num_regions, window_regions.num_regions) == (2, 6)
        now = [t.data_ptr() for t in runner.kv_layers + runner.window_kv_layers]
        assert now == (ptrs or [b.data_ptr() for b in full_regions.bufs + window_regions.bufs])
        ptrs = now
        out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, **GREEDY))
        assert [c.token_ids for c in out] == want
        engine.sleep(1)
