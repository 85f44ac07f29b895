"""The memory plan counts the native engine's sliding-window pool as the engine holds it (issue 50
item 3): Gemma 3 1B's layout (26 layers, every sixth full; 1 KV head of 256; window 512), hand-computed."""

from tidal.engine import sizing
from tidal.families import LayerCache
from tidal.memory.plan import ModelShape, plan_memory

from .test_memory_plan import H200, HOST, plan_inputs

CACHES = tuple(LayerCache(kind="full_kv" if i % 6 == 5 else "window_kv", kv_heads=1, head_dim=256,
                          window=None if i % 6 == 5 else 512) for i in range(26))
GEMMA_1B = ModelShape(layers=26, hidden=1152, heads=4, kv_heads=1, head_dim=256, intermediate=6912, vocab=262144,
                      tied_embeddings=True, model_type="gemma3_text", layer_caches=CACHES)
FULL_BLOCK, WINDOW_BLOCK = 16 * 4 * 2 * 256 * 2, 16 * 22 * 2 * 256 * 2  # bytes of a block over the 4 full / 22 window layers


def _inputs(**kw):
    return plan_inputs(GEMMA_1B, **{**dict(sequences_per_rank=256, max_prompt_len=256, max_new_tokens=512, device=H200,
                                            host=HOST), **kw})


def _kv_part(plan):
    rollout = next(p for p in plan.phases if p.name == "rollout")
    return next(p for p in rollout.parts if p.label.startswith("engine KV cache"))


def test_an_explicit_cap_counts_the_window_pool_by_hand():
    # 40000 tokens: 2500 full blocks; sequences of 768 tokens (48 blocks, a window spans 33): the full
    # pool holds ceil(2500 / 48) = 53 of them, so the window pool has 53 x 33 + 512 + 48 = 2309 blocks
    plan = plan_memory(_inputs(kv_cache_max_tokens=40000))
    part = _kv_part(plan)
    assert plan.kv_cache_tokens == 40000
    assert part.label == "engine KV cache (40000 tokens; sliding-window layers 36944)"
    assert part.nbytes == 2500 * FULL_BLOCK + 2309 * WINDOW_BLOCK


def test_the_budget_holds_more_tokens_than_full_kv_in_every_layer():
    """Sized by memory: the plan applies the engine's split (:func:`tidal.engine.sizing.split_kv_pools`)
    to the engine's budget (kv_cache_memory_fraction of what is free at wake-up); the part never
    exceeds it, and the full layers hold a third more tokens than one pool of every layer's full KV."""
    from tidal.engine.config import EngineConfig

    plan = plan_memory(_inputs())
    rollout = next(p for p in plan.phases if p.name == "rollout")
    resident = sum(p.nbytes for p in rollout.parts if p.allocated and p.label in ("actor weights", "actor optimizer state"))
    engine_weights = next(p.nbytes for p in rollout.parts if p.label == "engine weights")
    overhead = next(p.nbytes for p in rollout.parts if p.label.startswith("CUDA context"))
    budget = sizing.kv_budget_bytes(EngineConfig(), H200.total - overhead - resident - engine_weights)
    full, window = sizing.split_kv_pools(lambda n, w: n * FULL_BLOCK + w * WINDOW_BLOCK, budget, block_size=16, window=512,
                                         seq_len=768, max_num_batched_tokens=8192)
    part = _kv_part(plan)
    assert plan.kv_cache_tokens == full * 16 and part.nbytes == full * FULL_BLOCK + window * WINDOW_BLOCK <= budget
    assert window == -(-full // 48) * 33 + 512 + 48
    assert full >= 1.3 * (budget // (FULL_BLOCK + WINDOW_BLOCK))
