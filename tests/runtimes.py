"""Runtimes for tests that run without torchrun.

:func:`lone_runtime`: a :class:`~tidal.distributed.runtime.Runtime` of one rank with no process
group (a world and TP group of one: its host collectives return this rank's own values without a
call). A test of a larger TP group takes ``tp_size``/``tp_rank`` and replaces ``tp_gather_objects``
with what the other ranks bring. :func:`spawned_runtime`: the real Runtime of a rank of a gloo world
a test spawned itself (``dist.init_process_group`` done), through :func:`init_runtime`.
"""

from __future__ import annotations

import os

import torch

from tidal.distributed.runtime import Runtime, init_runtime


def lone_runtime(*, tp_size: int = 1, tp_rank: int = 0) -> Runtime:
    return Runtime(rank=tp_rank, world_size=tp_size, local_rank=0, device=torch.device("cpu"), backend="gloo",
                   tp_size=tp_size, tp_rank=tp_rank, tp_group=None, dp_rank=0, dp_size=1, dp_group=None,
                   cpu_group=None, tp_cpu_group=None)


def spawned_runtime(rank: int, world_size: int, tp_size: int) -> Runtime:
    os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    return init_runtime(tp_size, "cpu")
