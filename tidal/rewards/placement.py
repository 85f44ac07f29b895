"""Where local reward models live between scoring calls.

The reward layer never moves models itself: it asks a :class:`ModelPlacement`. In training that is
the phase owner (:class:`tidal.trainer.colocation.Colocation`), so that FSDP2, DeepSpeed or a single
process place frozen models their own way and the reward-model forward is one more phase of the
GPU; a standalone reward server uses :class:`LocalPlacement`.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager, Protocol, runtime_checkable

import torch


@runtime_checkable
class ModelPlacement(Protocol):
    """What the reward layer needs for a frozen model.

    prepare_frozen(model, resident=...) -> model: called once after loading (model on CPU); returns
        the model to use (eval mode, no grads; possibly sharded/wrapped). ``resident``: it stays on
        its device between calls; otherwise it waits off the device.
    using(model): a context manager around a scoring call; the model is on its device inside and
        back at rest after it (also when the block raises).

    Reward scoring makes these calls, and the model's forward passes, the same number of times on
    every rank for equal batch sizes, so an implementation may shard the model (collectives).
    """

    def prepare_frozen(self, model: torch.nn.Module, *, resident: bool) -> torch.nn.Module: ...

    def using(self, model: torch.nn.Module) -> ContextManager[torch.nn.Module]: ...


class LocalPlacement:
    """Single-process placement: the model computes on ``device``; a non-resident model waits on the CPU."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._resident: set[int] = set()

    def prepare_frozen(self, model: torch.nn.Module, *, resident: bool) -> torch.nn.Module:
        model.eval()
        model.requires_grad_(False)
        if resident:
            self._resident.add(id(model))
            model.to(self.device)
        return model

    @contextlib.contextmanager
    def using(self, model: torch.nn.Module):
        away = id(model) not in self._resident and self.device.type != "cpu"
        if away:
            model.to(self.device)
        try:
            yield model
        finally:
            if away:
                model.to("cpu")
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()  # give the freed blocks back (e.g. to the engine's KV cache)
