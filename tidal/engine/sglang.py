"""SGLangEngine: the RolloutEngine contract over ``sglang.Engine`` (``engine.backend=sglang``).

UNTESTED AGAINST A RUNNING SGLANG. The calls below were written against the source of sglang 0.5.23
and are checked against its installed signatures (tests/engine/test_sglang_api.py) and a fake
engine (tests/engine/test_sglang_adapter.py); no SGLang engine has generated a token through this
adapter, because SGLang cannot run on the machines this was built on (CPU only: the PyPI
``sglang-kernel`` wheel is CUDA-only, see docs/engines-external.md).

Layout: one ``sglang.Engine`` per rollout TP group, started by the group's first rank with
``tp_size = engine.tp_size`` and ``base_gpu_id`` = that rank's GPU; SGLang spawns one scheduler
process per GPU of the group (TP groups are consecutive ranks, so consecutive local GPUs). The other
ranks of the group hold no engine: ``generate`` runs on the first rank and its completions are
broadcast over the TP group; weights are sent by the first rank only (``update_weights_from_tensor``
with its full tensors, in the caller's buckets, engine dtype, i.e. bf16 on CUDA; SGLang's
scheduler processes read them through CUDA IPC and shard them).

Sleep levels, explicit: 1 releases ``kv_cache`` and ``cuda_graph`` (weights kept, SGLang's usual
RL setting); 2 also releases ``weights``, started with ``enable_weights_cpu_backup`` so they come
back unchanged. Wake-up is staged: ``load_weights`` on an engine asleep at level 2 resumes
``weights`` only; ``wake_up`` then resumes ``kv_cache`` and ``cuda_graph``.

Logprobs: SGLang returns ``log_softmax(logits / temperature)`` of the sampled token, before top-k /
top-p renormalisation, so this adapter refuses ``top_k > 0``, ``top_p < 1`` and ``min_p > 0`` rather than return
logprobs of a distribution other than the one sampled from.
"""

from __future__ import annotations

import tempfile
from typing import Iterable

import torch
import torch.distributed as dist

from tidal.engine.base import Completion, SamplingParams, eos_ids
from tidal.engine.config import EngineConfig
from tidal.engine.backends import check_backend_installed
from tidal.engine.sizing import device_free_bytes, kv_bytes_per_token, max_running, weight_bytes_per_rank

_KV_TAGS = ["kv_cache", "cuda_graph"]
_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def require_cuda(device: torch.device) -> None:
    if device.type != "cuda":
        raise ValueError(
            "engine.backend=sglang needs CUDA devices: SGLang's CPU backend needs a CPU build of sgl-kernel, "
            "which PyPI does not ship; use engine.backend=native or vllm on CPU"
        )


def mem_fraction_static(*, free: int, total: int, weights: int, kv_fraction: float) -> float:
    """SGLang's ``mem_fraction_static`` that leaves ``kv_fraction`` of the memory free after the
    weights to the KV pool. SGLang sizes the pool as (free after weights) - total * (1 - f)."""
    room = free - weights
    if room <= 0:
        raise RuntimeError(f"no device memory left for SGLang's KV cache ({free} bytes free, weights ~{weights})")
    return min(0.99, 1.0 - (1.0 - kv_fraction) * room / total)


