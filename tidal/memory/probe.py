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
import os
import shutil
import subprocess
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


# Below this, memory in use beyond this process's allocator and assumed CUDA context is counted as
# this process's own (a CUDA context's size varies by a few hundred MiB with the driver and libraries).
OTHERS_MIN_BYTES = 2**30


def device_memory(device: torch.device, override_gib: float = 0.0) -> DeviceMemory:
    """The device's total memory and what is used outside PyTorch's allocator now, split into this
    process's (its CUDA context) and other processes' (:func:`other_processes_bytes`).
    ``override_gib`` > 0: that total, with an assumed CUDA context and nothing else on it."""
    if override_gib > 0:
        return DeviceMemory(name=f"{override_gib:g} GiB device (memory.device_memory_gib)", total=int(override_gib * 2**30),
                            context=ASSUMED_CUDA_CONTEXT)
    if device.type != "cuda":
        raise ConfigError("memory.device_memory_gib", f"no CUDA device to read the memory of ({device}); set it to plan for one")
    free, total = torch.cuda.mem_get_info(device)
    outside = max(0, total - free - torch.cuda.memory_reserved(device))  # not in this process's allocator
    others, source = other_processes_bytes(outside, _processes_on(device))
    return DeviceMemory(name=torch.cuda.get_device_name(device), total=int(total), context=int(outside - others),
                        others=int(others), others_source=source)


def other_processes_bytes(outside: int, per_pid: dict[int, int] | None, pid: int | None = None) -> tuple[int, str]:
    """(bytes of the device held by other processes, how that was found), of ``outside`` bytes in
    use beyond this process's allocator. ``per_pid``: each process's use of the device as NVML
    reports it (None: not known). Where this process (``pid``, default ours) is among them, the
    others' are theirs; else (no NVML, or a container whose process ids are not the host's) what is
    beyond an assumed CUDA context, when that is at least :data:`OTHERS_MIN_BYTES`."""
    pid = os.getpid() if pid is None else pid
    if per_pid and pid in per_pid:
        theirs = {p: b for p, b in per_pid.items() if p != pid}
        held = min(outside, sum(theirs.values()))
        return held, f"{len(theirs)} process(es) by nvidia-smi: pid {', '.join(map(str, sorted(theirs)))}" if held else ""
    beyond = outside - ASSUMED_CUDA_CONTEXT
    if beyond < OTHERS_MIN_BYTES:
        return 0, ""
    return beyond, ("in use beyond this process's allocator and CUDA context (torch.cuda.mem_get_info; "
                    + ("nvidia-smi lists " + ", ".join(f"pid {p}" for p in sorted(per_pid)) if per_pid else "no per-process figures") + ")")


def _processes_on(device: torch.device) -> dict[int, int] | None:
    """{pid: bytes} of the compute processes on ``device`` from ``nvidia-smi`` (NVML), matched by
    the device's UUID; None when it cannot say."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=gpu_uuid,pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError, RuntimeError, AttributeError):
        return None
    per_pid = {}
    for line in out.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 3 and fields[0].removeprefix("GPU-") == uuid.removeprefix("GPU-") and fields[2].isdigit():
            per_pid[int(fields[1])] = int(fields[2]) * 2**20
    return per_pid


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
    neg_total, context, others, neg_host = all_reduce_max([-float(device.total), float(device.context), float(device.others),
                                                           -float(host.total)])
    return (DeviceMemory(name=device.name, total=int(-neg_total), context=int(context), others=int(others),
                         others_source=device.others_source if others == device.others else "on another rank's device"),
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
    :class:`~tidal.config_base.ConfigError` naming the first setting to change when it does not fit
    (with the table of the smallest combination tried, printed only there).
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
    if is_main and plan.fits:  # a plan that does not fit is shown once, in its error
        print("[tidal] " + plan.table().replace("\n", "\n[tidal] "), flush=True)
    return apply_plan(plan)
