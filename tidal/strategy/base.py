"""The Strategy contract (spec §3): one interface over training backends (FSDP2, DeepSpeed).

The trainer never branches on the backend. A Strategy owns the training backend's concerns: how
models are sharded (``prepare_trainable`` / ``prepare_frozen``), backward with gradient scaling,
the optimizer step with clipping and the LR schedule, moving models and optimizer state between
the device and host memory (``offload_model``/``reload_model``, ``offload_optimizer``/
``reload_optimizer``: mechanisms; *when* they run is decided by the phase owner,
:class:`tidal.trainer.colocation.Colocation`), the actor's full weights under HF names
(``full_weights``, read by weight sync and export) and checkpoint state. It does not know the
rollout engine, what a reward is or how advantages are computed.

Gradient contract: the trainer passes loss *shares* whose sum over all micro-batches and all ranks
is the global-batch loss. Backends average gradients over data-parallel ranks, so ``backward``
multiplies by the DP world size to turn that average back into the sum.
"""

from __future__ import annotations

import abc
import dataclasses
import itertools
import math
from typing import Any, Iterator

import torch

from tidal.distributed.runtime import Runtime
from tidal.dtypes import resolve_dtype
from tidal.strategy.resident import device_bytes, optimizer_state_tensors
from tidal.strategy.config import OptimConfig, StrategyConfig


