"""The recurrent-state slot pool: the fixed-size per-sequence state of a hybrid model's linear-attention
layers (per layer a short-conv state ``[C, K - 1]`` and a delta-rule state ``[Hv, dk, dv]``), in
``num_slots`` slots allocated with the KV cache (sized by the engine's memory, freed by ``sleep``).

Unlike KV, a recurrent state is one value per sequence at one position: it cannot be shared by
prefix, only copied. So:

- **admit**: a sequence that starts (or re-prefills after a preemption) takes a free slot, zeroed or
  copied from a *checkpoint* before the step that first computes it;
- **free**: a finished or preempted sequence gives its slot back (a resumed one re-prefills, from a
  checkpoint when one matches);
- **checkpoints** make prefix sharing exact: the state of a sequence at a block boundary, copied into
  a slot of its own and found by the block hash of the prefix it covers (the hashes of
  :mod:`~tidal.engine.native.block_manager`). A new sequence whose cached KV prefix ends at such a
  boundary copies the checkpoint and computes the rest; prefix hits past the last checkpointed
  boundary are not taken. The scheduler saves one when a prefill chunk ends at a block boundary
  that others will ask for (the n samples of a GRPO prompt: the first prefills up to the last
  boundary before its last token, the others fork from there: KV blocks shared as before, the
  state copied to each sample's slot). Checkpoints are a cache: the least recently used one is
  dropped when a slot is needed.

Copies are queued as (source slot or -1 for zeros, destination slot) and run on the device by
:meth:`apply` at the start of the next step's forward, so they happen in stream order between the
step that computed a state and the step that reads it. A checkpoint saved by the step being
scheduled becomes visible at the next :meth:`begin_step` (its copy is then queued before any copy
out of it). Pure bookkeeping but for :meth:`apply`: identical calls give identical slots on every
TP rank.
"""

from __future__ import annotations

import collections

import numpy as np
import torch


