"""Where local reward models live between scoring calls.

The reward layer never moves models itself: it asks a :class:`ModelPlacement`, which the training
strategy provides (so FSDP2, DeepSpeed or a single process each place frozen models their own way).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class ModelPlacement(Protocol):
    """What the reward layer needs from the strategy for a frozen model.

    prepare_frozen(model) -> model: called once after loading (on CPU); returns the model to use
        (eval mode, no grads; possibly wrapped). Its result is what reload/offload receive.
    reload_model(model): put the model where it computes (its device) before a scoring call.
    offload_model(model): release its device memory after the call.

    Reward scoring calls these the same number of times on every rank for every ``score`` call,
    so an implementation may use collectives if the model is sharded.
    """

    def prepare_frozen(self, model: torch.nn.Module) -> torch.nn.Module: ...

    def reload_model(self, model: torch.nn.Module) -> None: ...

    def offload_model(self, model: torch.nn.Module) -> None: ...


class LocalPlacement:
    """Single-process placement: the model computes on ``device`` and waits on the CPU between
    calls (``offload=False`` keeps it on ``device``, e.g. in a dedicated reward server)."""

    def __init__(self, device: torch.device | str, *, offload: bool = True):
        self.device = torch.device(device)
        self.offload = offload

    def prepare_frozen(self, model: torch.nn.Module) -> torch.nn.Module:
        model.eval()
        model.requires_grad_(False)
        if not self.offload:
            model.to(self.device)
        return model

    def reload_model(self, model: torch.nn.Module) -> None:
        model.to(self.device)

    def offload_model(self, model: torch.nn.Module) -> None:
        if not self.offload or self.device.type == "cpu":
            return
        model.to("cpu")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # give the freed blocks back for the engine's KV cache
