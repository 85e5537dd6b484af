"""The process groups of one data-parallel job, built once and passed down.

Post-balancing talks on two groups over the same ranks: the training group, where examples
and encoder outputs move (NCCL in production), and a CPU (gloo) group, where metadata is
gathered and non-deterministic plans are broadcast, so a loader can plan in a background
thread beside GPU traffic. Opening a gloo group per loader or dispatcher leaks threads and
sockets (every group holds its own), so one :class:`Topology` owns them and every user of the
library's distributed parts (``BatchDispatcher``, ``Orchestrator``, ``BalancedDataLoader``)
takes it. ``ranks_per_node`` lives here too: node-wise placement and the intra/inter-node
byte counts need it.

Data parallelism is the one axis today. A sequence- or tensor-parallel axis would be another
group here (built from a device mesh), with ``group`` the data-parallel one the balancer
moves examples across.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

__all__ = ["Topology"]

DEFAULT_TIMEOUT_S = 600.0


@dataclass
class Topology:
    """``group``: the data-parallel group (None: the default group); ``meta_group``: a gloo
    group over the same ranks, separate from ``group`` even when that is gloo, so metadata
    can be gathered in a background thread while training collectives run; ``ranks_per_node``:
    consecutive ranks per node (None: unknown, node-wise placement off); ``timeout``: seconds
    any one collective may wait. Build it with :meth:`build`."""

    group: dist.ProcessGroup | None
    meta_group: dist.ProcessGroup | None
    ranks_per_node: int | None
    timeout: float
    _owned: list[dist.ProcessGroup] = field(default_factory=list, repr=False)

    @classmethod
    def build(
        cls,
        *,
        group: dist.ProcessGroup | None = None,
        meta_group: dist.ProcessGroup | None = None,
        ranks_per_node: int | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> Topology:
        """The topology over ``group``'s ranks. Creates the gloo metadata group when
        ``meta_group`` is None: a collective, so every rank builds its topologies together and
        in the same order (:meth:`close`, or dropping the topology, destroys it)."""
        if not (isinstance(timeout, int | float) and not isinstance(timeout, bool)) or not (
            timeout > 0
        ):
            raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        if ranks_per_node is not None and (
            not isinstance(ranks_per_node, int)
            or isinstance(ranks_per_node, bool)
            or ranks_per_node < 1
        ):
            raise ValueError(f"ranks_per_node must be a positive integer, got {ranks_per_node!r}")
        if not (dist.is_available() and dist.is_initialized()):
            return cls(None, None, ranks_per_node, float(timeout))
        owned: list[dist.ProcessGroup] = []
        if meta_group is None:
            ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
            meta_group = dist.new_group(ranks, backend="gloo", timeout=timedelta(seconds=timeout))
            # Return only once every rank has connected: a rank dropping this topology at once
            # would otherwise destroy the group under a peer still connecting to it.
            dist.barrier(group=meta_group)
            owned.append(meta_group)
        elif dist.get_backend(meta_group) != "gloo":
            raise ValueError(
                f"meta_group must be a gloo group, got backend {dist.get_backend(meta_group)!r}"
            )
        topology = cls(group, meta_group, ranks_per_node, float(timeout), owned)
        weakref.finalize(topology, _destroy, owned)  # a dropped topology frees its group
        return topology

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if self.distributed else 0

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group) if self.distributed else 1

    def close(self) -> None:
        """Destroy the groups this topology created (idempotent; every rank calls it)."""
        _destroy(self._owned)


def _destroy(groups: list[dist.ProcessGroup]) -> None:
    while groups:
        group = groups.pop()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group(group)
