"""The run's performance metrics, one owner: model FLOPs utilisation of the train phase, where the
update's time goes (forward / backward / optimizer / offload transfers) and what ``torch.compile``
costs.

Per iteration the trainer calls :meth:`PerfMeter.pop` once, after the train phase, with the
experience it trained on and the phase's seconds. FLOPs count real tokens only (packed training has
no padding to count), for the actor and the critic; ``perf/mfu`` is against the bf16 matmul ceiling
measured once on this device at start-up (CUDA only: on the CPU only ``perf/train_tflops`` is
reported). Values are this rank's (every rank does an equal share of the update's work).
"""

from __future__ import annotations

import dataclasses

import torch

from tidal.logging.compile import CompileMonitor
from tidal.logging.timer import PhaseTimer
from tidal.logging.update_split import UpdateSplit, train_perf
from tidal.models.flops import FlopModel, measure_matmul_peak
from tidal.strategy.compile_cache import resolve_compile_cache_dir
from tidal.trainer.colocation import Models


def hf_config_of(model: torch.nn.Module):
    """The Hugging Face config behind a trained or frozen model (a DeepSpeed engine's module, a PEFT
    model's base)."""
    inner = getattr(model, "module", model)  # DeepSpeed wraps; its own .config is the DS config
    return inner.config


def flop_model_of(model: torch.nn.Module, *, critic: bool = False) -> FlopModel | None:
    """The model's :class:`FlopModel` (a critic's head is one value per token, not the vocabulary);
    None for architectures whose FLOPs are not counted (mixture-of-experts)."""
    config = hf_config_of(model)
    try:
        fm = FlopModel.from_config(config)
    except NotImplementedError:
        return None
    if critic:
        text = getattr(config, "text_config", None) or config
        fm = dataclasses.replace(fm, head_params=int(text.hidden_size))
    return fm


class PerfMeter:
    """Owner of the ``perf/*`` and compile metrics (see the module docstring). ``compiles``: whether
    the strategy compiles layers (then compilations are timed, announced and counted; the cache
    directory named is ``compile_cache_dir``'s). ``split`` is given to the Updater, which marks its
    parts; it observes ``timer`` for transfers inside the train phase."""

    def __init__(self, *, models: Models, timer: PhaseTimer, device: torch.device, compiles: bool,
                 compile_cache_dir: str, is_main: bool, epochs: int):
        self.epochs = epochs
        self.actor_flops = flop_model_of(models.actor.model)
        self.has_critic = models.critic is not None
        self.critic_flops = flop_model_of(models.critic.model, critic=True) if self.has_critic else None
        self.peak = measure_matmul_peak(device) if device.type == "cuda" else None
        self.split = UpdateSplit(device)
        timer.add_observer(self.split)
        self.compile = None
        if compiles:
            notify = (lambda msg: print(msg, flush=True)) if is_main else (lambda msg: None)
            self.compile = CompileMonitor(notify, cache_dir=resolve_compile_cache_dir(compile_cache_dir)).install()

    def train_flops(self, seq_lens: list[int]) -> float | None:
        """Model FLOPs of the train phase over sequences of ``seq_lens`` real tokens (every epoch, actor
        and critic); None when a model's FLOPs are not counted."""
        if self.actor_flops is None or (self.has_critic and self.critic_flops is None):
            return None
        flops = self.actor_flops.train_flops(seq_lens)
        if self.critic_flops is not None:
            flops += self.critic_flops.train_flops(seq_lens)
        return self.epochs * flops

    def pop(self, seq_lens: list[int], train_seconds: float) -> dict[str, float]:
        """This iteration's ``perf/*`` (update split, train TFLOP/s and MFU) and compile metrics."""
        out = self.split.pop()
        flops = self.train_flops(seq_lens)
        if flops is not None:
            out.update(train_perf(flops, train_seconds, self.peak))
        if self.compile is not None:
            out.update(self.compile.pop())
        return out

    def close(self) -> None:
        if self.compile is not None:
            self.compile.remove()