def server_kwargs(hf_config, cfg: EngineConfig, *, model_dir: str, dtype: torch.dtype, base_gpu_id: int,
                  free: int, total: int) -> dict:
    """Keyword arguments of ``sglang.Engine`` (its ServerArgs fields) for this engine config."""
    weights = weight_bytes_per_rank(hf_config, dtype, cfg.tp_size)
    kwargs = dict(
        model_path=model_dir,
        load_format="dummy",  # weights arrive through load_weights
        skip_tokenizer_init=True,  # prompts arrive as token ids
        dtype=_DTYPES[dtype],
        tp_size=cfg.tp_size,
        base_gpu_id=base_gpu_id,
        random_seed=0,
        mem_fraction_static=mem_fraction_static(free=free, total=total, weights=weights, kv_fraction=cfg.kv_cache_memory_fraction),
        max_running_requests=max_running(cfg),  # engine.max_num_seqs: auto (None) leaves SGLang its own default
        chunked_prefill_size=cfg.max_num_batched_tokens,
        page_size=cfg.block_size,
        disable_radix_cache=not cfg.enable_prefix_caching,
        disable_cuda_graph=not cfg.cuda_graphs,
        enable_memory_saver=cfg.sleep_level > 0,  # release/resume need torch_memory_saver
        enable_weights_cpu_backup=cfg.sleep_level == 2,  # released weights come back unchanged
        log_level="error",
    )
    if cfg.kv_cache_max_tokens > 0:
        kwargs["max_total_tokens"] = cfg.kv_cache_max_tokens
    return kwargs


def sampling_dicts(params: SamplingParams, eos: set[int], n_prompts: int) -> list[dict]:
    """One SGLang sampling-params dict per expanded request (prompt-major, ``n`` per prompt)."""
    if params.filter.filters:
        raise ValueError("engine.backend=sglang returns logprobs before top-k/top-p/min-p renormalisation; "
                         "use top_k=0, top_p=1 and min_p=0 (or engine.backend=native/vllm)")
    stop = sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else eos))
    base = dict(temperature=params.temperature, max_new_tokens=params.max_new_tokens, stop_token_ids=stop,
                ignore_eos=params.ignore_eos, no_stop_trim=True)  # keep the stop token, as the other engines do
    out = []
    for i in range(n_prompts * params.n):
        d = dict(base)
        if params.seed is not None:
            d["sampling_seed"] = params.seed + i
        out.append(d)
    return out


def to_completions(prompts: list[list[int]], outputs: list[dict]) -> list[Completion]:
    """SGLang ``generate`` results (one dict per expanded request) -> completions. Token ids and
    logprobs come from ``meta_info.output_token_logprobs`` (logprob, token id, text) triples."""
    result = []
    for prompt, out in zip(prompts, outputs, strict=True):
        meta = out["meta_info"]
        reason = (meta.get("finish_reason") or {}).get("type")
        if reason not in ("stop", "length"):
            raise RuntimeError(f"SGLang finished a request with {meta.get('finish_reason')!r}")
        triples = meta["output_token_logprobs"]
        result.append(Completion(prompt_ids=list(prompt), token_ids=[int(t) for _, t, _ in triples],
                                 logprobs=[float(lp) for lp, _, _ in triples], finish_reason=reason))
    return result


