"""Weight sync: the actor's current weights into the rollout engine (spec §6).

``update_engine_weights`` asks the training backend for the actor's full weights under their
Hugging Face names (``Strategy.full_weights``: FSDP2 gathers DTensor shards, DeepSpeed ZeRO gathers
partitions, a LoRA actor's adapters are merged) and copies them into the engine in buckets
(``RolloutEngine.load_weights``), in place. It is a collective on every rank (every rank gathers;
every engine rank loads its shard). It never wakes the engine's KV cache: an engine asleep at level 2
brings its weights back itself when loading. The phase owner
(:class:`tidal.trainer.colocation.Colocation`) is its caller in training.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Protocol

import torch

from tidal.engine.base import RolloutEngine

DEFAULT_BUCKET_BYTES = 256 << 20


class WeightSource(Protocol):
    """What weight sync needs of a training backend (a :class:`tidal.strategy.base.Strategy`)."""

    device: torch.device

    def full_weights(self, model: torch.nn.Module, dtype: torch.dtype) -> Iterable[tuple[str, torch.Tensor]]: ...


def update_engine_weights(
    strategy: WeightSource, actor: torch.nn.Module, engine: RolloutEngine, *, dtype: torch.dtype,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> int:
    """Copy ``actor``'s full weights, cast to ``dtype``, into ``engine`` in buckets of about
    ``bucket_bytes``. Returns the bytes sent. The device is synchronised before returning, so the
    engine's next step sees the new weights and the gathered buffers can be reused."""
    sent = 0
    for bucket in buckets(strategy.full_weights(actor, dtype), bucket_bytes):
        engine.load_weights(bucket)
        sent += sum(t.numel() * t.element_size() for _, t in bucket)
    if strategy.device.type == "cuda":
        torch.cuda.synchronize(strategy.device)
    return sent


def buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive (name, tensor) lists of at least ``bucket_bytes`` each (the last may be smaller)."""
    bucket, size = [], 0
    for name, t in named:
        bucket.append((name, t))
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket
