"""VLLMEngine: the RolloutEngine contract over vLLM's offline ``LLM`` (``engine.backend=vllm``).

vLLM runs inside the trainer's process: its engine core is in-process (no engine subprocess, no
ZMQ hop) and, under torchrun, ``distributed_executor_backend="external_launcher"`` makes every rank
one vLLM worker of the existing ``torch.distributed`` world. vLLM builds its own TP groups over that
world (consecutive ranks, like Tidal's); the constructor checks that they equal the rollout TP
group it was given, since vLLM cannot be handed a group. ``world_size / tp_size`` TP groups are
vLLM data-parallel replicas, each generating its own prompts.

Weights: the model starts from ``hf_config`` alone (written to a private temporary folder with
``load_format="dummy"``); real weights arrive through :meth:`VLLMEngine.load_weights` in buckets of
(HF name, full tensor). Buckets go through vLLM's layer-wise reload (the path of its own
``reload_weights``): a layer is re-processed (repacked, quantised, ...) once all its tensors have
arrived, so a layer may span buckets; a tied parameter sent once (``model.embed_tokens.weight``) is
also loaded under its aliases (``lm_head.weight``). The update is closed (remaining layers
finalised, prefix cache reset) by the next ``generate``, ``wake_up`` or ``sleep``.

Sleep levels are mapped explicitly, never left to vLLM's default:

=========  ==========================================  ============================================
Tidal      frees                                       vLLM calls
=========  ==========================================  ============================================
1          KV cache only (weights stay on the device)  ``sleep(level=0)`` + ``release_kv_cache_memory()``
2          KV cache, weights moved to host memory      ``sleep(level=1)`` (vLLM level 1 *offloads*
                                                       weights; vLLM level 2 would discard them)
=========  ==========================================  ============================================

Wake-up is staged: :meth:`load_weights` on an engine asleep at level 2 wakes the weights only
(``wake_up(tags=["weights"])``) and loads into them, so a weight sync never holds the KV cache;
:meth:`wake_up` then restores the KV cache (``wake_up(tags=["kv_cache"])``). On CPU vLLM has no
sleep mode: the same calls pause and resume scheduling but free nothing (and
``release_kv_cache_memory`` is skipped, vLLM refuses it there); ``sleep``/``wake_up`` return 0.

Sampling: ``logprobs_mode="processed_logprobs"``, so each returned logprob is that of the
distribution sampled from (after temperature, min-p, top-k, top-p, in :mod:`tidal.sampling_filter`'s
order; vLLM takes its PyTorch sampler for this mode, never FlashInfer's, which returns no processed
logprobs); for temperature 0 it is the untempered softmax. One difference from Tidal's definition:
at a top-p boundary of exactly tied logits vLLM keeps the tied tokens its sort put first, Tidal keeps
them all. vLLM has no TP broadcast of sampled tokens (every TP rank samples), so requests without a
seed are sampled from a generator seeded identically on every TP rank of a replica, inside
``torch.random.fork_rng``: the trainer's RNG is never read or advanced by the engine.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import random
import tempfile
from typing import Iterable

import numpy as np
import torch
import torch.distributed as dist

from tidal.config_base import ConfigError
from tidal.engine.base import Completion, SamplingParams, eos_ids
from tidal.engine.config import EngineConfig
from tidal.engine.backends import check_backend_installed
from tidal.engine.sizing import device_free_bytes, kv_bytes_per_token, max_running, weight_bytes_per_rank

_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_CPU_BLOCK_MULTIPLE = 32  # vLLM's CPU attention backend takes blocks of a multiple of 32 tokens


# ---- pure helpers (no vllm import): config -> vLLM arguments ------------------------------------
def tied_aliases(hf_config) -> dict[str, list[str]]:
    """HF names that share a parameter with an earlier one (``lm_head.weight`` of a model with tied
    embeddings), keyed by that first name. Trainers send a tied parameter once, under its first name
    (Strategy.full_weights); vLLM's layer-wise reload re-processes each layer on its own, so every
    alias must be loaded too (e.g. the LM head, repacked separately by vLLM's CPU kernels)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {group[0]: group[1:] for group in names.values() if len(group) > 1}


def with_aliases(bucket: list[tuple[str, torch.Tensor]], aliases: dict[str, list[str]]) -> list[tuple[str, torch.Tensor]]:
    """``bucket`` plus (alias, tensor) for every tied alias of its names that it does not carry."""
    present = {name for name, _ in bucket}
    extra = [(alias, t) for name, t in bucket for alias in aliases.get(name, ()) if alias not in present]
    return bucket + extra


def kv_cache_bytes(hf_config, cfg: EngineConfig, *, dtype: torch.dtype, device: torch.device, free_bytes: int) -> int:
    """Bytes of KV cache to give vLLM (``kv_cache_memory_bytes``), per TP rank.

    ``engine.kv_cache_max_tokens > 0`` fixes it; else on CUDA it is ``kv_cache_memory_fraction`` of
    the device memory free at start-up minus this rank's weights. vLLM allocates its cache once, so
    on CPU (where the native engine grows its cache per request) a token cap is required.
    """
    per_token = kv_bytes_per_token(hf_config, dtype, cfg.tp_size)
    if cfg.kv_cache_max_tokens > 0:
        return cfg.kv_cache_max_tokens * per_token
    if device.type != "cuda":
        raise ConfigError("engine.kv_cache_max_tokens", "must be > 0 for engine.backend=vllm on CPU (vLLM allocates its KV cache once, at start-up)")
    room = free_bytes - weight_bytes_per_rank(hf_config, dtype, cfg.tp_size)
    nbytes = int(room * cfg.kv_cache_memory_fraction)
    if nbytes < per_token * cfg.block_size:
        raise RuntimeError(f"no device memory left for vLLM's KV cache ({free_bytes} bytes free before the weights)")
    return nbytes


def llm_kwargs(hf_config, cfg: EngineConfig, *, model_dir: str, device: torch.device, dtype: torch.dtype,
               world_size: int, free_bytes: int = 0, total_bytes: int = 0) -> dict:
    """Keyword arguments of ``vllm.LLM`` for this engine config (every choice explicit).
    ``free_bytes`` / ``total_bytes``: the device's memory at start-up (CUDA only)."""
    if device.type == "cpu" and cfg.block_size % _CPU_BLOCK_MULTIPLE:
        raise ConfigError("engine.block_size", f"vLLM on CPU needs a multiple of {_CPU_BLOCK_MULTIPLE}, got {cfg.block_size}")
    kv_bytes = kv_cache_bytes(hf_config, cfg, dtype=dtype, device=device, free_bytes=free_bytes)
    kv_tokens = kv_bytes // kv_bytes_per_token(hf_config, dtype, cfg.tp_size)
    kwargs = dict(
        model=model_dir,
        skip_tokenizer_init=True,  # prompts arrive as token ids
        load_format="dummy",  # weights arrive through load_weights
        generation_config="vllm",  # no defaults read from generation_config.json
        dtype=_DTYPES[dtype],
        tensor_parallel_size=cfg.tp_size,
        distributed_executor_backend="external_launcher" if world_size > 1 else "uni",
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        block_size=cfg.block_size,
        enable_prefix_caching=cfg.enable_prefix_caching,
        enforce_eager=device.type != "cuda" or not cfg.cuda_graphs,
        enable_sleep_mode=device.type == "cuda" and cfg.sleep_level > 0,
        kv_cache_memory_bytes=kv_bytes,
        max_model_len=min(hf_config.max_position_embeddings, kv_tokens),
        logprobs_mode="processed_logprobs",
        seed=0,  # vLLM's own RNG at start-up; identical on every rank, as external_launcher requires
        disable_log_stats=True,
    )
    if max_running(cfg) is not None:  # engine.max_num_seqs: auto leaves vLLM its own default
        kwargs["max_num_seqs"] = max_running(cfg)
    if world_size > cfg.tp_size:
        kwargs["data_parallel_size"] = world_size // cfg.tp_size
    if device.type == "cuda":
        # vLLM refuses to start unless total * gpu_memory_utilization is free; the trainer holds the
        # rest, and kv_cache_memory_bytes (not this) sizes the KV cache
        kwargs["gpu_memory_utilization"] = round(0.98 * free_bytes / total_bytes, 4)
    return kwargs


def sampling_kwargs(params: SamplingParams, eos: set[int]) -> dict:
    """Keyword arguments of ``vllm.SamplingParams``. EOS ids are passed as stop tokens because the
    engine has no tokenizer; stop tokens are kept in the output (as in the native engine)."""
    stop = set(params.stop_token_ids) | (set() if params.ignore_eos else eos)
    return dict(
        n=params.n, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, min_p=params.min_p,
        max_tokens=params.max_new_tokens, stop_token_ids=sorted(stop), ignore_eos=params.ignore_eos,
        seed=params.seed, logprobs=0, detokenize=False,
    )


def to_completions(outputs) -> list[Completion]:
    """vLLM ``RequestOutput`` list (in prompt order) -> prompt-major completions."""
    result = []
    for out in outputs:
        for c in sorted(out.outputs, key=lambda c: c.index):
            if c.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"vLLM finished request {out.request_id} with {c.finish_reason!r}")
            token_ids = list(c.token_ids)
            result.append(Completion(
                prompt_ids=list(out.prompt_token_ids), token_ids=token_ids,
                logprobs=[float(lp[t].logprob) for lp, t in zip(c.logprobs, token_ids)],
                finish_reason=c.finish_reason,
            ))
    return result