class SGLangEngine:
    """Implements :class:`tidal.engine.base.RolloutEngine` with one ``sglang.Engine`` per TP group
    (see the module docstring). Every rank of a TP group calls each method with the same arguments."""

    def __init__(self, hf_config, cfg: EngineConfig, *, device: torch.device, dtype: torch.dtype, tp_group=None):
        check_backend_installed("sglang")
        self.device = torch.device(device)
        require_cuda(self.device)
        self.cfg = cfg
        self._group = tp_group  # the rollout TP group of engine.tp_size consecutive ranks (None: one rank)
        rank = dist.get_rank() if dist.is_initialized() else 0
        ranks = dist.get_process_group_ranks(tp_group) if tp_group is not None else [rank]
        self._leader = ranks[0]
        self._is_leader = rank == self._leader
        self._eos = eos_ids(hf_config)
        self._engine = None
        kv_tokens = 0
        if self._is_leader:
            import sglang

            self._model_dir = tempfile.TemporaryDirectory(prefix="tidal-sglang-")
            hf_config.save_pretrained(self._model_dir.name)
            free, total = torch.cuda.mem_get_info(self.device)
            self._engine = sglang.Engine(**server_kwargs(
                hf_config, cfg, model_dir=self._model_dir.name, dtype=dtype, base_gpu_id=self.device.index or 0,
                free=free, total=total))
            kv_tokens = int(self._engine.get_server_info()["max_total_num_tokens"])
        kv_tokens = self._from_leader(kv_tokens)
        self._kv_bytes = kv_tokens * kv_bytes_per_token(hf_config, dtype, cfg.tp_size)
        self._weight_bytes = weight_bytes_per_rank(hf_config, dtype, cfg.tp_size)
        self._released: set[str] = set()  # SGLang memory tags released
        self._asleep = False
        self._weights_changed = False

    def _from_leader(self, obj):
        """``obj`` of the TP group's first rank, on every rank of the group."""
        if self._group is None or dist.get_world_size(self._group) == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self._leader, group=self._group)
        return box[0]

    def _on_leader(self, method: str, **kwargs):
        if self._is_leader:
            return getattr(self._engine, method)(**kwargs)
        return None

    # ---- generation -------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """``params.n`` completions per prompt, prompt-major; the same list on every rank of the group."""
        if self._asleep:
            raise RuntimeError("generate() on a sleeping engine: call wake_up() first")
        sampling = sampling_dicts(params, self._eos, len(prompts))
        if not prompts:
            return []
        expanded = [list(p) for p in prompts for _ in range(params.n)]
        completions = None
        if self._is_leader:
            if self._weights_changed:
                self._engine.flush_cache()  # no KV of the old weights is reused
            outputs = self._engine.generate(input_ids=expanded, sampling_params=sampling, return_logprob=True)
            completions = to_completions(expanded, outputs)
        self._weights_changed = False
        return self._from_leader(completions)

    # ---- memory -----------------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> int:
        """Level 1 releases the KV cache and CUDA graphs; level 2 also the weights (kept in host
        memory). Returns this rank's device bytes freed."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self.cfg.sleep_level == 0:
            raise RuntimeError("engine.sleep_level=0: SGLang was started without its memory saver, so sleep() cannot free memory")
        if self._asleep:
            if level == 2 and "weights" not in self._released:
                raise RuntimeError("asleep at level 1: wake_up() before sleep(2)")
            return 0
        tags = _KV_TAGS + (["weights"] if level == 2 else [])
        before = device_free_bytes(self.device)
        self._on_leader("release_memory_occupation", tags=tags)
        self._barrier()
        self._released = set(tags)
        self._asleep = True
        return max(0, device_free_bytes(self.device) - before)

    def wake_up(self) -> int:
        """Resume the weights (if released), then the KV cache and CUDA graphs. SGLang allocates
        outside this process's PyTorch allocator, so the trainer's cached blocks go back to the
        driver first. Returns this rank's device bytes restored."""
        if not self._asleep:
            return 0
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        before = device_free_bytes(self.device)
        self._resume_weights()
        self._on_leader("resume_memory_occupation", tags=_KV_TAGS)
        self._barrier()
        self._released.clear()
        self._asleep = False
        return max(0, before - device_free_bytes(self.device))

    def _resume_weights(self) -> None:
        if "weights" in self._released:
            self._on_leader("resume_memory_occupation", tags=["weights"])
            self._released.discard("weights")

    def _barrier(self) -> None:
        """Wait for the first rank's SGLang call, so each rank measures its own GPU afterwards."""
        if self._group is not None and dist.get_world_size(self._group) > 1:
            dist.barrier(group=self._group)

    def memory_report(self) -> dict[str, int]:
        """Bytes on this rank's GPU by kind (estimates: weights from the config, KV from SGLang's pool size)."""
        return {
            "weights": 0 if "weights" in self._released else self._weight_bytes,
            "kv_cache": 0 if "kv_cache" in self._released else self._kv_bytes,
        }

    # ---- weights ----------------------------------------------------------------------------------
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Send one bucket of (HF name, full tensor) from the first rank of the group (the others'
        identical tensors are not needed). On an engine asleep at level 2 the weights are resumed
        first; the KV cache stays released."""
        self._resume_weights()
        bucket = list(named_tensors)
        if bucket:
            self._on_leader("update_weights_from_tensor", named_tensors=bucket, flush_cache=False)
            self._weights_changed = True
