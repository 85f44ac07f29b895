"""Which node each rank runs on, and the settings that must respect node boundaries.

torchrun numbers its ranks node by node: the agent of node ``g`` (``GROUP_RANK``) starts
``LOCAL_WORLD_SIZE`` workers whose global ranks are consecutive. A :class:`Topology` is that map,
built once at start from what every rank says about itself (its ``GROUP_RANK`` and host name:
:func:`tidal.distributed.runtime.init_runtime` gathers them), so every rank holds the same one:

    2 nodes x 4 ranks:  node 0 (host a) ranks 0-3, node 1 (host b) ranks 4-7

Nodes are told apart by ``GROUP_RANK``, not by host name: two agents on one host (simulated
nodes, or a fat host split in two) are two nodes. A launcher that sets no ``GROUP_RANK`` (ranks
started by ``srun`` or ``mpirun`` with ``RANK``/``WORLD_SIZE`` of their own) gets one node per host. Every node runs the same number of ranks (the
2-D device mesh of hybrid sharding and the node-local rollout TP groups need it).

What it decides: whether rollout TP groups (blocks of ``engine.tp_size`` consecutive ranks) stay
within a node (:meth:`Topology.check_tp`), and how many ranks shard a model (``strategy.shard``,
:meth:`Topology.shard_size`). It does not build process groups.
"""

from __future__ import annotations

import dataclasses
from typing import Hashable, Sequence

from tidal.config_base import ConfigError


@dataclasses.dataclass(frozen=True, kw_only=True)
class Topology:
    """``nodes[g]``: the (consecutive) global ranks of node ``g``; ``hosts[g]``: its host name."""

    nodes: tuple[tuple[int, ...], ...]
    hosts: tuple[str, ...]

    @classmethod
    def single_node(cls, world_size: int, host: str = "") -> "Topology":
        """Every rank on one node (a plain process, ``torchrun --standalone``)."""
        return cls(nodes=(tuple(range(world_size)),), hosts=(host,))

    @classmethod
    def regular(cls, num_nodes: int, ranks_per_node: int) -> "Topology":
        """``num_nodes`` nodes of ``ranks_per_node`` ranks each, hosts unnamed (for the memory plan)."""
        return cls(nodes=tuple(tuple(range(g * ranks_per_node, (g + 1) * ranks_per_node)) for g in range(num_nodes)),
                   hosts=("",) * num_nodes)

    @classmethod
    def from_ranks(cls, per_rank: Sequence[tuple[Hashable, str]]) -> "Topology":
        """From ``(node key, host name)`` of every rank, in rank order (the key: torchrun's
        ``GROUP_RANK``, or the host name under a launcher that sets none); nodes are numbered by
        their first rank. ValueError when a node's ranks are not consecutive or the nodes run
        different numbers of ranks."""
        nodes: dict[Hashable, list[int]] = {}
        hosts: dict[Hashable, str] = {}
        for rank, (node, host) in enumerate(per_rank):
            nodes.setdefault(node, []).append(rank)
            hosts.setdefault(node, host)
        ordered = list(nodes.values())  # by first rank (dicts keep insertion order)
        for ranks in ordered:
            if ranks != list(range(ranks[0], ranks[0] + len(ranks))):
                raise ValueError(f"ranks {ranks} share a node (GROUP_RANK) but are not consecutive; launch with torchrun, "
                                 "which numbers the ranks node by node")
        sizes = sorted({len(r) for r in ordered})
        if len(sizes) > 1:
            raise ValueError(f"the nodes run different numbers of ranks ({', '.join(str(len(r)) for r in ordered)}); launch "
                             "every node with the same torchrun --nproc_per_node")
        return cls(nodes=tuple(tuple(r) for r in ordered), hosts=tuple(hosts.values()))

    @property
    def world_size(self) -> int:
        return sum(len(r) for r in self.nodes)

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def ranks_per_node(self) -> int:
        return len(self.nodes[0])

    def node_of(self, rank: int) -> int:
        """The node index (``GROUP_RANK`` order) of global ``rank``."""
        return rank // self.ranks_per_node

    def host_of(self, rank: int) -> str:
        return self.hosts[self.node_of(rank)]

    def check_tp(self, tp_size: int) -> None:
        """Rollout TP groups (blocks of ``tp_size`` consecutive ranks) lie within one node each: a
        TP group's all-reduces run every decoding step and must not cross the network. ConfigError
        at ``engine.tp_size`` otherwise."""
        per_node = self.ranks_per_node
        if self.num_nodes > 1 and per_node % tp_size != 0:
            first = next(s for s in range(0, self.world_size, tp_size) if self.node_of(s) != self.node_of(s + tp_size - 1))
            group = list(range(first, first + tp_size))
            raise ConfigError("engine.tp_size", f"{tp_size} would make the rollout TP group {group} span nodes "
                              f"{self.node_of(group[0])} and {self.node_of(group[-1])} ({per_node} ranks per node); pick an "
                              f"engine.tp_size that divides the ranks per node ({per_node})")

    def shard_size(self, setting: str | int, *, key: str = "strategy.shard") -> int:
        """The number of consecutive ranks that shard a model (``strategy.shard``): ``world`` all of
        them; ``node`` the ranks of one node; ``auto`` a node's when there are several nodes, else the
        world's; an integer ``N`` that many (it must divide the world). The other ranks hold
        replicas: ``world_size / shard_size`` of them (hybrid sharding)."""
        if setting == "world" or (setting == "auto" and self.num_nodes == 1):
            return self.world_size
        if setting in ("node", "auto"):
            return self.ranks_per_node
        n = int(setting)
        if n < 1 or self.world_size % n != 0:
            raise ConfigError(key, f"{n} must divide the number of ranks ({self.world_size} = {self.num_nodes} node(s) x "
                              f"{self.ranks_per_node}); pick a divisor, or auto, world or node")
        return n

    def describe(self) -> str:
        """One line for the logs: ``2 nodes x 4 ranks (node 0: host a, ranks 0-3; node 1: ...)``."""
        parts = [f"node {g}: {self.hosts[g] or 'this host'}, ranks {r[0]}-{r[-1]}" if len(r) > 1 else
                 f"node {g}: {self.hosts[g] or 'this host'}, rank {r[0]}" for g, r in enumerate(self.nodes)]
        return (f"{self.num_nodes} node{'s' if self.num_nodes > 1 else ''} x {self.ranks_per_node} "
                f"rank{'s' if self.ranks_per_node > 1 else ''} ({'; '.join(parts)})")


def describe_sharding(shard_size: int, world_size: int) -> str:
    """``models sharded over 4 ranks, 2 replicas (hybrid)`` for the logs."""
    if shard_size == world_size:
        return f"models sharded over all {world_size} ranks"
    return f"models sharded over {shard_size} ranks, {world_size // shard_size} replicas (hybrid sharding)"
