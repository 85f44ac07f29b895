"""Sizing facts of a model for an engine, from its HF config alone (no engine import): KV bytes per
token, weight bytes per TP rank, EOS ids, and the device's free memory as the driver sees it; and
the sizing rules of the engine's KV cache and decode batch (pure functions of the config and the
memory, called by the native engine at each wake-up)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from tidal import families

if TYPE_CHECKING:
    from tidal.engine.config import EngineConfig


def kv_bytes_per_token(hf_config, dtype: torch.dtype, tp_size: int) -> int:
    """KV-cache bytes of one token on one TP rank over the layers that keep KV, as the model's
    family declares them (:func:`tidal.families.kv_bytes_per_token`; KV heads are replicated when
    there are fewer than ``tp_size``). ``hf_config``: the model's config or its text config."""
    caches = families.layer_caches(hf_config)
    return families.kv_bytes_per_token(caches, torch.empty(0, dtype=dtype).element_size(), tp_size)


def weight_bytes_per_rank(hf_config, dtype: torch.dtype, tp_size: int) -> int:
    """Approximate device bytes of the weights on one TP rank (parameters counted on the meta device;
    a ``text_only`` family's ForConditionalGeneration config counts its text decoder alone, which
    is all the engine holds)."""
    from transformers import AutoModelForCausalLM

    family = families.find_family(hf_config)
    if family is not None and family.text_only:
        hf_config = hf_config.get_text_config()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    n = sum(p.numel() for p in model.parameters())
    return n * torch.empty(0, dtype=dtype).element_size() // tp_size


def device_free_bytes(device: torch.device) -> int:
    """Free device memory as the driver sees it (vLLM's sleep mode unmaps memory behind PyTorch's
    allocator, so allocator statistics would miss it); 0 on CPU."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    return torch.cuda.mem_get_info(device)[0]


# ---- the engine's KV cache and decode batch (issue 20) ----------------------------------------
# A rollout is never split into waves when memory allows one wave:
# - ``engine.max_num_seqs: auto`` puts no cap on the sequences decoded together: as many run as the
#   KV cache holds. An explicit number caps them.
# - On CUDA the KV cache takes ``kv_cache_memory_fraction`` of the memory available when the engine
#   wakes up, i.e. after the phases before the rollout: the driver's free memory plus what PyTorch's
#   allocator holds cached but unused (it is handed back if the cache needs it).
#   ``kv_cache_max_tokens`` fixes it instead.
# - On CPU (tests) the cache holds the sequences that would run together at their full length.
# - Under tensor parallelism the ranks size their caches from their own memory and schedule over
#   the smallest block count of the group (the engine's one all-reduce at allocation).


def sized_by_memory(device: torch.device) -> bool:
    """Whether the KV cache on ``device`` is sized from its free memory (CUDA) rather than from the
    requests (CPU)."""
    return device.type == "cuda"


def available_device_bytes(device: torch.device) -> int:
    """Device memory the KV cache may take now: free at the driver plus cached-but-unused in PyTorch's allocator."""
    torch.cuda.synchronize(device)
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free + max(0, cached)


def kv_budget_bytes(cfg: EngineConfig, available_bytes: int) -> int:
    """Bytes of KV cache to allocate out of ``available_bytes`` (CUDA). The one rule of the KV
    cache's size: the engine applies it at each wake-up, the memory plan
    (:mod:`tidal.memory.plan`, whose inputs carry ``kv_cache_memory_fraction`` too) to its
    predicted free memory."""
    return int(available_bytes * cfg.kv_cache_memory_fraction)


def max_running(cfg: EngineConfig) -> int | None:
    """The cap on sequences running at once: None for ``auto`` (the KV cache decides)."""
    return None if cfg.max_num_seqs == "auto" else cfg.max_num_seqs