@dataclasses.dataclass(kw_only=True)
class TrainState:
    """A trained model with its optimizer and LR scheduler. ``offloaded`` tracks the optimizer state."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    max_grad_norm: float
    optimizer_offloaded: bool = False


def lr_lambda(optim: OptimConfig, total_steps: int):
    """Multiplier of the peak LR at optimizer step ``s`` (warmup, then constant/cosine/linear decay)."""

    def fn(step: int) -> float:
        if optim.warmup_steps and step < optim.warmup_steps:
            return (step + 1) / optim.warmup_steps
        if optim.scheduler == "constant":
            return 1.0
        span = max(1, total_steps - optim.warmup_steps)
        progress = min(1.0, (step - optim.warmup_steps) / span)
        floor = optim.min_lr_ratio
        if optim.scheduler == "cosine":
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
        return floor + (1 - floor) * (1 - progress)

    return fn


def apply_optim_settings(state: TrainState, optim: OptimConfig, *, lr: float) -> None:
    """After a checkpoint's optimizer and schedule state was loaded into ``state``: this run's peak
    ``lr`` (``optim.lr`` or ``optim.critic_lr``), ``optim.betas`` and ``optim.eps`` take over from the
    saved ones, and the schedule's current LR is recomputed at the loaded step (the schedule's shape
    is already this run's: its function is built from the config, never loaded). With unchanged
    settings the state stays exactly as loaded (the same float expression as the schedule's)."""
    sched = state.scheduler
    groups = sched.optimizer.param_groups
    sched.base_lrs = [lr] * len(groups)
    now = [lr * fn(sched.last_epoch) for fn in sched.lr_lambdas]
    for group, value in zip(groups, now):
        group.update(initial_lr=lr, lr=value)
        if "betas" in group:
            group["betas"] = tuple(optim.betas)
        if "eps" in group:
            group["eps"] = optim.eps
    sched._last_lr = now


class Strategy(abc.ABC):
    reshards_checkpoints = True
    """Whether :meth:`state_dict`'s checkpoints load on another number of ranks (DCP resharding);
    a backend whose saved state is per rank says False (:func:`tidal.run.resume.check_world_change`)."""

    def __init__(self, cfg: StrategyConfig, runtime: Runtime):
        if cfg.offload_optimizer == "auto":  # no memory plan decided it (a Strategy built directly): off
            cfg = dataclasses.replace(cfg, offload_optimizer=False)
        self.cfg = cfg
        """``strategy.*`` as this Strategy uses it: ``offload_optimizer`` is a bool (the memory
        plan's decision, :meth:`tidal.memory.plan.MemorySettings.strategy_config`)."""
        self.runtime = runtime
        self.param_dtype = resolve_dtype(cfg.param_dtype, runtime.device)
        """Compute dtype of sharded models (``strategy.param_dtype``, resolved once)."""

    @property
    def compiles(self) -> bool:
        """Whether decoder layers and the LM-head logprob passes of the models it prepares are
        compiled (``strategy.compile``; :func:`tidal.models.logprobs.set_head_compile` per model); a
        backend that does not compile returns False."""
        return False

    @property
    def device(self) -> torch.device:
        return self.runtime.device

    # ---- models -------------------------------------------------------------------------------
    @abc.abstractmethod
    def prepare_trainable(self, model: torch.nn.Module, optim: OptimConfig, *, lr: float, total_steps: int) -> TrainState:
        """Shard ``model`` (fp32 master weights), build AdamW and the LR schedule."""

    @abc.abstractmethod
    def prepare_frozen(self, model: torch.nn.Module, *, offload: bool = True) -> torch.nn.Module:
        """Shard a frozen model (reference, reward model) for inference; offloaded to CPU if asked."""

    @abc.abstractmethod
    def backward(self, loss: torch.Tensor, state: TrainState, *, sync_grads: bool) -> None:
        """Accumulate gradients of a loss share; ``sync_grads`` is False for all but the last micro-batch."""

    def clip_and_norm(self, state: TrainState) -> float:
        """Global gradient norm (all ranks), clipped in place to ``state.max_grad_norm`` when > 0.
        Used by the default :meth:`optimizer_step`; a backend whose optimizer clips inside its own
        step (DeepSpeed ZeRO) overrides ``optimizer_step`` instead and has no separate clip."""
        raise NotImplementedError(f"{type(self).__name__} clips inside optimizer_step")

    def optimizer_step(self, state: TrainState) -> dict[str, float]:
        """Clip, step, zero grads, advance the LR schedule. A non-finite gradient norm skips the step
        on every rank alike (the norm is global) and reports ``skipped=1``."""
        grad_norm = self.clip_and_norm(state)
        skipped = not math.isfinite(grad_norm)
        if not skipped:
            state.optimizer.step()
        state.optimizer.zero_grad(set_to_none=True)
        lr = state.scheduler.get_last_lr()[0]
        state.scheduler.step()
        return {"grad_norm": grad_norm, "lr": lr, "skipped": float(skipped)}

    @abc.abstractmethod
    def offload_model(self, model: torch.nn.Module) -> None:
        """Move parameters and buffers to CPU (not a checkpoint: nothing is written to disk)."""

    @abc.abstractmethod
    def reload_model(self, model: torch.nn.Module) -> None:
        """Move parameters and buffers back to the device."""

    def offload_optimizer(self, state: TrainState) -> None:
        if not state.optimizer_offloaded:
            _move_optimizer_state(state.optimizer, torch.device("cpu"))
            state.optimizer_offloaded = True

    def reload_optimizer(self, state: TrainState) -> None:
        if state.optimizer_offloaded:
            _move_optimizer_state(state.optimizer, self.device)
            state.optimizer_offloaded = False

    def resident_bytes(self, state: TrainState) -> dict[str, int]:
        """Bytes of ``state`` held on this rank's device now (:func:`tidal.strategy.resident.device_bytes`:
        local shards, each storage once): ``weights``, its parameters and buffers (FSDP2: the fp32
        master shards); ``optimizer``, its optimizer's state (AdamW's moments)."""
        model = state.model
        return {"weights": device_bytes(itertools.chain(model.parameters(), model.buffers()), self.device),
                "optimizer": device_bytes(optimizer_state_tensors(state.optimizer), self.device)}

    # ---- weights and checkpoints ------------------------------------------------------------------
    @abc.abstractmethod
    def full_weights(self, model: torch.nn.Module, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF name, full unsharded tensor in ``dtype``) for every parameter; a collective on
        every rank, in the same order everywhere. A tied parameter is yielded once, under its first name.
        A tensor may share storage with its parameter (one rank, ``dtype`` equal to the parameter's):
        copy it to keep it across an optimizer step."""

    @abc.abstractmethod
    def full_model_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Full (unsharded) CPU state dict on rank 0 (other ranks get {}), for HF export; a collective."""

    @abc.abstractmethod
    def state_dict(self, state: TrainState) -> dict[str, Any]:
        """Sharded (DCP-ready) state of model + optimizer; scheduler state under 'scheduler'."""

    @abc.abstractmethod
    def load_state_dict(self, state: TrainState, sd: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict`."""

def _frozen_names(model: torch.nn.Module) -> set[str]:
    """Every name (tied aliases included) of a parameter that does not train: left out of checkpoints."""
    return {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def _move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    for st in optimizer.state.values():
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and k != "step":
                st[k] = v.to(device, non_blocking=True)
