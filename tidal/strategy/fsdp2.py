"""FSDP2 backend: ``torch.distributed.fsdp.fully_shard`` per decoder layer, then the root.

Parameters are sharded over all ranks (a 1-D mesh of the world), or with ``strategy.shard`` below
the world (hybrid sharding, HSDP) over a 2-D mesh ``(replicate, shard)``: blocks of ``shard``
consecutive ranks (a node's, by default on several nodes) each hold one sharded copy, and the blocks
replicate it (:func:`shard_mesh`). Gradients are reduce-scattered within a block and all-reduced
across blocks; either way they are averaged over the whole world, so the gradient contract is the
same. DCP checkpoints of either layout load into either (and into another world size). Master weights are fp32; on CUDA
the compute (unsharded) dtype is bf16 with fp32 gradient reduction (MixedPrecisionPolicy). Frozen
models (reference, reward model) have no master weights: their parameters are stored in the compute
dtype (identical outputs, half the memory and offload traffic in bf16); buffers stay fp32. Names of
parameters are untouched (fully_shard does not wrap modules), so ``full_weights`` yields HF names;
a LoRA (PEFT) actor's weights are merged and named by :func:`tidal.models.lora.hf_weights`.
Checkpoints hold the trainable parameters only (a LoRA actor's adapters; its base is ``model.path``).

Optimizer: ``torch.optim.AdamW`` with its state on the device, or with ``strategy.offload_optimizer``
:class:`~tidal.strategy.streamed_adamw.StreamedAdamW`, whose state stays in pinned host memory and
streams through the device during the step (so ``offload_optimizer``/``reload_optimizer`` move
nothing).
"""

from __future__ import annotations

import functools
from typing import Any, Iterator

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from tidal.models.logprobs import LOGPROB_METHOD, set_head_compile
from tidal.models.lora import hf_weights
from tidal.strategy.base import Strategy, TrainState, _frozen_names, lr_lambda
from tidal.strategy.compile_cache import use_compile_cache
from tidal.strategy.config import OptimConfig, StrategyConfig
from tidal.strategy.gather import BucketedFullTensors
from tidal.strategy.parking import ModelParking
from tidal.strategy.resident import TrainedBytes
from tidal.strategy.streamed_adamw import DEFAULT_CHUNK_BYTES as STREAM_CHUNK_BYTES
from tidal.strategy.streamed_adamw import StreamedAdamW


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks of an HF model (the units FSDP2 shards one by one)."""
    no_split = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in no_split]
    if not layers:
        raise ValueError(f"cannot find decoder layers of {type(model).__name__} (no _no_split_modules); FSDP2 needs them")
    return layers


def compile_layers(model: torch.nn.Module) -> None:
    """Compile each decoder layer's ``forward`` in place (``torch.compile``, dynamic shapes).

    Only ``forward`` is compiled, not the module call: FSDP2's unshard/reshard hooks stay eager
    around it, and parameter names do not change. The layers share one code object, so one
    compilation serves them all (parameters are graph inputs).

    A layer under gradient checkpointing (``model.gradient_checkpointing``: HF's checkpoint around
    the module call) stays eager: the tensors a compiled region saves for its backward escape the
    checkpoint's saved-tensor hooks, so a compiled checkpointed layer keeps its whole saved set (the
    same bytes as without checkpointing: measured in tests/unit/test_memory_layouts.py) and the
    recompute would cost time for nothing."""
    if checkpointed(model):
        return
    for layer in decoder_layers(model):
        layer.forward = torch.compile(layer.forward, dynamic=True)


def checkpointed(model: torch.nn.Module) -> bool:
    """Whether HF gradient checkpointing is on anywhere in ``model`` (on the layers, or on the
    decoder stack in transformers versions that checkpoint from there)."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


