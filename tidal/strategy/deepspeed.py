"""DeepSpeed ZeRO backend (stages 1, 2 and 3) behind the Strategy contract.

What the trainer holds:
- ``TrainState.model`` is the ``DeepSpeedEngine``. It forwards attribute access to the Hugging Face
  module (``save_pretrained``, ``config``), and calling it runs ``engine.forward``, which DeepSpeed
  needs for its backward hooks (critic values call the model directly). The HF module's
  ``tidal_token_logprobs`` is re-bound on the engine so that it too runs as the engine's forward
  (under ZeRO-3 that gathers the layers' partitions, and the LM head, which the method reads outside
  of ``lm_head.forward``, is registered as an external parameter of the root module).
- ``TrainState.optimizer`` is the ZeRO optimizer; ``TrainState.scheduler`` a LambdaLR over the
  AdamW that ZeRO wraps (DeepSpeed does not step it: a skipped step still advances the schedule,
  as in FSDP2).
- A frozen model (reference, reward model) is a ZeRO-3 inference engine (partitioned parameters, no
  optimizer) at ``zero_stage=3``, and a plain replicated module on the device at stages 1 and 2
  (those stages partition only optimizer state and gradients, which a frozen model has none of).

Gradient contract (as FSDP2): loss shares sum to the global loss over micro-batches and ranks;
DeepSpeed averages gradients over ranks, so ``backward`` multiplies by the world size. The DeepSpeed
config has ``gradient_accumulation_steps=1`` (DeepSpeed divides nothing) and the trainer's
``sync_grads`` sets the accumulation boundary: ZeRO-1 reduces only at the boundary, ZeRO-2/3 reduce
every micro-batch (DeepSpeed has no no-sync mode for partitioned gradients) into accumulated
partitions. Clipping (``gradient_clipping``) and the non-finite-norm skip happen inside the ZeRO
optimizer step, with torch's formula: ``g *= max_norm / (norm + 1e-6)`` when that is < 1.

Precision: on CUDA (``param_dtype`` auto) parameters are bf16 and the fp32 master weights live in
the optimizer, loaded from the fp32 checkpoint values (not re-widened from bf16); gradients are
reduced in fp32 and, at stages 2 and 3, accumulated in fp32. At stage 1 without optimizer offload
DeepSpeed only offers fp32 accumulation through its BF16_Optimizer, which cannot offload its
states, so stage 1 accumulates micro-batch gradients in bf16. On CPU everything is fp32.

LoRA (PEFT) actors: the engine wraps the ``PeftModel``; only the adapters are in the optimizer (the
base has no ZeRO state; ZeRO-3 partitions it like every parameter). ``full_weights`` follows
:func:`tidal.models.lora.weight_plan`: each bucket of HF weights gathers its base weights and adapters
together and merges them there, the adapters from their fp32 masters. Offload moves the base
(DeepSpeed's ``offload_states`` moves only what the optimizer holds). Checkpoints keep the adapters
only. On CUDA the frozen base is held in bf16 (DeepSpeed casts the module; a frozen parameter has
no fp32 master), where FSDP2 keeps it in fp32 and casts per layer: the same values when the
checkpoint's weights are bf16.

Checkpoints go through torch.distributed.checkpoint like FSDP2's: each rank's ZeRO optimizer state
(its fp32 master partition and AdamW moments) is stored under a key naming the rank and world size,
so a checkpoint loads only into the same world size (DeepSpeed's rigid checkpoints have the same
limit).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Iterator

import deepspeed
import deepspeed.ops
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum
from deepspeed.runtime.zero.utils import get_mapping_to_flat_buffer
from deepspeed.utils import safe_get_full_fp32_param, safe_set_full_fp32_param

from tidal.distributed.runtime import Runtime
from tidal.models.logprobs import LOGPROB_METHOD, set_head_compile
from tidal.models.lora import merged, weight_plan
from tidal.strategy.base import Strategy, TrainState, _frozen_names, _move_optimizer_state, lr_lambda
from tidal.strategy.config import OptimConfig, StrategyConfig
from tidal.strategy.fsdp2 import FSDP2Layout
from tidal.strategy.resident import TrainedBytes, device_bytes, optimizer_state_tensors

# ZeRO-3 parameters are all-gathered for full_weights / export in groups of about this many bytes.
GATHER_BUCKET_BYTES = 256 << 20
# DeepSpeed state kinds: compute-dtype parameters and gradient partitions, fp32 masters, AdamW moments.
_LP_STATES = (OffloadStateTypeEnum.lp_params, OffloadStateTypeEnum.lp_grads)
_HP_STATE = OffloadStateTypeEnum.hp_params
_OPTIM_STATE = OffloadStateTypeEnum.optim_states


def deepspeed_config(
    *, stage: int, bf16: bool, max_grad_norm: float, offload_optimizer: bool, trainable: bool, hpz_partition_size: int = 1
) -> dict[str, Any]:
    """The DeepSpeed config of one engine. Accumulation and the LR schedule stay with Tidal:
    ``gradient_accumulation_steps`` is 1 (DeepSpeed never divides the loss) and no scheduler or
    optimizer section is given (the client AdamW is passed in). ``hpz_partition_size`` > 1 (stage 3
    only: ``strategy.shard`` below the world) is ZeRO++'s hierarchical partitioning over blocks of
    that many consecutive ranks."""
    zero: dict[str, Any] = {"stage": stage, "elastic_checkpoint": False}
    if hpz_partition_size > 1:
        if stage != 3:
            raise ValueError(f"zero_hpz_partition_size={hpz_partition_size} needs ZeRO stage 3, not {stage}")
        zero["zero_hpz_partition_size"] = hpz_partition_size
    if stage == 3:
        # else the first ZeRO-3 engine replaces torch.nn.functional.linear process-wide (every
        # model, the rollout engine's too) with DeepSpeed's autograd function
        zero["memory_efficient_linear"] = False
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if trainable:
        cfg["gradient_clipping"] = float(max_grad_norm)
    if bf16:
        cfg["bf16"] = {"enabled": True}
        if trainable:
            cfg["communication_data_type"] = "fp32"
            # stage 1 + fp32 accumulation without offload selects BF16_Optimizer (no offload_states)
            if stage >= 2 or offload_optimizer:
                cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    return cfg


class DeepSpeedLayout:
    """The ZeRO engines' bytes per rank, for the memory plan, as DeepSpeed documents its layout
    (not calibrated on a GPU). Parameter counts as in :class:`tidal.strategy.fsdp2.FSDP2Layout`."""

    note = "DeepSpeed figures follow its documented layout (not calibrated on a GPU)"

    @staticmethod
    def trained(cfg: StrategyConfig, *, stored: int, trainable: int, world: int, offload: bool) -> TrainedBytes:
        """bf16 compute parameters (partitioned at stage 3, a LoRA base with them); fp32 masters and
        AdamW moments partitioned at every stage; fp32 gradient partitions at stages 2-3 (reduced at
        every micro-batch), full bf16 gradients at stage 1. ZeRO-Offload (``offload``) keeps the
        masters, moments and fp32 gradient partitions on the host (bf16 gradient partitions stay)."""
        stage = cfg.zero_stage
        lp = 2 * stored // (world if stage == 3 else 1)  # ``world`` here: the shard group (strategy.shard)
        masters, moments = 4 * trainable // world, 8 * trainable // world
        grads = 4 * trainable // world if stage >= 2 else 2 * trainable
        if offload:
            grads = 2 * trainable // world if stage >= 2 else grads
            return TrainedBytes(weights=lp, grads=grads, grads_accumulating=grads, optimizer_device=0,
                                optimizer_host=masters + moments + 4 * trainable // world,
                                host_label="ZeRO-Offload: fp32 masters, moments, gradients")
        return TrainedBytes(weights=lp + masters, grads=grads, grads_accumulating=grads, optimizer_device=moments, optimizer_host=0)

    @staticmethod
    def frozen(cfg: StrategyConfig, *, params: int, world: int) -> int:
        """A frozen model: compute-dtype parameters, partitioned by a ZeRO-3 engine, else replicated."""
        return 2 * params // (world if cfg.zero_stage == 3 else 1)

    @staticmethod
    def working(cfg: StrategyConfig, *, layer_params: int, root_params: int, backward: bool) -> int:
        """During a pass: at stage 3 the gathered parameters, as FSDP2 gathers them (a module
        around its use, the next prefetched); at stages 1-2 the parameters are whole already (in
        ``weights``). In the backward also a layer's bf16 gradients and their fp32 copy before
        they are partitioned."""
        if cfg.zero_stage == 3:
            return FSDP2Layout.working(cfg, layer_params=layer_params, root_params=root_params, backward=backward)
        return 6 * layer_params if backward else 0


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups as in FSDP2: matrices decay, vectors (norms, biases) do not; empty groups dropped."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


@dataclasses.dataclass(eq=False)
class _Placed:
    """How a prepared model is held. ``engine`` is None for a replicated frozen module."""

    engine: Any
    module: torch.nn.Module
    trainable: bool
    params_offloaded: bool = False
    optim_offloaded: bool = False

    @property
    def frozen_params(self) -> list[torch.nn.Parameter]:
        """Parameters of a trained model that do not train (a LoRA actor's base): no ZeRO
        optimizer state, so DeepSpeed's offload_states does not move them."""
        return [p for p in self.module.parameters() if not p.requires_grad] if self.trainable else []


def _is_zero3(p: torch.nn.Parameter) -> bool:
    return hasattr(p, "ds_id")


def _route_method_through_engine(engine, name: str) -> None:
    """Bind ``engine.<name>(...)`` to the HF module's method ``name`` run *as the engine's forward*:
    DeepSpeed's forward hooks (ZeRO-3 gathering, backward bookkeeping) then see it like ``forward``."""
    module = engine.module
    method = getattr(module, name)

    def call(*args, **kwargs):
        own = module.__dict__.get("forward")
        module.forward = method
        try:
            return engine(*args, **kwargs)
        finally:
            if own is None:
                del module.forward
            else:
                module.forward = own

    setattr(engine, name, call)


def _prepare_logprob_method(engine, zero3: bool, compile_head: bool) -> None:
    module = engine.module
    if not hasattr(module, LOGPROB_METHOD):
        return
    set_head_compile(module, compile_head)
    if zero3:  # the method applies lm_head.weight directly (chunked), outside lm_head.forward
        head = module.get_output_embeddings()
        for p in head.parameters(recurse=False):
            deepspeed.zero.register_external_parameter(module, p)
    _route_method_through_engine(engine, LOGPROB_METHOD)


def _move_buffers(module: torch.nn.Module, device: torch.device | str) -> None:
    for m in module.modules():
        for k, b in m._buffers.items():
            if b is not None:
                m._buffers[k] = b.to(device)


def _full_bytes(p: torch.nn.Parameter) -> int:
    return (p.ds_numel if _is_zero3(p) else p.numel()) * p.element_size()


def _gathered_groups(items: list, bucket_bytes: int, size=_full_bytes) -> Iterator[list]:
    """Consecutive groups of about ``bucket_bytes`` (``size(item)``: full bytes), in the given order."""
    group, total = [], 0
    for item in items:
        group.append(item)
        total += size(item)
        if total >= bucket_bytes:
            yield group
            group, total = [], 0
    if group:
        yield group


def _forget_dead_world_group() -> None:
    """DeepSpeed keeps a module-level clone of the world group, made by its first engine. After that
    world was destroyed (a second run in one process: tests, notebooks) the clone is dead and every
    engine would fail on it; drop it so that the next engine clones the current world."""
    from deepspeed.utils import groups

    if groups._WORLD_GROUP is None:
        return
    try:
        torch.distributed.get_process_group_ranks(groups._WORLD_GROUP)
    except (KeyError, ValueError, RuntimeError):
        groups._WORLD_GROUP = None


def _move_zero3_trained_partitions(zero, device: torch.device) -> None:
    """Move a ZeRO-3 optimizer's flat buffer of trained compute-dtype partitions to ``device`` and
    re-point the partitions (``ds_tensor``) and sub-group views at it, as ``reload_states`` does."""
    buf = zero.lp_param_buffer
    buf.data = buf.data.to(device)  # re-pointed even when already there: the same code on every device
    for t, offset, numel in get_mapping_to_flat_buffer(zero._get_parameter_partitions()):
        t.data = buf.narrow(0, offset, numel)
    zero.fp16_partitioned_groups_flat.clear()
    zero._set_fp16_partitioned_groups_flat()


def _materialize_optimizer_state(engine) -> None:
    """AdamW creates its moments at its first step, but DCP loads into existing tensors: give a
    never-stepped optimizer the state its first step starts from (zero moments, step 0) by running
    that step with zero gradients and lr 0 (parameters unchanged), then resetting the step count."""
    basic, zero = engine.basic_optimizer, engine.optimizer
    if basic.state:
        return
    zero3 = hasattr(zero, "fp32_partitioned_groups_flat")
    if zero3:  # outside its step ZeRO-3 leaves the AdamW groups empty
        zero._set_fp32_optimizer_param_groups()
    lrs = [g["lr"] for g in basic.param_groups]
    params = [p for g in basic.param_groups for p in g["params"]]
    grads = [p.grad for p in params]
    try:
        for g in basic.param_groups:
            g["lr"] = 0.0
        for p in params:
            p.grad = torch.zeros_like(p)
        basic.step()
    finally:
        for g, lr in zip(basic.param_groups, lrs):
            g["lr"] = lr
        for p, grad in zip(params, grads):
            p.grad = grad
        if zero3:
            zero._clear_fp32_optimizer_param_groups()
    for st in basic.state.values():
        st["step"] = torch.zeros_like(st["step"]) if isinstance(st["step"], torch.Tensor) else 0


class DeepSpeedStrategy(Strategy):
    reshards_checkpoints = False  # each rank's ZeRO optimizer state is stored under its rank and world size

    def __init__(self, cfg: StrategyConfig, runtime: Runtime):
        super().__init__(cfg, runtime)
        accel = get_accelerator().device_name()
        if accel != runtime.device.type:
            raise ValueError(
                f"strategy.backend=deepspeed: DeepSpeed's accelerator is {accel!r} but the run's device is "
                f"{runtime.device.type!r}; set DS_ACCELERATOR={runtime.device.type} (or run.device) so they agree"
            )
        # DeepSpeed's engine asserts LOCAL_RANK is set (torchrun sets it; a plain process does not).
        os.environ.setdefault("LOCAL_RANK", str(runtime.local_rank))
        if runtime.device.type == "cpu":
            # Its shared-memory CPU all-reduce serves DeepSpeed inference TP only; not compiling it
            # at the first engine saves minutes of C++ build.
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        _forget_dead_world_group()
        self._placed: dict[int, _Placed] = {}
        # CPU optimizer offload is meaningless on a CPU run (the state is there already).
        self._ds_offload = self.cfg.offload_optimizer and runtime.device.type != "cpu"
        shard = runtime.topology.shard_size(self.cfg.shard_setting())
        self._hpz = shard if shard < runtime.world_size else 1
        """``zero_hpz_partition_size`` (1: none): ``strategy.shard`` below the world, stage 3 only
        (:class:`~tidal.strategy.config.StrategyConfig` checks the stage)."""

    @property
    def zero_stage(self) -> int:
        return self.cfg.zero_stage

    def _rec(self, model: torch.nn.Module) -> _Placed:
        rec = self._placed.get(id(model))
        if rec is None:
            raise ValueError(f"{type(model).__name__} was not prepared by this DeepSpeedStrategy")
        return rec

    def _initialize(self, module: torch.nn.Module, optimizer, config: dict[str, Any]):
        engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=config, dist_init_required=False)
        return engine

    # ---- models -------------------------------------------------------------------------------
    def _client_optimizer(self, groups: list[dict[str, Any]], optim: OptimConfig, lr: float):
        kwargs = dict(lr=lr, betas=tuple(optim.betas), eps=optim.eps)
        if self._ds_offload:  # ZeRO-Offload steps on the CPU with DeepSpeed's vectorised AdamW
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam(groups, adamw_mode=True, **kwargs)
        return torch.optim.AdamW(groups, foreach=True, **kwargs)

    def prepare_trainable(self, model: torch.nn.Module, optim: OptimConfig, *, lr: float, total_steps: int) -> TrainState:
        model = model.to(dtype=torch.float32)
        model.train()
        bf16 = self.param_dtype == torch.bfloat16
        # DeepSpeed casts the module to bf16 and would seed fp32 masters from it; keep the fp32 values.
        masters = None
        if self.param_dtype != torch.float32:
            masters = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
        config = deepspeed_config(
            stage=self.zero_stage, bf16=bf16, max_grad_norm=optim.max_grad_norm,
            offload_optimizer=self._ds_offload, trainable=True, hpz_partition_size=self._hpz,
        )
        optimizer = self._client_optimizer(param_groups(model, optim.weight_decay), optim, lr)
        engine = self._initialize(model, optimizer, config)
        if masters is not None:
            for name, p in engine.module.named_parameters():
                if name in masters:
                    safe_set_full_fp32_param(p, masters[name].to(self.device))
            del masters
        _prepare_logprob_method(engine, self.zero_stage == 3, self.compiles)
        scheduler = torch.optim.lr_scheduler.LambdaLR(engine.basic_optimizer, lr_lambda(optim, total_steps))
        self._placed[id(engine)] = _Placed(engine=engine, module=engine.module, trainable=True)
        return TrainState(
            model=engine, optimizer=engine.optimizer, scheduler=scheduler, max_grad_norm=optim.max_grad_norm,
            optimizer_offloaded=self._ds_offload,
        )

    def prepare_frozen(self, model: torch.nn.Module, *, offload: bool = True) -> torch.nn.Module:
        model.requires_grad_(False)
        model.eval()
        model = model.to(dtype=self.param_dtype)
        if self.zero_stage == 3:
            config = deepspeed_config(
                stage=3, bf16=self.param_dtype == torch.bfloat16, max_grad_norm=0.0, offload_optimizer=False, trainable=False,
                hpz_partition_size=self._hpz,
            )
            engine = self._initialize(model, None, config)
            _prepare_logprob_method(engine, zero3=True, compile_head=self.compiles)
            out, rec = engine, _Placed(engine=engine, module=engine.module, trainable=False)
        else:
            out, rec = model.to(self.device), _Placed(engine=None, module=model, trainable=False)
        self._placed[id(out)] = rec
        if offload:
            self.offload_model(out)
        return out

    def backward(self, loss: torch.Tensor, state: TrainState, *, sync_grads: bool) -> None:
        engine = self._rec(state.model).engine
        engine.set_gradient_accumulation_boundary(sync_grads)
        engine.backward(loss * self.runtime.world_size)

    def optimizer_step(self, state: TrainState) -> dict[str, float]:
        """ZeRO step: global norm, clip, skip on a non-finite norm (every rank alike), zero grads;
        then the LR schedule advances whether or not the step was applied (as in FSDP2)."""
        engine = self._rec(state.model).engine
        engine.set_gradient_accumulation_boundary(True)
        engine.step()
        norm = engine.get_global_grad_norm()
        grad_norm = float(norm) if norm is not None else float("nan")
        skipped = not engine.was_step_applied()
        lr = state.scheduler.get_last_lr()[0]
        state.scheduler.step()
        return {"grad_norm": grad_norm, "lr": lr, "skipped": float(skipped)}

    # ---- placement ----------------------------------------------------------------------------
    def _place_trainable(self, rec: _Placed) -> None:
        """Bring a trained engine's states where ``rec`` says. offload_model covers the parameters in
        both precisions (bf16 compute copy, fp32 masters) and gradient partitions; offload_optimizer
        the AdamW moments. DeepSpeed's offload_states moves them, except the fp32 masters and moments
        at ZeRO-3, which it moves only for its own FusedAdam, and the parameters that do not train
        (a LoRA actor's base): those are moved here. With such parameters at ZeRO-3 the trained
        partitions are moved here too (DeepSpeed maps every parameter of the module onto the flat
        buffer of the trained ones, which then does not fit)."""
        engine, zero3, frozen = rec.engine, self.zero_stage == 3, rec.frozen_params
        device = torch.device("cpu") if rec.params_offloaded else self.device
        want = set()
        if rec.params_offloaded:
            want.update(_LP_STATES if zero3 else (*_LP_STATES, _HP_STATE))
            if zero3 and frozen:
                want.discard(OffloadStateTypeEnum.lp_params)
        if rec.optim_offloaded and not zero3:
            want.add(_OPTIM_STATE)
        have = set(engine.optimizer.offloaded_states)
        if have - want:  # DeepSpeed reloads all or nothing
            engine.reload_states()
            have = set(engine.optimizer.offloaded_states)
        if want - have:
            engine.offload_states(include=want, pin_memory=True)
        if zero3 and not self._ds_offload:
            cpu = torch.device("cpu")
            for flat in engine.optimizer.fp32_partitioned_groups_flat:
                flat.data = flat.data.to(cpu if rec.params_offloaded else self.device)
            _move_optimizer_state(engine.basic_optimizer, cpu if rec.optim_offloaded else self.device)
        if zero3 and frozen:
            _move_zero3_trained_partitions(engine.optimizer, device)
        for p in frozen:
            if zero3:
                p.ds_tensor.data = p.ds_tensor.data.to(device)
            else:
                p.data = p.data.to(device)
        _move_buffers(rec.module, device)

    def _place_frozen_zero3(self, rec: _Placed, device: torch.device | str) -> None:
        # Release every gathered parameter so only partitions hold data (the engine's own
        # empty_partition_cache adds a full gc.collect(), ~0.3 s, on every call).
        rec.engine.optimizer.empty_partition_cache()
        for p in rec.module.parameters():
            p.ds_tensor.data = p.ds_tensor.data.to(device)
        _move_buffers(rec.module, device)

    def _place_model(self, model: torch.nn.Module, offloaded: bool) -> None:
        if id(model) not in self._placed and not any(True for _ in model.parameters()) and not any(True for _ in model.buffers()):
            return  # owns nothing to move (a LoRA actor's adapter-disabled reference)
        rec = self._rec(model)
        if rec.params_offloaded == offloaded:
            return
        rec.params_offloaded = offloaded
        device = torch.device("cpu") if offloaded else self.device
        if rec.trainable:
            self._place_trainable(rec)
        elif rec.engine is not None:
            self._place_frozen_zero3(rec, device)
        else:
            rec.module.to(device)

    def offload_model(self, model: torch.nn.Module) -> None:
        self._place_model(model, True)

    def reload_model(self, model: torch.nn.Module) -> None:
        self._place_model(model, False)

    def offload_optimizer(self, state: TrainState) -> None:
        """With ``strategy.offload_optimizer`` the ZeRO-Offload state never leaves the CPU (nothing
        to do); otherwise the AdamW moments are moved to CPU."""
        rec = self._rec(state.model)
        if not self._ds_offload and not rec.optim_offloaded:
            rec.optim_offloaded = True
            self._place_trainable(rec)
        state.optimizer_offloaded = True

    def resident_bytes(self, state: TrainState) -> dict[str, int]:
        """``weights``: the compute-dtype parameters (ZeRO-3: this rank's partitions, ``ds_tensor``)
        and buffers; ``optimizer``: the fp32 master partitions and AdamW's moments (the ZeRO paper's
        optimizer states), as far as they are on this rank's device."""
        engine = state.model
        zero, params = engine.optimizer, list(engine.module.parameters())
        weights = [*params, *(p.ds_tensor for p in params if hasattr(p, "ds_tensor")), *engine.module.buffers()]
        masters = getattr(zero, "single_partition_of_fp32_groups", None) or getattr(zero, "fp32_partitioned_groups_flat", [])
        return {"weights": device_bytes(weights, self.device),
                "optimizer": device_bytes([*masters, *optimizer_state_tensors(engine.basic_optimizer)], self.device)}

    def reload_optimizer(self, state: TrainState) -> None:
        rec = self._rec(state.model)
        if not self._ds_offload and rec.optim_offloaded:
            rec.optim_offloaded = False
            self._place_trainable(rec)
            state.optimizer_offloaded = False

    # ---- weights and checkpoints ----------------------------------------------------------------
    def _full_tensors(self, params: list[torch.nn.Parameter], *, masters: set[int] = frozenset()) -> Iterator[torch.Tensor]:
        """Full values of ``params`` in order (a collective), as new tensors (never views of the live
        parameters): the fp32 master of each parameter whose id is in ``masters`` (trained ones),
        the compute-dtype parameter of the others (ZeRO-3: gathered in buckets)."""
        for group in _gathered_groups(params, GATHER_BUCKET_BYTES):
            zero3 = [p for p in group if _is_zero3(p) and id(p) not in masters]
            with deepspeed.zero.GatheredParameters(zero3, modifier_rank=None, enabled=bool(zero3)):
                full = [safe_get_full_fp32_param(p) if id(p) in masters else p.detach().clone() for p in group]
            yield from full

    def full_weights(self, model: torch.nn.Module, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) for every weight, tied ones once, the same order on every rank; a
        LoRA actor's targets merged (:func:`tidal.models.lora.weight_plan`), bucket by bucket at
        ZeRO-3 (never the whole model at once). Values are the compute-dtype parameters: with bf16
        training and ``dtype=bfloat16`` (the rollout engine's) they equal the fp32 masters rounded, as
        FSDP2's; an fp32 request of a bf16 model gets the bf16 values widened. LoRA adapters are
        merged from their fp32 masters (``W + s * B @ A`` in fp32, then cast), as FSDP2 merges."""
        rec = self._rec(model)
        params = dict(rec.module.named_parameters())
        plan = weight_plan(rec.module)
        adapters = {id(params[n]) for e in plan for n in e.params[1:]}
        for group in _gathered_groups(plan, GATHER_BUCKET_BYTES, lambda e: sum(_full_bytes(params[n]) for n in e.params)):
            names = list(dict.fromkeys(n for e in group for n in e.params))
            values = dict(zip(names, self._full_tensors([params[n] for n in names], masters=adapters)))
            for e in group:
                yield e.hf_name, merged(e, values.__getitem__).to(self.device, dtype=dtype)
            del values

    def full_model_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Full CPU state dict on rank 0 ({} elsewhere), keys as ``module.state_dict()``; trained
        parameters are the fp32 masters (as FSDP2 exports), frozen ones of a trained model (a LoRA
        actor's base) their compute-dtype values in fp32; tied keys share one tensor. A collective."""
        rec = self._rec(model)
        entries = list(rec.module.state_dict(keep_vars=True).items())
        unique: dict[int, torch.Tensor] = {}
        params = []
        for _, t in entries:
            if isinstance(t, torch.nn.Parameter) and id(t) not in unique:
                unique[id(t)] = t
                params.append(t)
        full: dict[int, torch.Tensor] = {}
        masters = {id(p) for p in params if rec.trainable and p.requires_grad}
        for p, value in zip(params, self._full_tensors(params, masters=masters)):
            if self.runtime.is_main:
                full[id(p)] = value.detach().to("cpu", dtype=torch.float32 if rec.trainable else value.dtype)
        if not self.runtime.is_main:
            return {}
        return {k: full[id(t)] if isinstance(t, torch.nn.Parameter) else t.detach().cpu() for k, t in entries}

    def _rank_key(self) -> str:
        return f"rank{self.runtime.rank}_of{self.runtime.world_size}"

    def state_dict(self, state: TrainState) -> dict[str, Any]:
        """This rank's ZeRO optimizer state (fp32 master partition, moments, loss-scaler settings)
        under a rank key; at stages 1-2 also the replicated compute-dtype weights that train (ZeRO-3
        rebuilds its partitions from the fp32 masters on load). Parameters that do not train (a LoRA
        actor's base) are not saved: they are re-read from ``model.path``, as with FSDP2. Tensors are
        the live buffers (DCP loads in place)."""
        engine = self._rec(state.model).engine
        _materialize_optimizer_state(engine)
        sd: dict[str, Any] = {
            "optimizer": {self._rank_key(): engine.optimizer.state_dict()},
            "scheduler": state.scheduler.state_dict(),
            "engine": {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
                       "skipped_steps": engine.skipped_steps},
        }
        if self.zero_stage < 3:
            frozen = _frozen_names(engine.module)
            sd["model"] = {k: v for k, v in engine.module.state_dict().items() if k not in frozen}
        return sd

    def load_state_dict(self, state: TrainState, sd: dict[str, Any]) -> None:
        engine = self._rec(state.model).engine
        key = self._rank_key()
        if key not in sd["optimizer"]:
            raise ValueError(f"DeepSpeed checkpoint has no optimizer state for {key} (saved with {sorted(sd['optimizer'])})")
        per_rank = [None] * self.runtime.world_size
        per_rank[self.runtime.rank] = sd["optimizer"][key]
        if self.zero_stage < 3:
            frozen = _frozen_names(engine.module)
            keys = engine.module.load_state_dict(sd["model"], strict=False)
            missing = set(keys.missing_keys) - frozen
            if missing or keys.unexpected_keys:
                raise RuntimeError(f"checkpoint does not match the model: missing {sorted(missing)[:5]}, unexpected {sorted(keys.unexpected_keys)[:5]}")
            engine.optimizer.load_state_dict(per_rank, load_optimizer_states=True, load_from_fp32_weights=True)
        else:
            engine.optimizer.checkpoint_event_prologue()
            engine.optimizer.load_state_dict(per_rank, load_optimizer_states=True, load_from_fp32_weights=True)
            engine.optimizer.checkpoint_event_epilogue()
        state.scheduler.load_state_dict(sd["scheduler"])
        engine.global_steps = sd["engine"]["global_steps"]
        engine.global_samples = sd["engine"]["global_samples"]
        engine.skipped_steps = sd["engine"]["skipped_steps"]