def call_seed(replica: int, call: int) -> int:
    """Seed of the generator that unseeded requests of one ``generate`` call sample from: the same on
    every TP rank of a replica (each rank samples), different across calls and replicas. 31 bits,
    since the CPU generator keeps only the low 32 bits of a seed."""
    digest = hashlib.blake2b(f"{replica}:{call}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


@contextlib.contextmanager
def _own_rng(device: torch.device, seed: int | None = None):
    """Run a block on forked RNGs (torch CPU and ``device``, Python, NumPy), optionally seeded, and
    restore the caller's states afterwards."""
    py_state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        if seed is not None:  # this rank's CPU generator and its device's, no other device's
            torch.random.default_generator.manual_seed(seed)
            if device.type == "cuda":
                with torch.cuda.device(device):
                    torch.cuda.manual_seed(seed)
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


@contextlib.contextmanager
def _in_process_engine_core():
    """vLLM's engine core in this process (external_launcher requires it; we want it always)."""
    old = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = old


# ---- functions run on the in-process vLLM model (through LLM.apply_model) -----------------------
def _begin_reload(model) -> None:
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    initialize_layerwise_reload(model)


def _load(bucket: list[tuple[str, torch.Tensor]], model) -> None:
    model.load_weights(weights=bucket)


def _finish_reload(model_config, model) -> None:
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    finalize_layerwise_reload(model, model_config)


class VLLMEngine:
    """Implements :class:`tidal.engine.base.RolloutEngine` with vLLM (see the module docstring).

    Every rank of the world constructs it at the same time and, under TP, every rank of a TP group
    calls each method with the same arguments (as :func:`tidal.distributed.gather_and_generate` does).
    """

    def __init__(self, hf_config, cfg: EngineConfig, *, device: torch.device, dtype: torch.dtype, tp_group=None):
        check_backend_installed("vllm")
        import vllm

        self.cfg = cfg
        self.device = torch.device(device)
        self._vllm = vllm
        self._frees_memory = self.device.type == "cuda"  # vLLM's sleep mode exists on CUDA only
        world = dist.get_world_size() if dist.is_initialized() else 1
        self._model_dir = tempfile.TemporaryDirectory(prefix="tidal-vllm-")
        hf_config.save_pretrained(self._model_dir.name)
        free, total = torch.cuda.mem_get_info(self.device) if self.device.type == "cuda" else (0, 0)
        kwargs = llm_kwargs(hf_config, cfg, model_dir=self._model_dir.name, device=self.device, dtype=dtype,
                            world_size=world, free_bytes=free, total_bytes=total)
        with _own_rng(self.device), _in_process_engine_core():
            self._llm = vllm.LLM(**kwargs)
        if world > 1:
            _check_vllm_tp_ranks(tp_group)
        self._replica = dist.get_rank() // cfg.tp_size if world > 1 else 0
        self._eos = eos_ids(hf_config)
        self._aliases = tied_aliases(hf_config)
        self._kv_bytes = kwargs["kv_cache_memory_bytes"]
        # vLLM's CPU kernels repack weights out of nn.Parameters, so count them from the config
        self._weight_bytes = weight_bytes_per_rank(hf_config, dtype, cfg.tp_size)
        self._released: set[str] = set()  # vLLM memory tags released: "weights", "kv_cache"
        self._asleep = False
        self._update_open = False
        self._generate_calls = 0

    # ---- generation -------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """``params.n`` completions per prompt, prompt-major."""
        if self._asleep:
            raise RuntimeError("generate() on a sleeping engine: call wake_up() first")
        self._finish_update()
        if not prompts:
            return []
        self._generate_calls += 1
        sp = self._vllm.SamplingParams(**sampling_kwargs(params, self._eos))
        inputs = [{"prompt_token_ids": list(p)} for p in prompts]
        with _own_rng(self.device, call_seed(self._replica, self._generate_calls)):
            outputs = self._llm.generate(inputs, sp, use_tqdm=False)
        return to_completions(outputs)

    # ---- memory -----------------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> int:
        """Level 1 frees the KV cache; level 2 also moves the weights to host memory. Returns the
        device bytes freed (0 on CPU). Sleeping again at the same or a lower level does nothing."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self._frees_memory and self.cfg.sleep_level == 0:
            raise RuntimeError("engine.sleep_level=0: vLLM was started without sleep mode, so sleep() cannot free memory")
        if self._asleep:
            if level == 2 and "weights" not in self._released:
                raise RuntimeError("asleep at level 1: wake_up() before sleep(2)")
            return 0
        self._finish_update()
        self._llm.llm_engine.step()  # retire the last call's finished requests (release needs an idle scheduler)
        before = device_free_bytes(self.device)
        if level == 1:
            self._llm.sleep(level=0)
            if self._frees_memory:
                self._llm.release_kv_cache_memory()
            self._released = {"kv_cache"}
        else:
            self._llm.sleep(level=1)
            self._released = {"weights", "kv_cache"}
        self._asleep = True
        return max(0, device_free_bytes(self.device) - before)

    def wake_up(self) -> int:
        """Restore what sleep freed, weights first, then the KV cache; never changes the weights.
        vLLM allocates outside PyTorch's allocator, so the trainer's cached blocks go back to the
        driver first. Returns the device bytes restored."""
        if not self._asleep:
            return 0
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        before = device_free_bytes(self.device)
        if "weights" in self._released:
            self._wake("weights")
        self._finish_update()  # a weight update closes before the KV cache comes back
        if not self._wake("kv_cache"):
            raise RuntimeError("vLLM still reports released memory after waking weights and KV cache")
        self._asleep = False
        return max(0, before - device_free_bytes(self.device))

    def _wake(self, tag: str) -> bool:
        """Wake one vLLM memory tag; returns whether vLLM is fully awake (scheduling resumed)."""
        fully_awake = self._llm.wake_up(tags=[tag])
        self._released.discard(tag)
        return fully_awake

    def memory_report(self) -> dict[str, int]:
        """Bytes held now by kind on this rank: ``weights`` (estimated from the config), ``kv_cache``
        (as allocated). On CPU nothing is ever released, and the bytes are host bytes."""
        released = self._released if self._frees_memory else set()
        return {
            "weights": 0 if "weights" in released else self._weight_bytes,
            "kv_cache": 0 if "kv_cache" in released else self._kv_bytes,
        }

    # ---- weights ----------------------------------------------------------------------------------
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load one bucket of (HF name, full tensor); each TP rank keeps its shard. On an engine asleep
        at level 2 the weights are woken first (the KV cache stays released)."""
        if "weights" in self._released:
            self._wake("weights")
        bucket = with_aliases(list(named_tensors), self._aliases)
        if not bucket:
            return
        if not self._update_open:
            self._llm.apply_model(_begin_reload)
            self._update_open = True
        self._llm.apply_model(functools.partial(_load, bucket))

    def _finish_update(self) -> None:
        if not self._update_open:
            return
        self._llm.apply_model(functools.partial(_finish_reload, self._llm.llm_engine.model_config))
        self._update_open = False
        if not self._llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache after a weight update")


def _check_vllm_tp_ranks(tp_group) -> None:
    """vLLM builds its own TP group over the world; it must be the rollout group we were given."""
    from vllm.distributed.parallel_state import get_tp_group

    ours = dist.get_process_group_ranks(tp_group) if tp_group is not None else [dist.get_rank()]
    theirs = list(get_tp_group().ranks)
    if sorted(ours) != sorted(theirs):
        raise RuntimeError(f"vLLM's TP group {theirs} differs from the rollout TP group {ours}")