def state_slots(cfg: EngineConfig, per_slot_bytes: int, available_bytes: int | None, running: int | None = None) -> int:
    """Slots of a hybrid model's recurrent-state pool (``per_slot_bytes`` each): twice the sequences
    that run together, the second half holding the checkpoints that forks, resumed sequences and
    later turns copy. Running sequences: ``max_num_seqs`` when set; else on CUDA
    (``available_bytes``) as many as an eighth of the KV budget holds (the pool takes a quarter),
    at most 1024; else (CPU) ``running``, the request's sequences. The KV cache then takes its
    share of what is left (:func:`kv_budget_bytes`)."""
    cap = max_running(cfg)
    if cap is None and available_bytes is not None:
        return 2 * max(1, min(1024, kv_budget_bytes(cfg, available_bytes) // (8 * per_slot_bytes)))
    if cap is None or (running is not None and running < cap):
        cap = running
    return 2 * max(1, cap or 1)


def blocks_for_lengths(lengths: list[int], block_size: int, max_seqs: int | None) -> int:
    """KV blocks for the longest ``max_seqs`` (all when None) of sequences of full ``lengths`` tokens
    to run together (CPU sizing)."""
    blocks = sorted((-(-n // block_size) for n in lengths), reverse=True)
    return sum(blocks if max_seqs is None else blocks[:max_seqs])


# ---- the sliding-window layers' pool (issue 50 item 3) -------------------------------------------
# A model with both full-attention and sliding-window layers keeps the window layers' KV blocks in a
# pool of their own (tidal.engine.native.window_blocks): a decoding sequence holds at most
# ``(window - 1) // block_size + 2`` of them, whatever its length. The two pools split the KV budget
# for sequences of ``seq_len`` tokens (the rollout's longest: ``data.max_prompt_len +
# rollout.max_new_tokens``, which the trainer hands the engine and the plan reads): the window pool
# holds the windows of the sequences of that length the full pool holds, plus the transient of
# prefill (a step's new tokens and one sequence prefilled whole, a resumed one: each holds its new
# tokens' window blocks for the step). Without ``seq_len`` both pools get the same block count.


def window_blocks_per_sequence(num_tokens: int, *, block_size: int, window: int) -> int:
    """The most window-layer blocks a decoding sequence of ``num_tokens`` tokens holds."""
    return min(-(-num_tokens // block_size), (window - 1) // block_size + 2)


def window_pool_blocks(full_blocks: int, *, block_size: int, window: int, seq_len: int | None,
                       max_num_batched_tokens: int) -> int:
    """Blocks of the window layers' pool beside a full pool of ``full_blocks`` (see above)."""
    if seq_len is None:
        return full_blocks
    f = -(-seq_len // block_size)
    seqs = -(-full_blocks // f)
    extra = -(-max_num_batched_tokens // block_size) + f
    return min(full_blocks, seqs * window_blocks_per_sequence(seq_len, block_size=block_size, window=window) + extra)


def window_blocks_for_lengths(lengths: list[int], full_blocks: int, *, block_size: int, window: int, max_seqs: int | None,
                              max_num_batched_tokens: int) -> int:
    """The window pool beside a full pool of ``full_blocks`` for the longest ``max_seqs`` (all when
    None) of sequences of full ``lengths`` tokens running together (CPU sizing)."""
    f = sorted((-(-n // block_size) for n in lengths), reverse=True)
    f = f if max_seqs is None else f[:max_seqs]
    w = sum(min(b, (window - 1) // block_size + 2) for b in f)
    return min(full_blocks, w + -(-max_num_batched_tokens // block_size) + f[0])


def split_kv_pools(bytes_of, nbytes: int, *, block_size: int, window: int | None, seq_len: int | None,
                   max_num_batched_tokens: int, max_blocks: int | None = None) -> tuple[int, int]:
    """(full blocks, window blocks): the largest full pool whose cache, with its window pool
    (:func:`window_pool_blocks`; 0 without window layers), takes at most ``nbytes``
    (``bytes_of(full, window)``: the cache's bytes, monotone); (0, 0) when not even one block fits.
    ``max_blocks``: a cap on either pool (a fixed-address region's size)."""
    def win(n: int) -> int:
        if window is None:
            return 0
        return window_pool_blocks(n, block_size=block_size, window=window, seq_len=seq_len,
                                  max_num_batched_tokens=max_num_batched_tokens)

    def fits(n: int) -> bool:
        return bytes_of(n, win(n)) <= nbytes and (max_blocks is None or n <= max_blocks)

    if not fits(1):
        return 0, 0
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, win(lo)


def kv_cache_bytes(caches, *, full_blocks: int, window_blocks: int, block_size: int, dtype_bytes: int,
                   tp_size: int, granule: int = 1) -> int:
    """Device bytes of the native engine's cache of ``full_blocks`` (+ 1 scratch) blocks in the
    full-attention layers and ``window_blocks`` (+ 1) in the window layers (``caches``: the
    family's layer caches; without a window pool every attention layer has ``full_blocks``), each
    layer's K and V rounded up to ``granule`` bytes (the driver's mapping granularity of a cache
    at a fixed address)."""
    split = families.has_window_pool(caches)
    total = 0
    for c in caches:
        if c.has_kv:
            blocks = window_blocks if split and c.window is not None else full_blocks
            half = (blocks + 1) * block_size * families.kv_bytes_per_token([c], dtype_bytes, tp_size) // 2
            total += 2 * (-(-half // granule) * granule)
    return total


def graph_max_batch(cfg: EngineConfig, device: torch.device, graph_safe: bool) -> int:
    """The largest decode batch replayed from a CUDA graph (0: no graphs). Above
    ``cuda_graph_max_batch`` a decode step runs eagerly: its device time (a few ms at 0.5B and
    thousands of rows) hides the ~1 ms of kernel launches behind it (overlap scheduling), while each
    captured bucket would cost capture time and graph-pool memory for its activations."""
    if not (cfg.cuda_graphs and device.type == "cuda" and graph_safe):
        return 0
    cap = max_running(cfg)
    return cfg.cuda_graph_max_batch if cap is None else min(cap, cfg.cuda_graph_max_batch)


# ---- what an engine keeps where, for the memory plan (issue 33 item 5) --------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineLayout:
    """An engine backend's memory as the plan composes it. ``own_kv_rule``: its KV cache is sized
    by :func:`kv_budget_bytes` at each wake-up (and must hold a sequence); ``graphs``: decode CUDA
    graphs replay from their own pool, which outlives level-1 sleeps when the KV cache has a fixed
    address (``kv_fixed``); ``parks_weights``: level-2 sleep keeps the weights in pinned host
    memory; ``note``: what the plan cannot know of it."""

    own_kv_rule: bool
    graphs: bool
    graphs_survive_sleep: bool
    parks_weights: bool
    note: str = ""


def engine_layout(cfg: EngineConfig, *, kv_fixed: bool) -> EngineLayout:
    """The layout of ``engine.backend``: the native engine's is this package's; vLLM and SGLang
    size their memory themselves (counted like the native engine's); ``hf`` generation keeps no
    cache between calls."""
    native = cfg.backend == "native"
    note = "" if cfg.backend in ("native", "hf") else (
        f"engine.backend={cfg.backend}: its memory is sized by the engine itself; the plan counts it like the native engine's")
    return EngineLayout(own_kv_rule=native, graphs=native and cfg.cuda_graphs, graphs_survive_sleep=native and cfg.cuda_graphs and kv_fixed,
                        parks_weights=native, note=note)


def prefill_bytes(*, hidden: int, intermediate: int, max_num_batched_tokens: int, tp_size: int) -> int:
    """Activations of the engine's largest prefill step (eager): a chunk of ``max_num_batched_tokens``
    through one layer at a time."""
    return max_num_batched_tokens * (6 * intermediate // tp_size + 8 * hidden)


def decode_bytes(*, hidden: int, intermediate: int, vocab: int, max_num_seqs: int, tp_size: int) -> int:
    """Activations of a decode step of ``max_num_seqs`` sequences with its fp32 logits and sampling
    buffers; with CUDA graphs they live in the graphs' private pool (reserved, not allocated)."""
    return max_num_seqs * (6 * intermediate // tp_size + 8 * hidden + 16 * vocab // tp_size)
