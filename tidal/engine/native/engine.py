"""NativeEngine: Tidal's in-process rollout engine (paged KV, continuous batching, prefix sharing).

It lives in the trainer's process and owns no process group: under tensor parallelism every rank of
the TP group it was given constructs it and calls each method with the same arguments; outputs are
identical on all ranks (TP rank 0 samples and broadcasts). The engine loop is three calls per step:
``scheduler.schedule() -> runner.run(batch) -> scheduler.postprocess(batch, tokens)``.

Memory: construction allocates only the (zero) weights; the KV cache is allocated by the first
``wake_up``/``generate``; ``sleep(1)`` frees the KV cache, ``sleep(2)`` also moves the weights to host
memory. On CUDA with the driver's virtual memory management the KV cache comes back at the same
address and size (sized once, at the first allocation), so the decode CUDA graphs are captured once
and survive level-1 sleeps; elsewhere they are freed with the cache and captured again.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from typing import Iterable

import torch
import torch.distributed as dist

from tidal.engine.base import Completion, SamplingParams
from tidal.engine.config import EngineConfig
from tidal.engine.native.block_manager import BlockManager
from tidal.engine.native.kernels import get_ops
from tidal.engine.native.model_runner import ModelRunner, SamplingState
from tidal.engine.native.models import build_model
from tidal.engine.native.parallel import TPGroup
from tidal.engine.native.scheduler import Scheduler
from tidal.engine.native.sequence import Sequence


def _eos_ids(value) -> set[int]:
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, (list, tuple)) else {int(value)}


class NativeEngine:
    """Implements :class:`tidal.engine.base.RolloutEngine` for Qwen2/Qwen2.5/Qwen3/Llama models, and
    Qwen2-VL/Qwen2.5-VL with image prompts (``generate(..., mm_inputs=...)``).

    ``stats`` counts, since construction: ``prefill_tokens`` (tokens whose KV was computed by
    prefill), ``prefix_hit_tokens`` (prompt tokens served from the prefix cache), ``preemptions``,
    ``decode_steps``, ``prefill_steps``, ``ahead_steps`` (decode steps scheduled ahead); and host wall seconds spent in ``schedule_s``,
    ``postprocess_s`` and the runner's ``prepare_s`` (inputs), ``submit_s`` (model + sampling
    enqueued) and ``wait_s`` (waiting for the sampled tokens).
    """

    def __init__(
        self,
        hf_config,
        cfg: EngineConfig,
        *,
        device: torch.device,
        dtype: torch.dtype,
        tp_group: dist.ProcessGroup | None = None,
    ):
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        self.tp = TPGroup.of(tp_group)
        self.ops = get_ops(cfg.kernel_backend, self.device)
        self.model = build_model(hf_config, self.tp, self.ops, self.device, dtype)
        use_graphs = cfg.cuda_graphs and self.device.type == "cuda" and getattr(self.ops, "graph_safe", False)
        self.runner = ModelRunner(
            self.model, self.tp, block_size=cfg.block_size, device=self.device, use_graphs=use_graphs,
            max_num_seqs=cfg.max_num_seqs,
        )
        text_config = hf_config.get_text_config()  # a VL config may keep EOS in its text config only
        self.eos_token_ids = _eos_ids(getattr(hf_config, "eos_token_id", None)) | _eos_ids(getattr(text_config, "eos_token_id", None))
        self.block_manager: BlockManager | None = None
        self.sleep_level = 0  # 0 awake; 1 KV freed; 2 KV freed and weights on the host
        self._host_weights: dict[str, torch.Tensor] = {}
        self._seq_ids = itertools.count()
        self.stats = dict(prefill_tokens=0, prefix_hit_tokens=0, preemptions=0, decode_steps=0, prefill_steps=0,
                          ahead_steps=0, schedule_s=0.0, postprocess_s=0.0)
        self.stats.update(self.runner.timings)

    @classmethod
    def from_pretrained(cls, path: str, cfg: EngineConfig, *, device, dtype, tp_group=None) -> "NativeEngine":
        """Build from a local HF folder (``config.json`` + ``*.safetensors``); EOS ids of
        ``generation_config.json`` are added to the config's."""
        from safetensors import safe_open
        from transformers import AutoConfig

        engine = cls(AutoConfig.from_pretrained(path), cfg, device=device, dtype=dtype, tp_group=tp_group)
        gen_path = os.path.join(path, "generation_config.json")
        if os.path.exists(gen_path):
            with open(gen_path) as f:
                engine.eos_token_ids |= _eos_ids(json.load(f).get("eos_token_id"))
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {path}")

        def tensors():
            for name in files:
                with safe_open(os.path.join(path, name), "pt", "cpu") as f:
                    for key in f.keys():
                        yield key, f.get_tensor(key)

        engine.load_weights(tensors())
        return engine

    # ---- memory ---------------------------------------------------------------------------------
    def _kv_blocks_for(self, prompts: list[list[int]] | None, params: SamplingParams | None) -> int:
        cfg, bs = self.cfg, self.cfg.block_size
        if cfg.kv_cache_max_tokens > 0:
            return cfg.kv_cache_max_tokens // bs
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * cfg.kv_cache_memory_fraction) // self.runner.block_bytes()
        # CPU without a cap: room for max_num_seqs sequences of the longest request of this call
        longest = self.model.max_positions
        n_seqs = cfg.max_num_seqs
        if prompts:
            longest = min(longest, max(len(p) for p in prompts) + params.max_new_tokens)
            n_seqs = min(n_seqs, len(prompts) * params.n)
        return n_seqs * ((longest + bs - 1) // bs)

    def _ensure_kv(self, prompts=None, params=None) -> int:
        """Allocate the KV cache if absent; on CPU without a cap, regrow it when this request needs more.
        Returns the bytes allocated."""
        grows = self.device.type == "cpu" and self.cfg.kv_cache_max_tokens == 0 and prompts is not None
        if self.runner.kv_cache is not None:
            if not grows or self.runner.num_blocks >= self._kv_blocks_for(prompts, params):
                return 0
            self.runner.free_kv_cache()
        need = self.runner.fixed_kv_blocks or self._kv_blocks_for(prompts, params)
        if need < 1:
            raise RuntimeError("no memory left for a single KV block")
        nbytes = self.runner.allocate_kv_cache(need)
        self.block_manager = BlockManager(need, self.cfg.block_size, self.cfg.enable_prefix_caching)
        return nbytes

    def sleep(self, level: int = 1) -> int:
        """Level 1: free the KV cache (prefix cache forgotten); the CUDA graphs are kept when the cache
        has a fixed address, else freed too. Level 2: also move the weights to host memory (and drop
        the graphs, which point at them). Returns device bytes freed (0 for weights on a CPU engine)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        freed = self.runner.free_kv_cache()
        self.block_manager = None
        if level == 2 and self.sleep_level < 2 and self.device.type != "cpu":
            freed += self.runner.drop_graphs()
            for name, p in self.model.named_parameters():
                host = torch.empty(p.shape, dtype=p.dtype, pin_memory=True)
                host.copy_(p.data)
                self._host_weights[name] = host
                freed += p.numel() * p.element_size()
                p.data = torch.empty(0, dtype=p.dtype, device=self.device)
            torch.cuda.empty_cache()
        self.sleep_level = max(self.sleep_level, level)
        return freed

    def wake_up(self) -> int:
        """Restore the weights (if level 2) and allocate the KV cache. Returns device bytes restored."""
        restored = self._restore_weights()
        self.sleep_level = 0
        return restored + self._ensure_kv()

    def _restore_weights(self) -> int:
        restored = 0
        if self._host_weights:
            for name, p in self.model.named_parameters():
                p.data = self._host_weights.pop(name).to(self.device, non_blocking=True)
                restored += p.numel() * p.element_size()
            self.sleep_level = min(self.sleep_level, 1)
        return restored

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named full tensors into the weights in place (one tensor at a time, so the peak
        is one tensor). Forgets the prefix cache. Asleep at level 2, the weights come back to the
        device first (a staged wake-up: the KV cache stays freed until ``wake_up``)."""
        self._restore_weights()
        self.model.load_weights(named_tensors)
        if self.block_manager is not None:
            self.block_manager.reset_prefix_cache()

    def verify_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """The HF names whose values in this engine differ from the given full tensors (on this TP
        rank's shard); empty when the engine holds exactly what it was sent."""
        return self.model.verify_weights(named_tensors)

    def memory_report(self) -> dict[str, int]:
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters() if p.numel())
        kv = self.runner.kv_cache
        graphs = self.runner.graphs.bytes if self.runner.graphs is not None else 0
        return {"weights": weights, "kv_cache": 0 if kv is None else kv.numel() * kv.element_size(), "graphs": graphs}

    # ---- generation -----------------------------------------------------------------------------
    def generate(
        self, prompts: list[list[int]], params: SamplingParams, mm_inputs: list[dict | None] | None = None
    ) -> list[Completion]:
        """``params.n`` completions per prompt, prompt-major. Every TP rank must call with the same args.

        ``mm_inputs[i]``: the pixel inputs of prompt i's images (None for a text prompt; see
        :mod:`tidal.models.vision`), its ids already holding the placeholders. Vision-language models
        only (Qwen2-VL / Qwen2.5-VL); the images' features are computed once per prompt."""
        if self.sleep_level:
            raise RuntimeError("generate() on a sleeping engine: call wake_up() first")
        if not prompts:
            return []
        if mm_inputs is not None:
            if len(mm_inputs) != len(prompts):
                raise ValueError(f"generate: {len(mm_inputs)} mm_inputs for {len(prompts)} prompts")
            if not self.model.multimodal and any(m is not None for m in mm_inputs):
                raise ValueError(f"generate: image inputs given to a text-only model ({type(self.model).__name__})")
        self._ensure_kv(prompts, params)
        max_pos = self.model.max_positions
        seqs = []
        for i, prompt in enumerate(prompts):
            if len(prompt) >= max_pos:
                raise ValueError(f"prompt of {len(prompt)} tokens >= max_position_embeddings={max_pos}")
            mm = mm_inputs[i] if mm_inputs is not None else None
            mm = self.model.multimodal_prompt(prompt, mm, where=f"prompt {i}") if mm is not None else None
            for _ in range(params.n):
                seqs.append(Sequence(next(self._seq_ids), prompt, min(params.max_new_tokens, max_pos - len(prompt)), mm))
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(self.eos_token_ids))
        scheduler = Scheduler(
            self.block_manager, max_num_seqs=self.cfg.max_num_seqs, max_num_batched_tokens=self.cfg.max_num_batched_tokens
        )
        for seq in seqs:
            scheduler.add(seq)
        sampling = SamplingState(params.temperature, params.top_k, params.top_p, self._generator(params.seed))
        hits_before = self.block_manager.num_hit_tokens
        self._loop(scheduler, sampling, stop_ids)
        self.stats.update(self.runner.timings)
        self.stats["prefix_hit_tokens"] += self.block_manager.num_hit_tokens - hits_before
        self.stats["preemptions"] += scheduler.num_preemptions
        return [
            Completion(prompt_ids=s.prompt_ids, token_ids=s.completion_ids, logprobs=s.logprobs,
                       finish_reason=s.finish_reason)
            for s in seqs
        ]

    def _loop(self, scheduler: Scheduler, sampling: SamplingState, stop_ids: frozenset[int]) -> None:
        """schedule -> launch -> (schedule the next decode step ahead and launch it) -> wait ->
        postprocess, until every sequence is finished."""
        stats, runner = self.stats, self.runner
        pending = None  # a launched batch scheduled ahead, and its handle
        while pending is not None or not scheduler.is_finished():
            t0 = time.perf_counter()
            if pending is None:
                batch = scheduler.schedule()
                handle = runner.launch(batch, sampling)
                self._count(batch)
            else:
                batch, handle = pending
            ahead = scheduler.schedule_ahead(batch) if self.cfg.overlap_scheduling else None
            stats["schedule_s"] += time.perf_counter() - t0
            pending = None
            if ahead is not None:
                pending = (ahead, runner.launch(ahead, sampling, prev=handle))
                self._count(ahead)
                stats["ahead_steps"] += 1
            tokens, logprobs = runner.wait(handle)
            t0 = time.perf_counter()
            scheduler.postprocess(batch, tokens, logprobs, stop_ids)
            if ahead is not None:
                scheduler.commit_ahead(ahead)
            stats["postprocess_s"] += time.perf_counter() - t0

    def _count(self, batch) -> None:
        if batch.is_prefill:
            self.stats["prefill_tokens"] += batch.num_tokens
        self.stats["prefill_steps" if batch.is_prefill else "decode_steps"] += 1

    def _generator(self, seed: int | None) -> torch.Generator | None:
        if seed is None or not self.tp.is_first:
            return None
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        return gen
