"""Configuration of the rollout engine."""

from __future__ import annotations

import dataclasses
from typing import Literal

from tidal.config_base import check

# Fields a backend does not honour: set away from its default with that backend, a ConfigError
# names the field and the backend (never silently ignored).
UNHONOURED_FIELDS: dict[str, tuple[str, ...]] = {
    "native": (),
    "hf": ("max_num_batched_tokens", "block_size", "kv_cache_memory_fraction", "kv_cache_max_tokens",
           "enable_prefix_caching", "cuda_graphs", "kernel_backend", "overlap_scheduling", "cuda_graph_max_batch",
           "speculative"),
    "vllm": ("kernel_backend", "overlap_scheduling", "cuda_graph_max_batch", "speculative"),
    "sglang": ("kernel_backend", "overlap_scheduling", "cuda_graph_max_batch", "speculative"),
}


@dataclasses.dataclass(kw_only=True)
class EngineConfig:
    """Rollout engine settings (``engine.*``).

    backend: ``native`` (Tidal's embedded paged engine, default), ``hf`` (a simple reference loop
        over the Hugging Face model with its KV cache), ``vllm`` or ``sglang`` (optional extras).
    tp_size: rollout tensor-parallel size; TP groups are consecutive ranks; WORLD_SIZE % tp_size == 0.
    dtype: weight/activation dtype of the engine (``auto``: bf16 on CUDA, fp32 on CPU).
    max_num_seqs: most sequences decoded in one step; ``auto``: as many as the KV cache holds, so a
        rollout runs in one wave whenever memory allows (native engine; the hf engine then batches
        all sequences at once).
    max_num_batched_tokens: token budget of one prefill step (chunked prefill above it).
    block_size: tokens per KV-cache block.
    kv_cache_memory_fraction: share of the device memory available at each wake-up (free at the
        driver plus cached-unused in PyTorch's allocator, i.e. what the phases before the rollout
        left) given to the KV cache on CUDA; on CPU ``kv_cache_max_tokens`` bounds the cache instead.
    kv_cache_max_tokens: hard cap on cached tokens (0: derived from memory on CUDA; on CPU, 0 sizes
        the cache for the sequences of each request that run together, at full length).
    enable_prefix_caching: share KV blocks of identical prompt prefixes (GRPO groups prefill once).
    cuda_graphs: capture decode steps in CUDA graphs at bucketed batch sizes (CUDA only).
    cuda_graph_max_batch: the largest decode batch replayed from a CUDA graph; larger ones run
        eagerly (their device time hides the kernel launches; graphs there would cost capture time
        and graph-pool memory).
    sleep_level: what sleep() frees between rollouts: 0 never sleep, 1 KV cache, 2 KV cache + weights
        (parked in host memory, copied back for the next rollout). ``auto`` (default): the memory
        plan chooses 1, or 2 when the training phases do not fit otherwise (docs/memory.md); where
        no plan is made (a CPU run without ``memory.device_memory_gib``) 1.
    Not every backend honours every field: ``hf`` (a plain loop over the HF model's own cache) takes
    only ``tp_size`` (1), ``dtype``, ``max_num_seqs`` (rows per batch) and ``sleep_level`` (2 moves its
    weights to host memory); ``vllm``/``sglang`` take all but ``kernel_backend`` and
    ``overlap_scheduling`` (native-engine settings). A field a backend does not honour, set away
    from its default, is a config error naming it (:data:`UNHONOURED_FIELDS`).
    kernel_backend: kernels of the native engine: ``triton`` (CUDA: fused norm/RoPE/KV-store, paged
        attention; needed for CUDA graphs), ``torch`` (plain PyTorch, any device), ``auto`` (triton on
        CUDA when importable, else torch).
    overlap_scheduling: while a decode step runs on the device, schedule and prepare the next one on
        the host (its input tokens are fed on the device); off: strictly one step at a time.
    speculative: lossless speculative decoding (native engine; docs/engine.md): drafts from an n-gram
        index over each sequence's prompt, its own text, its group's siblings and its prompt's earlier
        responses, verified several tokens per sequence in one step and accepted exactly (the sampled
        distribution and the returned logprobs are the plain path's). ``auto``: only where decode is
        latency-bound (few running sequences) and while drafts are accepted; ``on``: every decode step
        in which a sequence has a draft; ``off`` (the default): never (no index is kept). ``auto`` is
        not the default yet: on one H200 it cost 3-5% on random weights and no structured run was
        faster (docs/engine.md).
    """

    backend: Literal["native", "hf", "vllm", "sglang"] = "native"
    tp_size: int = 1
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    max_num_seqs: int | Literal["auto"] = "auto"
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    kv_cache_memory_fraction: float = 0.5
    kv_cache_max_tokens: int = 0
    enable_prefix_caching: bool = True
    cuda_graphs: bool = True
    cuda_graph_max_batch: int = 512
    sleep_level: int | Literal["auto"] = "auto"
    kernel_backend: Literal["auto", "torch", "triton"] = "auto"
    overlap_scheduling: bool = True
    speculative: Literal["auto", "on", "off"] = "off"

    def __post_init__(self):
        check(self.tp_size >= 1, "tp_size", "must be >= 1")
        check(self.max_num_seqs == "auto" or (isinstance(self.max_num_seqs, int) and self.max_num_seqs >= 1),
              "max_num_seqs", f"must be 'auto' or an integer >= 1, got {self.max_num_seqs!r}")
        check(self.cuda_graph_max_batch >= 1, "cuda_graph_max_batch", "must be >= 1")
        check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1")
        check(self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0, "block_size", "must be a power of two")
        check(0 < self.kv_cache_memory_fraction <= 0.95, "kv_cache_memory_fraction", "must be in (0, 0.95]")
        check(self.kv_cache_max_tokens >= 0, "kv_cache_max_tokens", "must be >= 0")
        check(self.speculative in ("auto", "on", "off"), "speculative", f"must be 'auto', 'on' or 'off', got {self.speculative!r}")
        check(self.sleep_level in ("auto", 0, 1, 2) and not isinstance(self.sleep_level, bool), "sleep_level",
              f"must be auto, 0 (never), 1 (KV cache) or 2 (KV cache and weights), got {self.sleep_level!r}")
        check(self.backend != "hf" or self.tp_size == 1, "tp_size", "engine.backend=hf runs on one rank: tensor parallelism needs engine.backend=native")
        defaults = EngineConfig.__dataclass_fields__
        for name in UNHONOURED_FIELDS[self.backend]:
            check(
                getattr(self, name) == defaults[name].default, name,
                f"is not honoured by engine.backend={self.backend} (it is a setting of "
                f"{'the native engine' if name in ('kernel_backend', 'overlap_scheduling', 'cuda_graph_max_batch', 'speculative') else 'paged engines'}); "
                f"leave it at its default ({defaults[name].default!r}) or choose a backend that has it",
            )
