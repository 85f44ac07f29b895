"""The memory plan of a run: the device's and the host's memory measured, the plan made, logged and
applied (:func:`plan_run`). The arithmetic is in :mod:`tidal.memory.plan`.

Which runs plan: a run on a CUDA device, or any run given ``memory.device_memory_gib`` (the plan is
then made for a device of that size, also on CPU: a way to see and test the plan without a GPU).
A CPU run without it makes no plan: its ``auto`` settings take
:data:`~tidal.memory.plan.UNPLANNED_DEFAULTS` (token budgets at least the longest
sequence), and the other ``memory.*`` keys, which
nothing would read, must keep their defaults.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from tidal.config_base import ConfigError
from tidal.host_memory import host_memory, local_world_size
from tidal.memory.config import MemoryConfig
from tidal.memory.plan import (
    ASSUMED_CUDA_CONTEXT,
    DeviceMemory,
    HostMemory,
    MemoryPlan,
    MemorySettings,
    apply_plan,
    inputs_from_config,
    plan_memory,
    settings_without_plan,
)

# ``Runtime.all_reduce_max``: each value's max over all ranks
ReduceMax = Callable[[list[float]], list[float]]


def device_memory(device: torch.device, override_gib: float = 0.0) -> DeviceMemory:
    """The device's total memory and what is used outside PyTorch's allocator now (the CUDA context,
    other processes). ``override_gib`` > 0: that total, with an assumed CUDA context."""
    if override_gib > 0:
        return DeviceMemory(name=f"{override_gib:g} GiB device (memory.device_memory_gib)", total=int(override_gib * 2**30),
                            context=ASSUMED_CUDA_CONTEXT)
    if device.type != "cuda":
        raise ConfigError("memory.device_memory_gib", f"no CUDA device to read the memory of ({device}); set it to plan for one")
    free, total = torch.cuda.mem_get_info(device)
    context = max(0, total - free - torch.cuda.memory_reserved(device))
    return DeviceMemory(name=torch.cuda.get_device_name(device), total=int(total), context=int(context))


def kv_outside_allocator(engine_backend: str, device: torch.device) -> bool:
    """Whether the engine's KV cache is allocated outside PyTorch's allocator (the native engine's
    fixed-address range on CUDA; external engines' own pools)."""
    if engine_backend == "native":
        from tidal.engine.native import fixed_memory

        return fixed_memory.supported(device)
    return engine_backend in ("vllm", "sglang")


def agreed(device: DeviceMemory, host: HostMemory, all_reduce_max: ReduceMax | None) -> tuple[DeviceMemory, HostMemory]:
    """The smallest device and host totals and the largest CUDA context over all ranks (through
    ``all_reduce_max``, e.g. ``Runtime.all_reduce_max``; None: this process alone), so that every
    rank makes the same plan."""
    if all_reduce_max is None:
        return device, host
    neg_total, context, neg_host = all_reduce_max([-float(device.total), float(device.context), -float(host.total)])
    return (DeviceMemory(name=device.name, total=int(-neg_total), context=int(context)),
            HostMemory(total=int(-neg_host), source=host.source))


def plans_on(device: torch.device, memory: MemoryConfig) -> bool:
    """Whether a run on ``device`` makes a memory plan: on CUDA, or for a given device size."""
    return device.type == "cuda" or memory.device_memory_gib > 0


def make_plan(cfg, hf_config, *, device: torch.device, world_size: int, needs_reference: bool, needs_critic: bool,
              teacher_hf_config: Any = None, all_reduce_max: ReduceMax | None = None, num_nodes: int = 1) -> MemoryPlan:
    """The plan of ``cfg`` (the root config) on ``device`` (CUDA, or any device with
    ``memory.device_memory_gib``). ``hf_config``: the actor's Hugging Face config;
    ``teacher_hf_config``: the local distillation teacher's; ``needs_*``: the Algorithm's;
    ``num_nodes``: the run's nodes (``world_size`` ranks spread evenly over them); with
    ``all_reduce_max`` the ranks agree on the machine's figures. Never raises for a plan that does
    not fit (``plan.problems``; :meth:`~tidal.memory.plan.MemoryPlan.table` prints it)."""
    total, source = host_memory(cfg.memory.host_memory_gib)
    dev, host = agreed(device_memory(device, cfg.memory.device_memory_gib), HostMemory(total=total, source=source), all_reduce_max)
    # a plan for a given device size counts it as CUDA: compiled layers and the native engine's
    # fixed-address KV cache as a CUDA run would have them
    target = torch.device("cuda") if device.type != "cuda" else device
    inputs = inputs_from_config(
        cfg, hf_config, world_size=world_size, local_world_size=local_world_size(), num_nodes=num_nodes, device=dev, host=host,
        needs_reference=needs_reference, needs_critic=needs_critic, compiled=cfg.strategy.compiles_on(target.type),
        kv_outside_allocator=kv_outside_allocator(cfg.engine.backend, device) if device.type == "cuda" else cfg.engine.backend != "hf",
        teacher_hf_config=teacher_hf_config,
    )
    return plan_memory(inputs)


def plan_run(cfg, hf_config, *, device: torch.device, world_size: int, is_main: bool, needs_reference: bool,
             needs_critic: bool, teacher_hf_config: Any = None, all_reduce_max: ReduceMax | None = None,
             num_nodes: int = 1) -> MemorySettings:
    """The settings a run uses, before any model loads. Where a plan is made (:func:`plans_on`) it is
    the same on every rank, printed on the main rank and applied: a
    :class:`~tidal.config_base.ConfigError` naming the first setting to change when it does not fit.
    Elsewhere (CPU) no plan is made (:func:`~tidal.memory.plan.settings_without_plan`) and a
    ``memory.*`` key set away from its default is a ConfigError (nothing would read it)."""
    if not plans_on(device, cfg.memory):
        defaults = MemoryConfig()
        for f in dataclasses.fields(MemoryConfig):
            if getattr(cfg.memory, f.name) != getattr(defaults, f.name):
                raise ConfigError(f"memory.{f.name}", f"is read by the memory plan, which a run on {device.type} makes only "
                                  "with memory.device_memory_gib set; set that too, or leave this at its default")
        return settings_without_plan(cfg, longest=cfg.data.max_prompt_len + cfg.rollout.max_new_tokens)
    plan = make_plan(cfg, hf_config, device=device, world_size=world_size, needs_reference=needs_reference,
                     needs_critic=needs_critic, teacher_hf_config=teacher_hf_config, all_reduce_max=all_reduce_max,
                     num_nodes=num_nodes)
    if is_main:
        print("[tidal] " + plan.table().replace("\n", "\n[tidal] "), flush=True)
    return apply_plan(plan)
