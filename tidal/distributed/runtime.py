"""The torchrun/SPMD runtime: process-group initialisation and the rollout TP/DP groups (spec §2).

Every rank runs the same program. Rollout tensor-parallel groups are blocks of consecutive ranks;
the orthogonal DP groups take one rank from each TP group:

    world 8, tp 2:  TP [0,1] [2,3] [4,5] [6,7]   DP [0,2,4,6] [1,3,5,7]

With several nodes a TP group must lie within one node (its all-reduces run at every decoding
step): :meth:`tidal.distributed.topology.Topology.check_tp`, on the topology gathered at start.

Works as one plain process (a world of one, no torchrun needed) and under
``torchrun --nproc_per_node N`` (gloo on CPU, NCCL on CUDA).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket

import torch
import torch.distributed as dist

from tidal.config_base import ConfigError
from tidal.distributed.topology import Topology


@dataclasses.dataclass(kw_only=True)
class Runtime:
    """This rank's place in the world. ``tp_group``/``dp_group`` are the rollout groups it belongs to;
    ``cpu_group`` spans the world over gloo, for collectives on CPU tensors and Python objects
    (statistics, control flow) whatever the device backend; ``tp_cpu_group`` is the TP group over
    gloo (the rollout's control flow inside a TP group: which requests its engine runs next;
    ``tp_group`` itself when the backend is gloo).

    The host collectives below are the only ones the run's control flow uses (checkpoint agreement,
    the run directory's lock, the watchdog's session, the rollout's request exchange): all over the
    gloo groups, so none waits on the device. A world (or TP group) of one needs no group: each
    returns its own value without a call."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    tp_size: int
    tp_rank: int
    tp_group: dist.ProcessGroup
    dp_rank: int
    dp_size: int
    dp_group: dist.ProcessGroup
    cpu_group: dist.ProcessGroup
    tp_cpu_group: dist.ProcessGroup
    topology: Topology | None = None

    def __post_init__(self):
        if self.topology is None:
            self.topology = Topology.single_node(self.world_size)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def tp_ranks(self) -> list[int]:
        start = (self.rank // self.tp_size) * self.tp_size
        return list(range(start, start + self.tp_size))

    # ---- collectives on host values (gloo: no device sync) ---------------------------------------
    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Sum of each value over all ranks."""
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, group=self.cpu_group)
        return t.tolist()

    def all_reduce_max(self, values: list[float]) -> list[float]:
        """Max of each value over all ranks."""
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.cpu_group)
        return t.tolist()

    def barrier(self) -> None:
        """Every rank waits for all the others (over the world's gloo group)."""
        if self.world_size > 1:
            dist.barrier(group=self.cpu_group)

    def all_gather_objects(self, obj) -> list:
        """Every rank's picklable ``obj``, in rank order (over the world's gloo group)."""
        if self.world_size == 1:
            return [obj]
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.cpu_group)
        return out

    def broadcast_object(self, obj):
        """Rank 0's picklable ``obj`` on every rank (the others' ``obj`` is ignored)."""
        if self.world_size == 1:
            return obj
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def all_agree(self, ok: bool) -> bool:
        """True when ``ok`` holds on every rank."""
        if self.world_size == 1:
            return bool(ok)
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return bool(flag.item())

    def tp_gather_objects(self, obj) -> list:
        """Every rank of this rank's TP group's picklable ``obj``, in TP rank order (over
        ``tp_cpu_group``; a group of one makes no call)."""
        if self.tp_size == 1:
            return [obj]
        out: list = [None] * self.tp_size
        dist.all_gather_object(out, obj, group=self.tp_cpu_group)
        return out


def rollout_group_ranks(world_size: int, tp_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """Return (tp_groups, dp_groups) rank lists for a world, as in spec §2.2. The one check of
    ``engine.tp_size`` against the world (ConfigError naming it)."""
    if 1 <= world_size < tp_size:
        raise ConfigError("engine.tp_size", f"{tp_size} needs at least {tp_size} ranks, one per device (this run has "
                          f"WORLD_SIZE={world_size}): launch with torchrun --nproc_per_node {tp_size}, or lower engine.tp_size")
    if tp_size < 1 or world_size % tp_size != 0:
        raise ConfigError(
            "engine.tp_size",
            f"WORLD_SIZE % engine.tp_size != 0 ({world_size} % {tp_size}); pick a tp_size that divides the number of ranks",
        )
    tp_groups = [list(range(s, s + tp_size)) for s in range(0, world_size, tp_size)]
    dp_groups = [list(range(i, world_size, tp_size)) for i in range(tp_size)]
    return tp_groups, dp_groups


def resolve_device(pref: str, local_rank: int, *, local_world_size: int = 1, tp_size: int = 1) -> torch.device:
    """This rank's device: CPU, or the CUDA device of its local rank (one GPU per rank). A node
    with fewer CUDA devices than its ranks is a ConfigError, before any process group exists: at
    ``engine.tp_size`` when a TP group needs more GPUs than the node has, else at ``run.device``."""
    if pref == "cpu" or (pref == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("run.device", f"{pref!r} but CUDA is not available; use run.device=cpu or auto")
    count = torch.cuda.device_count()
    if local_rank >= count:
        if tp_size > count:
            raise ConfigError("engine.tp_size", f"{tp_size} ranks per rollout TP group need {tp_size} GPUs, but this node has "
                              f"{count}; set engine.tp_size <= {count} and launch at most {count} ranks per node")
        raise ConfigError("run.device", f"local rank {local_rank} has no GPU of its own: this node has {count} CUDA "
                          f"device(s) for {local_world_size} ranks; launch with torchrun --nproc_per_node {count} (one rank per GPU)")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def cpu_threads(setting: int, local_world_size: int) -> int:
    """The intra-op threads of a rank that computes on CPU (``run.cpu_threads``).

    ``setting`` > 0 is taken as is; 0 means ``OMP_NUM_THREADS`` when it is set, else half this rank's
    share of the cores the process may use (``os.sched_getaffinity``), at least 1. Half, because
    torch's OpenMP threads wait for one another at the end of every op: on a machine whose other
    processes hold cores, one descheduled thread stalls the rest of the op (a step 20-40x slower on
    a busy 2-core machine with 2 threads than with 1). So a 2-core machine gets 1 thread, 16 cores
    with 2 ranks 4 each.
    """
    if setting > 0:
        return setting
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // (2 * max(1, local_world_size)))


def set_cpu_threads(setting: int, device: torch.device) -> None:
    """Set torch's intra-op threads by :func:`cpu_threads` when this rank computes on CPU (a CUDA
    rank's CPU threads are left as torch sets them)."""
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads(setting, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def _elastic_store(world_size: int, timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun's c10d rendezvous the workers share the agent's TCPStore, which outlives a
    ``--max-restarts`` restart with the previous attempt's keys in it, unprefixed: a restarted rank may
    read a dead peer's address and fail to connect ("Gloo connectFullMesh failed ... Connection
    refused"; pytorch/pytorch#135712). Each attempt's keys get their own prefix here. None when
    torchrun does not share its store (then env:// creates a fresh one)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False, timeout=timeout)
    return dist.PrefixStore(f"/tidal/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def init_runtime(tp_size: int, device: str = "auto", timeout_s: float = 1800.0) -> Runtime:
    """Initialise the default process group (if not yet) and build the rollout TP/DP groups.

    Under torchrun the rendezvous comes from the environment; as a plain process a world of one is
    created in memory (no ports are opened).
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    tp_groups, dp_groups = rollout_group_ranks(world_size, tp_size)
    dev = resolve_device(device, local_rank, local_world_size=local_world_size, tp_size=tp_size)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        # NCCL binds the rank to its device at init; without device_id every barrier guesses the
        # device and warns that the guess "can potentially cause a hang"
        kwargs = {"device_id": dev} if dev.type == "cuda" else {}
        if "MASTER_ADDR" in os.environ:
            store = _elastic_store(world_size, timeout)
            dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout, store=store, **kwargs)
        else:
            if world_size != 1:
                raise ValueError("WORLD_SIZE > 1 without MASTER_ADDR: launch with torchrun")
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, **kwargs)
    # new_group must be called by every rank for every group, in the same order.
    tp_group = dp_group = None
    for ranks in tp_groups:
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            tp_group = group
    tp_cpu_group = tp_group
    if backend != "gloo":  # the TP groups again over gloo, for the rollout's control messages
        for ranks in tp_groups:
            group = dist.new_group(ranks, timeout=timeout, backend="gloo")
            if rank in ranks:
                tp_cpu_group = group
    for ranks in dp_groups:
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            dp_group = group
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
    topology = gather_topology(world_size, cpu_group)
    topology.check_tp(tp_size)
    return Runtime(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        device=dev,
        backend=backend,
        tp_size=tp_size,
        tp_rank=rank % tp_size,
        tp_group=tp_group,
        dp_rank=rank // tp_size,
        dp_size=world_size // tp_size,
        dp_group=dp_group,
        cpu_group=cpu_group,
        tp_cpu_group=tp_cpu_group,
        topology=topology,
    )


def gather_topology(world_size: int, cpu_group: dist.ProcessGroup | None) -> Topology:
    """Every rank's node (torchrun's ``GROUP_RANK``; the host name where no launcher set it) and host
    name, gathered once over ``cpu_group`` (collective; a world of one makes no call)."""
    host = socket.gethostname()
    group = os.environ.get("GROUP_RANK")
    mine = (int(group) if group is not None else host, host)
    if world_size == 1:
        return Topology.from_ranks([mine])
    out: list = [None] * world_size
    dist.all_gather_object(out, mine, group=cpu_group)
    return Topology.from_ranks(out)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
