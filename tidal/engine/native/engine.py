"""NativeEngine: Tidal's in-process rollout engine (paged KV, continuous batching, prefix sharing).

It lives in the trainer's process and owns no process group: under tensor parallelism every rank of
the TP group it was given constructs it and calls each method with the same arguments; outputs are
identical on all ranks (TP rank 0 samples and broadcasts).

Requests: ``generate`` (the :class:`~tidal.engine.base.RolloutEngine` call) is built on the
incremental API (:class:`~tidal.engine.base.IncrementalEngine`): ``add`` requests, ``step`` until
none is unfinished, ``abort`` to get partial completions back. One step is
``scheduler.schedule() -> runner.launch(batch) -> [schedule and launch the next step ahead] ->
runner.wait -> scheduler.postprocess``; the step scheduled ahead stays in flight across ``step``
calls (``abort`` drops it: its sequences simply compute that token again).

Speculation (``engine.speculative``, :mod:`tidal.engine.native.speculative`): a decode step
scheduled now (not ahead) may carry drafts for some sequences; it then verifies ``k + 1`` positions
per drafting sequence in one forward and may append several tokens to each, with exactly the
plain path's distribution and logprobs. Such a step is never scheduled ahead, nor is the step after
a plain one scheduled ahead while the policy may want to draft.

Memory: construction allocates only the (zero) weights; the KV cache is allocated by ``wake_up``
(or the first request), sized from the memory available then (:mod:`tidal.engine.sizing`);
``sleep(1)`` frees it, ``sleep(2)`` also moves the weights to host memory. On CUDA with the driver's
virtual memory management each layer's cache comes back at the same addresses whatever its size,
so the decode CUDA graphs are captured once and survive level-1 sleeps; elsewhere they are freed
with the cache and captured again.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from typing import Iterable, Sequence as Seq

import numpy as np
import torch
import torch.distributed as dist

from tidal.config_base import ConfigError
from tidal.engine import sizing
from tidal.engine.base import Completion, Request, SamplingParams, eos_ids, sequence_key
from tidal.engine.config import EngineConfig
from tidal.engine.native.block_manager import BlockManager
from tidal.engine.native.kernels import get_ops
from tidal.engine.native.model_runner import ModelRunner
from tidal.engine.native.models import build_model
from tidal.engine.native.parallel import TPGroup
from tidal.engine.native.scheduler import Scheduler
from tidal.engine.native.sequence import FINISH_REASONS, Sequence, SequenceTable
from tidal.engine.native.state_pool import StatePool
from tidal.engine.native.speculative import Speculator
from tidal.engine.native.window_blocks import WindowBlocks
from tidal.engine.sampler import request_key
from tidal.engine.stepping import run_steps
from tidal.host_memory import ParamHostCopy
from tidal.sampling_filter import SamplingFilter


TIMERS = ("schedule_s", "postprocess_s", "prepare_s", "submit_s", "wait_s")
# why a step was not scheduled ahead (``verify``: after a verify step; ``speculating``: the next step may draft)
AHEAD_OFF = ("waiting", "not_in_step", "blocks_short", "all_finish", "verify", "speculating")


def states_bytes(states: StatePool | None) -> int:
    return 0 if states is None else states.nbytes


class NativeEngine:
    """Implements :class:`tidal.engine.base.RolloutEngine` for Qwen2/Qwen2.5/Qwen3/Llama models, and
    Qwen2-VL/Qwen2.5-VL with image prompts (``generate(..., mm_inputs=...)``).

    ``stats`` counts, since construction: ``prefill_tokens`` (tokens whose KV was computed by
    prefill), ``prefix_hit_tokens`` (prompt tokens served from the prefix cache), ``preemptions``,
    ``decode_steps``, ``prefill_steps``, ``ahead_steps`` (steps scheduled ahead, prefill or decode),
    ``ahead_decode_steps`` (decode steps scheduled ahead), ``ahead_off_<reason>`` (steps after which
    the next could not be scheduled ahead: sequences ``waiting``, a running sequence ``not_in_step``,
    ``blocks_short``, ``all_finish``, ``verify``, ``speculating``; :meth:`overlap` turns them into
    fractions); and host
    wall seconds spent in ``schedule_s``, ``postprocess_s`` and the runner's ``prepare_s`` (inputs),
    ``submit_s`` (model + sampling enqueued) and ``wait_s`` (waiting for the sampled tokens); and the
    speculation counters ``spec_*`` (:class:`~tidal.engine.native.speculative.Speculator`); for MoE
    models ``moe_decode_steps`` and ``moe_experts_touched`` (the distinct experts of each decode step,
    summed over its MoE layers: :class:`~tidal.engine.native.moe.record.RoutingRecorder`).
    :meth:`host_ms_per_step` turns two snapshots of ``stats`` into milliseconds per step.

    ``policy_version``: stamped on every token sampled from now on (``Completion.versions``); set it
    after each weight sync. It changes only while no request is in flight.
    """

    def __init__(
        self,
        hf_config,
        cfg: EngineConfig,
        *,
        device: torch.device,
        dtype: torch.dtype,
        tp_group: dist.ProcessGroup | None = None,
        seq_len: int | None = None,
        exact: bool = False,
    ):
        """``seq_len``: the longest sequence (prompt + new tokens) the caller expects, which sizes the
        sliding-window layers' block pool of a model that has one (:func:`tidal.engine.sizing.window_pool_blocks`;
        None: as many blocks as the full layers' pool, or on CPU the requests' lengths). ``exact``:
        exact mode (``numerics.exact``, docs/exact.md): batch-invariant kernels
        (:mod:`tidal.engine.native.kernels.exact_ops`) instead of ``cfg.kernel_backend``'s, no CUDA graphs."""
        self.cfg = cfg
        self.seq_len = seq_len
        self.device = torch.device(device)
        self.dtype = dtype
        self.tp = TPGroup.of(tp_group)
        self.ops = get_ops("exact" if exact else cfg.kernel_backend, self.device)
        self.model = build_model(hf_config, self.tp, self.ops, self.device, dtype)
        self.linear_layers = self.model.linear_layers() if hasattr(self.model, "linear_layers") else []
        if self.linear_layers and cfg.speculative != "off":
            raise ConfigError("engine.speculative", f"{type(self.model).__name__} has linear-attention layers, whose "
                              "recurrent state cannot roll back rejected drafts: set engine.speculative: off")
        # the decode graphs have no state-slot input: a hybrid model decodes eagerly
        graph_safe = getattr(self.ops, "graph_safe", False) and not self.linear_layers
        graph_max_batch = sizing.graph_max_batch(cfg, self.device, graph_safe)
        self.runner = ModelRunner(self.model, self.tp, block_size=cfg.block_size, device=self.device,
                                  graph_max_batch=graph_max_batch, exact=exact)
        self.eos_token_ids = eos_ids(hf_config)
        self.table = SequenceTable(cfg.block_size)
        self.block_manager: BlockManager | None = None  # with the KV cache
        self.window_blocks: WindowBlocks | None = None  # with the KV cache, for a model with a window pool
        self.scheduler: Scheduler | None = None  # with the KV cache
        self.sleep_level = 0  # 0 awake; 1 KV freed; 2 KV freed and weights on the host
        self._host_weights = ParamHostCopy(pin=self.device.type == "cuda")  # the weights while asleep at level 2
        self._seq_ids = itertools.count()
        self._requests: dict = {}  # request id -> Sequence, unfinished ones
        self._pending = None  # (batch, handle) of the decode step scheduled ahead and in flight
        self._sampling: SamplingFilter | None = None  # of the requests in flight
        self._policy_version = 0
        # drafts and their index (host only; survives sleep and weight loads); auto speculates on accelerators only
        self.spec = Speculator(cfg.speculative, latency_bound=self.device.type != "cpu")
        self.stats = dict(prefill_tokens=0, prefix_hit_tokens=0, preemptions=0, decode_steps=0, prefill_steps=0,
                          ahead_steps=0, ahead_decode_steps=0, schedule_s=0.0, postprocess_s=0.0,
                          **{f"ahead_off_{r}": 0 for r in AHEAD_OFF})
        self.stats.update(self.runner.timings)
        self.stats.update(self.spec.stats)
        if self.runner.routing is not None:
            self.stats.update(self.runner.routing.stats)

    @classmethod
    def from_pretrained(cls, path: str, cfg: EngineConfig, *, device, dtype, tp_group=None) -> "NativeEngine":
        """Build from a local HF folder (``config.json`` + ``*.safetensors``); EOS ids of
        ``generation_config.json`` are added to the config's."""
        from safetensors import safe_open
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(path)
        engine = cls(hf_config, cfg, device=device, dtype=dtype, tp_group=tp_group)
        engine.eos_token_ids = eos_ids(hf_config, path)
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
    def _kv_blocks_wanted(self, lengths: list[int] | None) -> tuple[int, int]:
        """(full-layer, window-layer) blocks for a new KV cache (window: 0 without a window pool):
        ``kv_cache_max_tokens`` full-layer tokens when set; on CUDA the memory available now
        (:mod:`tidal.engine.sizing`); on CPU the sequences of full ``lengths`` that run together
        (without ``lengths``: ``max_num_seqs`` (or one) sequences of the model's full context). The
        window pool follows the full one for sequences of ``seq_len`` tokens (the longest of
        ``lengths`` when given)."""
        cfg, bs, window = self.cfg, self.cfg.block_size, self.runner.window
        seq_len = max(lengths) if lengths else self.seq_len
        mnbt = cfg.max_num_batched_tokens

        def with_window(full: int) -> tuple[int, int]:
            return full, 0 if window is None else sizing.window_pool_blocks(
                full, block_size=bs, window=window, seq_len=seq_len, max_num_batched_tokens=mnbt)

        if cfg.kv_cache_max_tokens > 0:
            return with_window(cfg.kv_cache_max_tokens // bs)
        if sizing.sized_by_memory(self.device):
            budget = sizing.kv_budget_bytes(cfg, sizing.available_device_bytes(self.device))
            return self.runner.blocks_for_bytes(budget, seq_len, mnbt)
        cap = sizing.max_running(cfg)
        if lengths is None:
            lengths = [self.model.max_positions] * (cap or 1)
        full = sizing.blocks_for_lengths(lengths, bs, cap)
        if window is None:
            return full, 0
        return full, sizing.window_blocks_for_lengths(lengths, full, block_size=bs, window=window, max_seqs=cap,
                                                      max_num_batched_tokens=mnbt)

    def _ensure_kv(self, lengths: list[int] | None = None) -> int:
        """Allocate the KV cache if absent; on CPU without a cap, regrow it (while idle) when the
        sequences of full ``lengths`` need more. Returns the bytes allocated."""
        grows = not sizing.sized_by_memory(self.device) and self.cfg.kv_cache_max_tokens == 0 and lengths is not None
        if self.runner.kv_layers:
            if not grows or not self._idle() or (self._kv_fits(lengths) and self._state_slots_fit(lengths)):
                return 0
            self._free_caches()
        states = self._allocate_states(lengths)
        need, need_window = self._kv_blocks_wanted(lengths)
        if need < 1:
            raise RuntimeError("no memory left for a single KV block")
        try:
            nbytes = self.runner.allocate_kv_cache(need, need_window)
        except torch.OutOfMemoryError:
            if self.device.type != "cuda":
                raise
            # the allocator's cached blocks counted as available but were fragmented: hand back what
            # it can and size again from what is really free
            torch.cuda.empty_cache()
            need, need_window = self._kv_blocks_wanted(lengths)
            if need < 1:
                raise RuntimeError("no memory left for a single KV block") from None
            nbytes = self.runner.allocate_kv_cache(need, need_window)
        # every TP rank must schedule alike: the ranks sized their caches from their own free memory,
        # so all use the smallest block counts (a larger cache leaves its last blocks unused)
        need = self.tp.min_int(need, self.device)
        self.block_manager = BlockManager(need, self.cfg.block_size, self.cfg.enable_prefix_caching)
        self.window_blocks = None
        if self.runner.window is not None:
            self.window_blocks = WindowBlocks(self.table, self.tp.min_int(need_window, self.device), self.cfg.block_size,
                                              self.runner.window, self.cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.table, self.block_manager, max_num_seqs=sizing.max_running(self.cfg),
                                   max_num_batched_tokens=self.cfg.max_num_batched_tokens, state_pool=states,
                                   window_blocks=self.window_blocks)
        if self.runner.routing is not None:
            self.scheduler.before_release = self._keep_routing
        return nbytes + states_bytes(states)

    def _kv_fits(self, lengths: list[int] | None) -> bool:
        """Whether the allocated cache has the blocks that sequences of full ``lengths`` want (CPU)."""
        want, want_window = self._kv_blocks_wanted(lengths)
        return self.runner.num_blocks >= want and self.runner.num_window_blocks >= want_window

    # ---- recurrent state (hybrid models) --------------------------------------------------------
    def _state_slots_wanted(self, lengths: list[int] | None) -> int:
        """Slots of the recurrent-state pool (:func:`tidal.engine.sizing.state_slots`): on CUDA from
        the memory available now, on CPU for the request's sequences."""
        available = sizing.available_device_bytes(self.device) if sizing.sized_by_memory(self.device) else None
        return sizing.state_slots(self.cfg, StatePool.bytes_per_slot(self.linear_layers), available,
                                  None if lengths is None else len(lengths))

    def _state_slots_fit(self, lengths: list[int] | None) -> bool:
        states = self.scheduler.states if self.scheduler is not None else None
        return states is None or states.num_slots >= self._state_slots_wanted(lengths)

    def _allocate_states(self, lengths: list[int] | None) -> StatePool | None:
        """The recurrent-state pool of a hybrid model, before the KV cache takes the memory left (None
        without linear-attention layers); the runner applies its copies before each step."""
        if not self.linear_layers:
            return None
        slots = self.tp.min_int(self._state_slots_wanted(lengths), self.device)
        self.runner.states = StatePool(self.linear_layers, slots, self.device)
        return self.runner.states

    def _free_caches(self) -> int:
        """Free the KV cache and the state pool; returns the bytes released."""
        freed = self.runner.free_kv_cache()
        if self.runner.states is not None:
            freed += self.runner.states.nbytes
            self.runner.states.release()
            self.runner.states = None
        return freed

    def _keep_routing(self, slots: np.ndarray) -> None:
        """MoE: the routing of every token the finishing sequences fed to the model, read through
        their blocks before they are released (``Completion.routed_experts``)."""
        t = self.table
        for s in slots.tolist():
            seq = t.seqs[s]
            seq.routed_experts = self.runner.routing.gather(t.blocks_of(s), int(t.num_cached[s]), int(t.num_tokens[s]) - 1)

    def sleep(self, level: int = 1) -> int:
        """Level 1: free the KV cache (prefix cache forgotten); the CUDA graphs are kept when the cache
        has fixed addresses, else freed too. Level 2: also move the weights to host memory (and drop
        the graphs, which point at them). Returns device bytes freed (0 for weights on a CPU engine).
        Refused while requests are in flight (``abort`` them first)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        self._require_idle("sleep()")
        freed = self._free_caches()
        self.block_manager = self.scheduler = self.window_blocks = None
        if level == 2 and self.sleep_level < 2 and self.device.type != "cpu":
            freed += self.runner.drop_graphs()
            # into one pinned host buffer of exactly the weights' size, made at the first such sleep and
            # reused by every later one (no new pinned memory per sleep)
            freed += self._host_weights.offload(self.model.named_parameters())
            torch.cuda.empty_cache()
        self.sleep_level = max(self.sleep_level, level)
        return freed

    def wake_up(self) -> int:
        """Restore the weights (if level 2) and allocate the KV cache, sized from the memory available
        now. Returns device bytes restored."""
        restored = self._restore_weights()
        self.sleep_level = 0
        return restored + self._ensure_kv()

    def _restore_weights(self) -> int:
        restored = 0
        if self._host_weights.holds:
            restored = self._host_weights.restore(self.model.named_parameters(), self.device)
            self.sleep_level = min(self.sleep_level, 1)
        return restored

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named full tensors into the weights in place (one tensor at a time, so the peak
        is one tensor). Forgets the prefix cache. Asleep at level 2, the weights come back to the
        device first (a staged wake-up: the KV cache stays freed until ``wake_up``). Refused while
        requests are in flight (``abort`` them, load, then resume them)."""
        self._require_idle("load_weights()")
        self._restore_weights()
        self.model.load_weights(named_tensors)
        if self.block_manager is not None:
            self.block_manager.reset_prefix_cache()
        if self.window_blocks is not None:
            self.window_blocks.reset_prefix_cache()
        if self.runner.states is not None:
            self.runner.states.clear_checkpoints()

    def verify_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """The HF names whose values in this engine differ from the given full tensors (on this TP
        rank's shard); empty when the engine holds exactly what it was sent."""
        return self.model.verify_weights(named_tensors)

    def memory_report(self) -> dict[str, int]:
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters() if p.numel())
        graphs = self.runner.graphs.bytes if self.runner.graphs is not None else 0
        report = {"weights": weights, "kv_cache": self.runner.kv_bytes, "graphs": graphs}
        if self.linear_layers:
            report["recurrent_state"] = states_bytes(self.runner.states)
        return report

    # ---- incremental requests -------------------------------------------------------------------
    @property
    def policy_version(self) -> int:
        return self._policy_version

    @policy_version.setter
    def policy_version(self, version: int) -> None:
        self._require_idle("setting policy_version")
        self._policy_version = int(version)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def _idle(self) -> bool:
        return not self._requests and self._pending is None

    def _require_idle(self, what: str) -> None:
        if self._requests:
            raise RuntimeError(f"{what} with {len(self._requests)} unfinished requests: abort() them first")

    def add(self, requests: Seq[Request]) -> None:
        """Queue ``requests`` (see :class:`~tidal.engine.base.IncrementalEngine`). All requests in
        flight sample from one distribution: the first request added to an idle engine sets its
        temperature, top-k, top-p and min-p (its :attr:`~tidal.engine.base.SamplingParams.filter`); a request with another distribution is refused until they
        finish. Its ``max_new_tokens``, stop tokens, ``ignore_eos`` and random stream are its own:
        the token at index ``i`` of its sequence is drawn with the uniform
        :func:`~tidal.engine.sampler.keyed_uniforms` of ``(params.seed, key, i)`` (``key``: the
        request's :attr:`~tidal.engine.base.Request.key`, else its id; see :func:`request_key`)
        (a seed drawn from torch's default generator when ``params.seed`` is None), whatever else is
        in flight. Nothing is added when any request is invalid."""
        mm = {}  # id(mm_inputs) -> MultimodalPrompt, shared by the requests that share the dict
        for r in requests:
            if r.mm_inputs is not None and id(r.mm_inputs) not in mm:
                mm[id(r.mm_inputs)] = self._multimodal(r.prompt_ids, r.mm_inputs, f"request {r.request_id!r}")
        self._add(requests, [mm.get(id(r.mm_inputs)) for r in requests])

    def _multimodal(self, prompt_ids: list[int], mm_inputs: dict, where: str):
        if not self.model.multimodal:
            raise ValueError(f"{where}: image inputs given to a text-only model ({type(self.model).__name__}: a "
                             "vision-language checkpoint of a text_only family trains and rolls out its text tower alone); "
                             "drop the images (data.image_key) or use a Qwen2-VL / Qwen2.5-VL model")
        return self.model.multimodal_prompt(prompt_ids, mm_inputs, where=where)

    def _add(self, requests: Seq[Request], mm: list) -> None:
        if self.sleep_level:
            raise RuntimeError("requests for a sleeping engine: call wake_up() first")
        if not requests:
            return
        max_pos = self.model.max_positions
        ids = set()
        for r in requests:
            n = len(r.prompt_ids) + len(r.token_ids)
            if n >= max_pos:
                raise ValueError(f"request {r.request_id!r}: {n} prompt and resumed tokens >= max_position_embeddings={max_pos}")
            if r.request_id in self._requests or r.request_id in ids:
                raise ValueError(f"request id {r.request_id!r} is already in flight")
            ids.add(r.request_id)
        sampling = self._sampling_for(requests)
        lengths = [min(len(r.prompt_ids) + r.params.max_new_tokens, max_pos) for r in requests]
        self._ensure_kv(lengths)
        for r, max_len in zip(requests, lengths):  # every request fits the cache: checked before any is queued
            self.scheduler.check_fits(len(r.prompt_ids), max_len, f"request {r.request_id!r}")
        self._sampling = sampling
        for r, m, max_len in zip(requests, mm, lengths):
            stop = frozenset(r.params.stop_token_ids) | (frozenset() if r.params.ignore_eos else frozenset(self.eos_token_ids))
            seq = Sequence(next(self._seq_ids), r.request_id, r.group_id, list(r.prompt_ids),
                           stop_set=self.scheduler.stop_set(stop), mm=m, old_logprobs=list(r.logprobs),
                           old_versions=list(r.versions), version=self._policy_version,
                           seed=self._seed(r.params.seed), key=request_key(r.request_id if r.key is None else r.key))
            slot = self.table.add(seq, list(r.prompt_ids) + list(r.token_ids), max_len)
            self.scheduler.add(slot)
            self.spec.add(seq)
            self._requests[r.request_id] = seq

    def _sampling_for(self, requests: Seq[Request]) -> SamplingFilter:
        key = requests[0].params.filter
        for r in requests:
            if r.params.filter != key:
                raise ValueError(f"request {r.request_id!r} samples with {r.params.filter}, others with {key}: "
                                 f"requests in flight share one distribution")
        if self._sampling is not None and self._requests:
            if self._sampling != key:
                raise ValueError(f"requests sampling with {key} while others in flight sample with {self._sampling}: "
                                 f"requests in flight share one distribution (finish or abort them first)")
        return key

    def step(self) -> list[Completion]:
        """Run one step (and schedule the next decode step ahead); returns the completions that
        finished in it, in the order they were added."""
        if not self._requests:
            return []
        stats, runner, sched = self.stats, self.runner, self.scheduler
        hits_before, preempted_before = self.block_manager.num_hit_tokens, sched.num_preemptions
        t0 = time.perf_counter()
        proposed = self._pending is None  # a decode batch scheduled now (not ahead) may carry drafts
        if proposed:
            batch = sched.schedule()
            if not batch.is_prefill:
                batch = sched.attach_drafts(batch, self.spec.propose(self.table, batch.rows), self.spec.policy.max_verify_rows())
            stats["schedule_s"] += time.perf_counter() - t0
            handle = runner.launch(batch, self.table, self._sampling)
            self._count(batch)
            t0 = time.perf_counter()
        else:
            batch, handle = self._pending
        # a step that may draft is scheduled now, not ahead (drafts need the tokens of the step before;
        # after a prefill the step ahead would be the first decode)
        overlap = self.cfg.overlap_scheduling and not self.spec.wants(self.table)
        ahead = sched.schedule_ahead(batch) if overlap else None
        stats["schedule_s"] += time.perf_counter() - t0
        self._pending = None
        if ahead is not None:
            self._pending = (ahead, runner.launch(ahead, self.table, self._sampling, prev=handle))
            self._count(ahead)
            stats["ahead_steps"] += 1
            stats["ahead_decode_steps"] += not ahead.is_prefill
        elif self.cfg.overlap_scheduling:
            stats[f"ahead_off_{sched.ahead_off if overlap else 'speculating'}"] += 1
        tokens, logprobs = runner.wait(handle)
        t0 = time.perf_counter()
        finished = sched.postprocess(batch, tokens, logprobs)
        if batch.draft_lens is not None:
            self.spec.observe(self.table, batch, tokens)
        elif proposed and not batch.is_prefill:
            self.spec.observe_plain(self.table, batch.rows, batch.gens)
        done = sorted((self._complete(s) for s in finished.tolist()), key=lambda c: c[0])
        if not self._requests and self._pending is not None:  # every row ahead is void
            runner.wait(self._pending[1])
            self._pending = None
        stats["prefix_hit_tokens"] += self.block_manager.num_hit_tokens - hits_before
        stats["preemptions"] += sched.num_preemptions - preempted_before
        stats["postprocess_s"] += time.perf_counter() - t0
        stats.update(runner.timings)
        stats.update(self.spec.stats)
        if runner.routing is not None:
            stats.update(runner.routing.stats)
        return [c for _, c in done]

    def _complete(self, slot: int) -> tuple[int, Completion]:
        """The completion of the finished (or aborted) sequence in ``slot``; frees the slot."""
        t, seq = self.table, self.table.seqs[slot]
        start = len(seq.prompt_ids) + seq.num_resumed
        new = int(t.num_tokens[slot]) - start
        completion = Completion(
            prompt_ids=seq.prompt_ids, token_ids=t.token_list(slot, len(seq.prompt_ids)),
            logprobs=seq.old_logprobs + t.logprobs[slot, start : start + new].tolist(),
            finish_reason=FINISH_REASONS[int(t.finish[slot])], request_id=seq.request_id, group_id=seq.group_id,
            versions=seq.old_versions + [seq.version] * new, routed_experts=seq.routed_experts,
        )
        del self._requests[seq.request_id]
        self.spec.finish(seq, t.tokens[slot, : t.num_tokens[slot]])
        t.release(slot)
        return seq.seq_id, completion

    def abort(self, request_ids: Iterable | None = None) -> list[Completion]:
        """Stop the given unfinished requests (all when None) and return their partial completions
        (``finish_reason="abort"``), in the order they were added. A step in flight is dropped (the
        sequences that go on compute its token again); unknown ids are ignored."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self.runner.wait(pending[1])
            self.scheduler.drop(pending[0])
        ids = list(self._requests) if request_ids is None else [i for i in request_ids if i in self._requests]
        if not ids:
            return []
        slots = np.array(sorted(self._requests[i].slot for i in ids), dtype=np.int64)
        self.scheduler.abort(slots)
        done = sorted((self._complete(s) for s in slots.tolist()), key=lambda c: c[0])
        return [c for _, c in done]

    def overlap(self, before: dict) -> dict[str, float]:
        """Since the ``stats`` snapshot ``before``: ``ahead_frac``, the decode steps scheduled ahead
        (their host work hidden behind the step before) over all decode steps, and ``off_<reason>``,
        the steps after which the next one was not, over all steps."""
        d = {k: self.stats[k] - before[k] for k in self.stats}
        steps = max(1, d["decode_steps"] + d["prefill_steps"])
        out = {"ahead_frac": d["ahead_decode_steps"] / max(1, d["decode_steps"])}
        out.update({f"off_{r}": d[f"ahead_off_{r}"] / steps for r in AHEAD_OFF})
        return out

    def host_ms_per_step(self, before: dict) -> dict[str, float]:
        """Host milliseconds per engine step of each timer (``schedule``, ``postprocess``,
        ``prepare``, ``submit``, ``wait``) since the ``stats`` snapshot ``before``, and ``steps``."""
        steps = sum(self.stats[k] - before[k] for k in ("decode_steps", "prefill_steps"))
        out = {k[:-2]: (self.stats[k] - before[k]) * 1e3 / max(1, steps) for k in TIMERS}
        out["steps"] = steps
        return out

    # ---- generation -----------------------------------------------------------------------------
    def generate(
        self, prompts: list[list[int]], params: SamplingParams, mm_inputs: list[dict | None] | None = None
    ) -> list[Completion]:
        """``params.n`` completions per prompt, prompt-major. Every TP rank must call with the same args.

        ``mm_inputs[i]``: the pixel inputs of prompt i's images (None for a text prompt; see
        :mod:`tidal.models.vision`), its ids already holding the placeholders. Vision-language models
        only (Qwen2-VL / Qwen2.5-VL); the images' features are computed once per prompt. Refused
        while incremental requests are in flight. Sample ``j`` of prompt ``i`` is request
        ``i * n + j`` of group ``i``, drawing from stream key ``sequence_key(i, j)``."""
        if self.sleep_level:
            raise RuntimeError("generate() on a sleeping engine: call wake_up() first")
        self._require_idle("generate()")
        if not prompts:
            return []
        if mm_inputs is not None and len(mm_inputs) != len(prompts):
            raise ValueError(f"generate: {len(mm_inputs)} mm_inputs for {len(prompts)} prompts")
        mm: list[dict | None] = [None] * len(prompts)
        for i, m in enumerate(mm_inputs or []):
            if m is not None:
                self._multimodal(prompts[i], m, f"prompt {i}")  # errors name the prompt, before anything is added
                mm[i] = dict(m)  # one dict per prompt: add() shares its image features among its n samples only
        one = dataclasses.replace(params, n=1)
        n = params.n
        requests = [Request(request_id=i * n + j, prompt_ids=p, params=one, group_id=i, mm_inputs=mm[i],
                            key=sequence_key(i, j))
                    for i, p in enumerate(prompts) for j in range(n)]
        out: list[Completion | None] = [None] * len(requests)
        for c in run_steps(self, requests).finished:
            out[c.request_id] = c
        return out

    def _count(self, batch) -> None:
        if batch.is_prefill:
            self.stats["prefill_tokens"] += batch.num_tokens
        else:
            self.spec.step += 1
        self.stats["prefill_steps" if batch.is_prefill else "decode_steps"] += 1

    def _seed(self, seed: int | None) -> int:
        """A request's stream seed (uint64): its own, or one drawn from torch's default generator
        (only TP rank 0 samples: the other ranks' draws are unused)."""
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        return int(seed) & (2**64 - 1)
