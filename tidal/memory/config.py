"""Configuration of the memory plan (``memory.*``)."""

from __future__ import annotations

import dataclasses

from tidal.config_base import check


@dataclasses.dataclass(kw_only=True)
class MemoryConfig:
    """The memory plan (``memory.*``, :mod:`tidal.memory.plan`) of an RL run. Before any
    model loads, on a CUDA device (or on any with ``device_memory_gib``), each phase's peak
    (rollout, experience forwards, update, optimizer step, weight sync) is predicted from the
    model's shape, the rollout's shape and the settings, logged as a table, and the ``auto``
    settings (``train.micro_batch_tokens``, ``train.forward_micro_batch_tokens``,
    ``model.gradient_checkpointing``, ``strategy.offload_optimizer``, ``engine.sleep_level``) are
    chosen, the cheapest combination first, so that it fits;
    explicit settings are kept and checked. The engine's KV cache is the engine's to size (at each
    wake-up, ``engine.*``); the plan predicts it with the engine's rule and checks it holds a sequence. When nothing fits the run stops before loading a model, with an error that names what
    to change (docs/memory.md).

    device_fraction: share of the device's memory the planned peak may take; the rest absorbs the
        allocator's fragmentation and what the plan does not count.
    device_memory_gib: the device's memory in GiB (0: read from the device). Set it to plan for a
        device other than this machine's; on a CPU run the plan is then made for such a device and
        applied. Without it a CPU run makes no plan (its ``auto`` settings take fixed values, see
        ``train.*``) and the other ``memory.*`` keys must keep their defaults.
    host_fraction: share of the host's memory that the ranks on it may plan for (pinned optimizer
        state, parked models, the engine's weights asleep, the model being loaded).
    host_memory_gib: the host's memory in GiB (0: detected, the cgroup limit when there is one, else
        /proc/meminfo's MemTotal). Set it on machines without a cgroup limit whose MemTotal reads
        low at start because their memory grows as it is used.
    """

    device_fraction: float = 0.9
    device_memory_gib: float = 0.0
    host_fraction: float = 0.9
    host_memory_gib: float = 0.0

    def __post_init__(self):
        check(0 < self.device_fraction <= 1, "device_fraction", "must be in (0, 1]")
        check(self.device_memory_gib >= 0, "device_memory_gib", "must be >= 0 (0: read from the device)")
        check(0 < self.host_fraction <= 1, "host_fraction", "must be in (0, 1]")
        check(self.host_memory_gib >= 0, "host_memory_gib", "must be >= 0 (0: detected)")
