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
# the metrics that compare the trainer's logprobs of the sampled tokens with the engine's
MISMATCH_METRICS = ("mismatch/abs_logp_diff_mean", "actor/mismatch_abs_logp_diff")


class WeightSyncError(RuntimeError):
    """The engine does not hold the weights it was sent (verification) or generates far from the
    trainer's policy (the mismatch alarm with ``sync.on_alarm: stop``)."""


class WeightSource(Protocol):
    """What weight sync needs of a training backend (a :class:`tidal.strategy.base.Strategy`)."""

    device: torch.device

    def full_weights(self, model: torch.nn.Module, dtype: torch.dtype) -> Iterable[tuple[str, torch.Tensor]]: ...


def update_engine_weights(
    strategy: WeightSource, actor: torch.nn.Module, engine: RolloutEngine, *, dtype: torch.dtype,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES, verify: bool = False,
) -> int:
    """Copy ``actor``'s full weights, cast to ``dtype``, into ``engine`` in buckets of about
    ``bucket_bytes``. Returns the bytes sent. The device is synchronised before returning, so the
    engine's next step sees the new weights and the gathered buffers can be reused.

    ``verify``: after loading each bucket, the engine compares what it now holds with what it was
    sent (``engine.verify_weights(bucket)``, where it has one) and a difference raises
    :class:`WeightSyncError` naming the weights: weights never go silently stale."""
    sent = 0
    check = getattr(engine, "verify_weights", None) if verify else None
    for bucket in buckets(strategy.full_weights(actor, dtype), bucket_bytes):
        engine.load_weights(bucket)
        if check is not None and (stale := check(bucket)):
            raise WeightSyncError(
                f"after update_engine_weights the engine does not hold {len(stale)} of the weights it was sent "
                f"({', '.join(stale[:5])}{', ...' if len(stale) > 5 else ''}): it would generate with stale weights"
            )
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


def mismatch_alarm(metrics: dict[str, float], max_logp_diff: float) -> str | None:
    """A message when the step's rollout/trainer logprob difference exceeds ``max_logp_diff`` (0:
    never), else None."""
    if max_logp_diff <= 0:
        return None
    for key in MISMATCH_METRICS:
        value = metrics.get(key)
        if value is not None and value > max_logp_diff:
            return (f"{key} = {value:.3g} > sync.max_logp_diff = {max_logp_diff:g}: the engine samples from a policy far "
                    "from the trainer's (stale or wrong weights, or a numerics problem)")
    return None