class FSDP2Layout:
    """FSDP2's bytes per rank, for the memory plan (what this module keeps where, from the numbers
    of parameters alone). Parameter counts: ``stored`` (every parameter held: a LoRA actor's frozen
    base and its adapters), ``trainable`` (those with gradients and optimizer state)."""

    note = ""  # calibrated against H200 runs (tests/unit/test_memory_plan.py)

    @staticmethod
    def trained(cfg: StrategyConfig, *, stored: int, trainable: int, world: int, offload: bool) -> TrainedBytes:
        """fp32 master weights of everything, sharded (``prepare_trainable``); fp32 gradient shards
        of what trains, and without gradient sync (every micro-batch but a step's last:
        :meth:`FSDP2Strategy.backward`) each parameter's unsharded gradient upcast to the fp32
        reduce dtype, the whole model's on every rank; AdamW's two fp32 moments on the device, or
        with ``offload`` in pinned host memory streamed through two staging chunks
        (:class:`StreamedAdamW`)."""
        optim = 8 * trainable // world
        return TrainedBytes(
            weights=4 * stored // world, grads=4 * trainable // world, grads_accumulating=4 * trainable,
            optimizer_device=0 if offload else optim, optimizer_host=optim if offload else 0,
            optimizer_staging=2 * STREAM_CHUNK_BYTES if offload else 0, host_label="pinned",
        )

    @staticmethod
    def frozen(cfg: StrategyConfig, *, params: int, world: int) -> int:
        """A frozen model (reference, teacher): bf16 parameters, sharded (``prepare_frozen``)."""
        return 2 * params // world

    @staticmethod
    def working(cfg: StrategyConfig, *, layer_params: int, root_params: int, backward: bool) -> int:
        """Unsharded bf16 parameters held during a pass: the root's (embedding, LM head) for the
        whole pass, the layer computing and the one prefetched; in the backward also one layer's
        bf16 gradients and their fp32 copy for the reduce-scatter."""
        return 2 * root_params + 4 * layer_params + (6 * layer_params if backward else 0)


