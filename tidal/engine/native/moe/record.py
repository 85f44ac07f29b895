"""The engine's record of which experts every computed token was routed to (for routing replay and
``moe/router_agreement`` in the trainer).

Two halves:

- :class:`RoutingSink` (device): during a forward each MoE block copies its ``experts_TK`` into
  column ``l`` (its MoE-layer ordinal) of ``buf`` ``[T, L, K]`` int16. The buffer is set by the model
  runner per step (a decode CUDA graph captures its own static one), so recording adds one small copy
  per layer and one device-to-host copy per step, and no host sync.
- :class:`RoutingStore` (host): the routing of a token is kept where its KV is, by KV-cache slot
  (``block * block_size + offset``), ``[num_slots, L, K]`` int16, ``-1`` where nothing was written. A
  prefix-cache hit reuses the blocks of the sequence that computed them, and with them their routing;
  a recomputed token (preemption, a resumed request) overwrites its slot. Steps write in launch order,
  as the device writes the KV, so the store always describes the tokens in the cache. When a sequence
  finishes, :meth:`RoutingStore.gather` reads its positions through its block table.

Completion layout (``Completion.routed_experts``): int16 ``[P + G - 1, L, K]`` for a completion of
``P`` prompt and ``G`` generated tokens: the experts of every token the engine fed to the model (all
but the last sampled token), per MoE layer in layer order, as the router ranked them.
"""

from __future__ import annotations

import numpy as np
import torch

NOT_ROUTED = -1


class RoutingSink:
    """Where the MoE blocks of the current forward write their choice (``buf`` None: not recording)."""

    def __init__(self, num_layers: int, top_k: int, num_experts: int):
        self.num_layers, self.top_k, self.num_experts = num_layers, top_k, num_experts
        self.buf: torch.Tensor | None = None

    def new_buffer(self, num_tokens: int, device: torch.device) -> torch.Tensor:
        return torch.empty(num_tokens, self.num_layers, self.top_k, dtype=torch.int16, device=device)

    def write(self, layer: int, experts_TK: torch.Tensor) -> None:
        if self.buf is not None:
            self.buf[: experts_TK.shape[0], layer].copy_(experts_TK)


class RoutingStore:
    """Host routing of every KV-cache slot (see the module docstring)."""

    def __init__(self, num_slots: int, num_layers: int, top_k: int, block_size: int):
        self.block_size = block_size
        self.slots_SLK = np.full((num_slots, num_layers, top_k), NOT_ROUTED, dtype=np.int16)

    def write(self, slots_T: np.ndarray, experts_TLK: np.ndarray) -> None:
        self.slots_SLK[slots_T] = experts_TLK

    def gather(self, blocks: np.ndarray, num_tokens: int) -> np.ndarray:
        """``[num_tokens, L, K]``: positions ``0..num_tokens-1`` of a sequence with KV blocks ``blocks``."""
        pos = np.arange(num_tokens)
        return self.slots_SLK[blocks[pos // self.block_size].astype(np.int64) * self.block_size + pos % self.block_size]


class RoutingRecorder:
    """The model runner's side of the record: a buffer for each eager forward, the copy of a step's
    routing to the host (started right after the forward, on the step's stream, so it is done when the
    step's samples are), and the store write when the runner waits for the step.

    ``stats``: ``moe_decode_steps`` and ``moe_experts_touched``, the distinct experts each decode step's
    rows routed to, summed over the MoE layers and the steps (the experts whose weights a decode step
    reads: the bench's decode floor, :mod:`bench.grpo.bounds`)."""

    def __init__(self, sink: RoutingSink, block_size: int, device: torch.device):
        self.sink, self.block_size, self.device = sink, block_size, device
        self.store: RoutingStore | None = None
        self.stats = {"moe_decode_steps": 0, "moe_experts_touched": 0}

    def resize(self, num_slots: int) -> None:
        """A store for ``num_slots`` KV slots (a new KV cache); the same store when the size is the same
        (each wake-up: every slot is written again before a finished sequence reads it, since the
        prefix cache went with the old KV)."""
        if self.store is None or self.store.slots_SLK.shape[0] != num_slots:
            self.store = RoutingStore(num_slots, self.sink.num_layers, self.sink.top_k, self.block_size)

    def eager_buffer(self, num_tokens: int) -> torch.Tensor:
        """Point the sink at a fresh ``[num_tokens, L, K]`` buffer for the next eager forward."""
        self.sink.buf = self.sink.new_buffer(num_tokens, self.device)
        return self.sink.buf

    def copy_out(self, buf_TLK: torch.Tensor, slots_T: np.ndarray, decode: bool) -> tuple:
        """Start copying the first ``len(slots_T)`` rows of ``buf_TLK`` to the host; the sink stops
        recording. Returns what :meth:`commit` takes once the step is done (``decode``: a decode step,
        counted in ``stats``)."""
        self.sink.buf = None
        rows = buf_TLK[: len(slots_T)]
        if self.device.type != "cuda":
            return rows.cpu(), slots_T, decode
        host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
        host.copy_(rows, non_blocking=True)
        return host, slots_T, decode

    def commit(self, pending: tuple) -> None:
        host, slots_T, decode = pending
        experts_TLK = host.numpy()
        self.store.write(slots_T, experts_TLK)
        if decode:
            hit_LE = np.zeros((self.sink.num_layers, self.sink.num_experts), dtype=bool)
            hit_LE[np.arange(self.sink.num_layers)[None, :, None], experts_TLK] = True
            self.stats["moe_decode_steps"] += 1
            self.stats["moe_experts_touched"] += int(hit_LE.sum())

    def gather(self, blocks: np.ndarray, num_computed: int, num_fed: int) -> np.ndarray:
        """A finished sequence's ``[num_fed, L, K]`` routing (``NOT_ROUTED`` past ``num_computed``)."""
        out = np.full((num_fed, self.sink.num_layers, self.sink.top_k), NOT_ROUTED, dtype=np.int16)
        n = min(num_computed, num_fed)
        out[:n] = self.store.gather(blocks, n)
        return out
