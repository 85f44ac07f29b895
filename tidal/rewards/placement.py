"""Where local reward models live between scoring calls.

The reward layer never moves models itself: it asks a :class:`ModelPlacement`. A training strategy
(:class:`tidal.strategy.base.Strategy`) is one: pass it as ``RewardEngine(..., placement=strategy)``
so that FSDP2, DeepSpeed or a single process place frozen models their own way.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class ModelPlacement(Protocol):
    """What the reward layer needs for a frozen model.

    prepare_frozen(model, offload=...) -> model: called once after loading (model on CPU); returns
        the model to use (eval mode, no grads; possibly sharded/wrapped), offloaded if asked. Its
        result is what reload/offload receive.
    reload_model(model): put the model where it computes before a scoring call.
    offload_model(model): release its device memory after the call.

    Reward scoring makes these calls, and the model's forward passes, the same number of times on
    every rank for equal batch sizes, so an implementation may shard the model (collectives).
    """

    def prepare_frozen(self, model: torch.nn.Module, *, offload: bool) -> torch.nn.Module: ...

    def reload_model(self, model: torch.nn.Module) -> None: ...

    def offload_model(self, model: torch.nn.Module) -> None: ...


class LocalPlacement:
    """Single-process placement: the model computes on ``device``; offloaded means on the CPU."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)

    def prepare_frozen(self, model: torch.nn.Module, *, offload: bool) -> torch.nn.Module:
        model.eval()
        model.requires_grad_(False)
        if not offload:
            model.to(self.device)
        return model

    def reload_model(self, model: torch.nn.Module) -> None:
        model.to(self.device)

    def offload_model(self, model: torch.nn.Module) -> None:
        if self.device.type == "cpu":
            return
        model.to("cpu")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # give the freed blocks back (e.g. to the engine's KV cache)