class StatePool:
    """``layers``: the model's linear-attention layers (``state_shapes()`` and ``conv_state`` /
    ``ssm_state`` attributes, pointed at this pool's tensors). Every state is float32 (the
    delta-rule state accumulates in it; the short-conv state holds model-dtype inputs, exactly)."""

    def __init__(self, layers: list, num_slots: int, device: torch.device):
        if num_slots < 1:
            raise ValueError(f"a state pool needs at least one slot, got {num_slots}")
        self.layers, self.num_slots = layers, num_slots
        self.conv, self.ssm = [], []
        for layer in layers:
            conv_shape, ssm_shape = layer.state_shapes()
            layer.conv_state = torch.zeros((num_slots, *conv_shape), dtype=torch.float32, device=device)
            layer.ssm_state = torch.zeros((num_slots, *ssm_shape), dtype=torch.float32, device=device)
            self.conv.append(layer.conv_state)
            self.ssm.append(layer.ssm_state)
        self.device = device
        self._free = list(range(num_slots))[::-1]  # a stack: lowest slot first
        self.slot_of: dict[int, int] = {}  # sequence (table slot) -> its state slot
        self.checkpoints: collections.OrderedDict[int, int] = collections.OrderedDict()  # block hash -> slot, LRU first
        # checkpoints saved by the step being scheduled: [hash or None, source slot, checkpoint slot, (seq, boundary)]
        self._deferred: list[list] = []
        self._unbound: dict[tuple[int, int], int] = {}  # (seq, boundary) -> checkpoint slot whose hash is not known yet
        self._expiring: dict[tuple[int, int], int] = {}  # the same, one step older: freed at the next begin_step
        self._copies: list[tuple[int, int]] = []  # (source or -1, destination) for the next forward
        self._busy: set[int] = set()  # checkpoint slots read or written by the step being scheduled

    @staticmethod
    def bytes_per_slot(layers: list) -> int:
        """Device bytes of one sequence's state over ``layers`` (this TP rank's share)."""
        return sum(4 * int(np.prod(shape)) for layer in layers for shape in layer.state_shapes())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.conv + self.ssm)

    def release(self) -> None:
        """Point the layers at empty tensors (the pool's memory goes with this object)."""
        for layer in self.layers:
            layer.conv_state = layer.ssm_state = torch.empty(0)
        self.conv, self.ssm = [], []

    # ---- sequences ------------------------------------------------------------------------------
    def can_admit(self) -> bool:
        """Whether a sequence can take a slot now (a free one, or an unused checkpoint's)."""
        return bool(self._free) or any(s not in self._busy for s in self.checkpoints.values())

    def admit(self, seq: int, checkpoint: int | None = None) -> None:
        """Give sequence ``seq`` a slot holding zeros, or a copy of the checkpoint slot ``checkpoint``
        (from :meth:`lookup`), before the next forward. Call :meth:`can_admit` first."""
        if seq in self.slot_of:
            raise RuntimeError(f"sequence in slot {seq} already holds a state slot")
        slot = self._take()
        self.slot_of[seq] = slot
        self._copies.append((-1 if checkpoint is None else checkpoint, slot))

    def free(self, seq: int) -> None:
        """Give back ``seq``'s slot (no-op for a sequence that holds none)."""
        slot = self.slot_of.pop(seq, None)
        if slot is not None:
            self._free.append(slot)

    def slots(self, seqs: np.ndarray) -> np.ndarray:
        """The state slots of sequences ``seqs`` (int64)."""
        return np.fromiter((self.slot_of[s] for s in seqs.tolist()), dtype=np.int64, count=len(seqs))

    # ---- checkpoints ----------------------------------------------------------------------------
    def lookup(self, hashes: list[int]) -> tuple[int, int | None]:
        """(k, checkpoint slot): the most leading blocks ``k`` of a prefix with block hashes
        ``hashes`` whose boundary has a checkpoint (k = 0, None: none)."""
        for k in range(len(hashes), 0, -1):
            slot = self.checkpoints.get(hashes[k - 1])
            if slot is not None:
                self.checkpoints.move_to_end(hashes[k - 1])
                self._busy.add(slot)
                return k, slot
        return 0, None

    def save(self, seq: int, block_hash: int | None, boundary: int = 0) -> None:
        """Checkpoint ``seq``'s state as the step being scheduled leaves it (at token ``boundary``, a
        block boundary), under ``block_hash``, the hash of the block it ends at; None: not known yet
        (a decode step's last token), given by :meth:`bind` once the step is done. Visible from the
        next :meth:`begin_step` after both. Skipped when no slot can be had or the hash is already
        checkpointed."""
        if block_hash is not None and (block_hash in self.checkpoints or self.pending(block_hash)):
            return
        if not self._free and not self._evictable():
            return
        slot = self._take()
        self._busy.add(slot)
        self._deferred.append([block_hash, self.slot_of[seq], slot, (seq, boundary)])

    def bind(self, seq: int, boundary: int, block_hash: int) -> None:
        """The hash of the block that ``seq``'s checkpoint at ``boundary`` ends at (its step is done;
        no-op when no such checkpoint was saved)."""
        for entry in self._deferred:
            if entry[3] == (seq, boundary) and entry[0] is None:
                entry[0] = block_hash
                return
        slot = self._unbound.pop((seq, boundary), None)
        if slot is None:
            slot = self._expiring.pop((seq, boundary), None)
        if slot is None:
            return
        if block_hash in self.checkpoints:
            self._free.append(slot)
        else:
            self.checkpoints[block_hash] = slot

    def pending(self, block_hash: int) -> bool:
        """Whether the step being scheduled checkpoints ``block_hash`` (usable from the next step)."""
        return any(entry[0] == block_hash for entry in self._deferred)

    def begin_step(self) -> None:
        """A new step is being scheduled: the checkpoints saved by the last one are queued (their
        copies before any copy this step makes) and become visible to :meth:`lookup`."""
        self._busy.clear()
        # a decode checkpoint is bound when its step is postprocessed, before the step after next
        # is scheduled; one still unbound then belonged to a row that had finished: dropped
        self._free.extend(self._expiring.values())
        self._expiring, self._unbound = self._unbound, {}
        for block_hash, src, slot, key in self._deferred:
            self._copies.append((src, slot))
            self._busy.add(slot)
            if block_hash is None:
                self._unbound[key] = slot
            elif block_hash in self.checkpoints:
                self._free.append(slot)  # saved twice in one step (two forks of one prefix): keep the first
            else:
                self.checkpoints[block_hash] = slot
        self._deferred.clear()

    def clear_checkpoints(self) -> None:
        """Forget every checkpoint (the weights changed)."""
        self._free.extend(self.checkpoints.values())
        self.checkpoints.clear()

    def _evictable(self) -> list[int]:
        return [h for h, s in self.checkpoints.items() if s not in self._busy]

    def _take(self) -> int:
        if self._free:
            return self._free.pop()
        for h, slot in self.checkpoints.items():  # least recently used first
            if slot not in self._busy:
                del self.checkpoints[h]
                return slot
        raise RuntimeError("no state slot free")

    # ---- device ---------------------------------------------------------------------------------
    def apply(self) -> None:
        """Run the queued copies (in order) on the device."""
        if not self._copies:
            return
        copies, self._copies = self._copies, []
        # consecutive copies with no destination read later in the group go together
        for src, dst in _groups(copies):
            d = torch.as_tensor(dst, device=self.device)
            zero = [i for i, s in enumerate(src) if s < 0]
            for t in self.conv + self.ssm:
                if len(zero) == len(src):
                    t[d] = 0
                elif not zero:
                    t[d] = t[torch.as_tensor(src, device=self.device)]
                else:
                    for s, k in zip(src, dst):
                        t[k] = 0 if s < 0 else t[s]


def _groups(copies: list[tuple[int, int]]):
    """Split ``copies`` into runs that may run as one gather/scatter: no copy reads or writes a
    slot an earlier copy of its run writes (a gather reads before its scatter writes)."""
    src, dst, written = [], [], set()
    for s, d in copies:
        if s in written or d in written:
            yield src, dst
            src, dst, written = [], [], set()
        src.append(s)
        dst.append(d)
        written.add(d)
    if src:
        yield src, dst