def shard_mesh(device_type: str, world_size: int, shard_size: int):
    """The device mesh FSDP2 shards over: 1-D ``(world,)`` when ``shard_size`` is the world, else
    2-D ``(world / shard_size, shard_size)`` named ``("replicate", "shard")``, whose shard groups are
    blocks of consecutive ranks (a node's ranks when ``shard_size`` is the ranks per node) and whose
    replicate groups take one rank of each block (as torchtitan's ``dp_replicate`` x ``dp_shard``).
    Collective: every rank builds it."""
    if shard_size == world_size:
        return init_device_mesh(device_type, (world_size,))
    return init_device_mesh(device_type, (world_size // shard_size, shard_size), mesh_dim_names=("replicate", "shard"))


class FSDP2Strategy(Strategy):
    @property
    def compiles(self) -> bool:
        return self.cfg.compiles_on(self.device.type)

    def _mesh(self):
        if not hasattr(self, "_mesh_cache"):
            shard = self.runtime.topology.shard_size(self.cfg.shard_setting())
            self._mesh_cache = shard_mesh(self.device.type, self.runtime.world_size, shard)
        return self._mesh_cache

    def _shard(self, model: torch.nn.Module, *, reshard_after_forward: bool) -> torch.nn.Module:
        mp = MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=torch.float32)
        kwargs = dict(mesh=self._mesh(), mp_policy=mp, reshard_after_forward=reshard_after_forward)
        if self.compiles:
            use_compile_cache(self.cfg.compile_cache_dir)
            compile_layers(model)
        for layer in decoder_layers(model):
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
        if hasattr(model, LOGPROB_METHOD):
            set_head_compile(model, self.compiles)
            register_fsdp_forward_method(model, LOGPROB_METHOD)
        return model

    def prepare_trainable(self, model: torch.nn.Module, optim: OptimConfig, *, lr: float, total_steps: int) -> TrainState:
        model = model.to(dtype=torch.float32)
        model.train()
        self._shard(model.to(self.device), reshard_after_forward=self.cfg.reshard_after_forward)
        decay, no_decay = [], []
        for name, p in model.named_parameters():
            if p.requires_grad:
                (no_decay if p.ndim < 2 else decay).append(p)
        groups = [{"params": decay, "weight_decay": optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        if self.cfg.offload_optimizer:
            optimizer = StreamedAdamW(groups, lr=lr, betas=tuple(optim.betas), eps=optim.eps, device=self.device)
        else:
            optimizer = torch.optim.AdamW(
                groups, lr=lr, betas=tuple(optim.betas), eps=optim.eps,
                # one fused kernel per parameter group on CUDA (the foreach step is ~1.6x slower there)
                **({"fused": True} if self.device.type == "cuda" else {"foreach": True}),
            )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(optim, total_steps))
        return TrainState(model=model, optimizer=optimizer, scheduler=scheduler, max_grad_norm=optim.max_grad_norm)

    def prepare_frozen(self, model: torch.nn.Module, *, offload: bool = True) -> torch.nn.Module:
        model.requires_grad_(False)
        model.eval()
        model.to(dtype=torch.float32)  # floating buffers (e.g. RoPE frequencies) in fp32, as in the trained models
        for p in model.parameters():  # stored in the dtype it computes in: half the memory and offload traffic in bf16
            p.data = p.data.to(self.param_dtype)
        self._shard(model.to(self.device), reshard_after_forward=True)
        if offload:
            self.offload_model(model)
        return model

    def backward(self, loss: torch.Tensor, state: TrainState, *, sync_grads: bool) -> None:
        model = state.model
        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(sync_grads)
        (loss * self.runtime.world_size).backward()

    def clip_and_norm(self, state: TrainState) -> float:
        params = [p for p in state.model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        max_norm = state.max_grad_norm if state.max_grad_norm > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        return float(norm)

    def offload_optimizer(self, state: TrainState) -> None:
        """A streamed optimizer's state never leaves the host: nothing to move."""
        if isinstance(state.optimizer, StreamedAdamW):
            state.optimizer_offloaded = True
        else:
            super().offload_optimizer(state)

    def reload_optimizer(self, state: TrainState) -> None:
        if not isinstance(state.optimizer, StreamedAdamW):
            super().reload_optimizer(state)

    @functools.cached_property
    def _parking(self) -> ModelParking:
        return ModelParking(self.device)

    def offload_model(self, model: torch.nn.Module) -> None:
        """A frozen model (nothing trains: reference, reward model) is parked: its device memory is
        freed in place and its host copy, pinned and made once, is what reloads read. A trained
        model moves to the CPU (its values change between offloads, and checkpoints read them)."""
        if self.device.type == "cpu":
            return
        if any(p.requires_grad for p in model.parameters()):
            model.to("cpu")
        else:
            self._parking.park(model)
        # the freed blocks stay in the allocator's cache for the next phase (an engine that allocates
        # outside it empties the cache when it wakes)

    def reload_model(self, model: torch.nn.Module) -> None:
        if self.device.type == "cpu":
            return
        if self._parking.is_parked(model):
            self._parking.unpark(model)
        else:
            model.to(self.device)

    def full_weights(self, model: torch.nn.Module, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        # hf_weights walks named_parameters (a tied parameter once, under its first name) identically on
        # every rank; LoRA targets are merged in fp32 before the cast. Parameters are gathered in
        # buckets (one collective per bucket; none on one rank, see tidal.strategy.gather).
        for name, t in hf_weights(model, BucketedFullTensors(model, self.device)):
            yield name, t.to(dtype)

    def state_dict(self, state: TrainState) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(state.model, state.optimizer)
        frozen = _frozen_names(state.model)
        model_sd = {k: v for k, v in model_sd.items() if k not in frozen}
        return {"model": model_sd, "optimizer": optim_sd, "scheduler": state.scheduler.state_dict()}

    def load_state_dict(self, state: TrainState, sd: dict[str, Any]) -> None:
        frozen = _frozen_names(state.model)
        keys = set_state_dict(
            state.model, state.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"],
            options=StateDictOptions(strict=not frozen),
        )
        missing = set(keys.missing_keys) - frozen if keys is not None else set()
        if missing or (keys is not None and keys.unexpected_keys):
            raise RuntimeError(f"checkpoint does not match the model: missing {sorted(missing)[:5]}, unexpected {sorted(keys.unexpected_keys)[:5]}")
        state.scheduler.load_state_dict(sd["scheduler"])

    def full_model_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Full CPU state dict on rank 0, {} elsewhere (for HF export); a collective."""
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
