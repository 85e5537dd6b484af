"""The one path by which items move between ranks by a plan, shared by every mover.

:class:`~orchmllm.dist.dispatcher.BatchDispatcher` moves tensors with it on the data-parallel
group (its ``dispatch`` and ``undo``); the balanced loader (``mode="move"``) and the
collator move pickled examples with it on the gloo metadata group. Each mover gathers its
own metadata (what it must agree on differs); from the plan on, the path is this one: the
same plan on every rank, one all-to-all per wire dtype, the inverse plan back, and a failed
collective named by the ranks that did not answer a roll call.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from orchmllm.dist import comm
from orchmllm.dist.agreement import PeerFailed, agreed_plan
from orchmllm.dist.topology import Topology
from orchmllm.planner.plan import Rearrangement

__all__ = ["CHUNK", "MovePath", "ranks_text"]

CHUNK = 64  # bytes per row when pickled objects move (padding <= 63 bytes per object)
T = TypeVar("T")


def ranks_text(ranks: Sequence[int], limit: int = 8) -> str:
    """``[0, 3]``, or the first ``limit`` and a count, so a message stays short at scale."""
    ranks = [int(r) for r in ranks]
    if len(ranks) <= limit:
        return str(ranks)
    return f"[{', '.join(map(str, ranks[:limit]))}, ...] ({len(ranks)} ranks)"


class MovePath:
    """The one path by which items move between ranks by a plan, for every mover.

    :class:`~orchmllm.dist.dispatcher.BatchDispatcher` moves tensors on the data-parallel group
    with it; the balanced loader (``mode="move"``) and collator move pickled examples on the
    gloo metadata group (:meth:`move_objects`). Every rank uses the same plan (:meth:`plan`);
    the items go in one all-to-all per wire dtype (:meth:`move`) and come back by the inverse
    plan (:meth:`move_back`, which is also a move's backward); a collective that fails is
    named with the ranks that did not answer a roll call (:meth:`absent`).

    Args:
        topology: the job's process groups, read at each use and never kept (closing the
            topology frees them).
        on: ``"data"``: items move on the data-parallel group; ``"meta"``: on the gloo
            metadata group.

    Raises:
        ValueError: another ``on``.
    """

    def __init__(self, topology: Topology, *, on: str = "data") -> None:
        if on not in ("data", "meta"):
            raise ValueError(f"on must be 'data' or 'meta', got {on!r}")
        self.topology, self.on = topology, on
        self.distributed = dist.is_available() and dist.is_initialized()

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The group the items move on."""
        return self.topology.meta_group if self.on == "meta" else self.topology.group

    def plan(self, compute: Callable[[], T], *, deterministic: bool) -> T:
        """``compute()``, the same on every rank: computed on each rank when it is a function
        of what they all hold (``deterministic``), else on rank 0 and broadcast on the
        metadata group (:func:`~orchmllm.dist.agreement.agreed_plan`).

        Args:
            compute: makes the plan.
            deterministic: whether every rank computes the same plan by itself.

        Returns:
            The plan (rank 0's when not ``deterministic``).
        """
        group, timeout = self.topology.meta_group, self.topology.timeout
        return agreed_plan(compute, deterministic=deterministic, group=group, timeout=timeout)

    def move(
        self, plan: Rearrangement, tensors: Sequence[torch.Tensor], sizes: Sequence[object]
    ) -> list[torch.Tensor]:
        """Move this rank's items' rows by ``plan`` (:func:`orchmllm.dist.comm.move_many`).

        Args:
            plan: the plan, the same on every rank.
            tensors: this rank's items' rows, in source-slot order, one tensor per field.
            sizes: per tensor, the rows of each item in global order.

        Returns:
            The rows of this rank's items after the move, in destination-slot order.
        """
        timeout = self.topology.timeout
        return comm.move_many(plan, tensors, sizes, group=self.group, timeout=timeout)

    def move_back(
        self, plan: Rearrangement, tensors: Sequence[torch.Tensor], sizes: Sequence[object]
    ) -> list[torch.Tensor]:
        """Undo :meth:`move`: rows on the moved layout return by the inverse plan.

        Args:
            plan: the plan the items moved by.
            tensors: rows on the moved layout (destination-slot order).
            sizes: per tensor, the rows of each item in global order.

        Returns:
            The rows in this rank's original layout and item order.
        """
        return self.move(plan.inverse(), tensors, sizes)

    def move_objects(
        self, plan: Rearrangement, blobs: Sequence[bytes], nbytes: np.ndarray
    ) -> tuple[list[Any], int]:
        """Move this rank's pickled objects by ``plan``.

        Each object travels as whole rows of ``CHUNK`` bytes (the last one zero-padded), so
        the all-to-all indexes rows, not single bytes; ``nbytes`` (every item's size in
        global order, known to every rank) replaces a size exchange.

        Args:
            plan: the plan, the same on every rank.
            blobs: this rank's objects, pickled, in source-slot order.
            nbytes: every item's pickled size, in global order.

        Returns:
            (the objects this rank holds after the move, in destination-slot order; the
            payload bytes this rank sent to other ranks).
        """
        rank = dist.get_rank(self.group) if self.distributed else 0
        rows = -(-np.asarray(nbytes, dtype=np.int64) // CHUNK)
        mine = plan.items_at(rank)
        leaving = (plan.src_rank == rank) & (plan.dst_rank != rank)
        sent = int(rows[leaving].sum()) * CHUNK
        if not self.distributed:
            received = b"".join(blobs)
            ends = np.cumsum(nbytes[mine])
            starts = ends - nbytes[mine]
        else:  # every local object in source-slot order, each padded to whole rows
            buf = bytearray(int(sum(-(-len(b) // CHUNK) for b in blobs)) * CHUNK)
            offset = 0
            for blob in blobs:
                buf[offset : offset + len(blob)] = blob
                offset += -(-len(blob) // CHUNK) * CHUNK
            send = (
                torch.frombuffer(buf, dtype=torch.uint8)
                if buf
                else torch.zeros(0, dtype=torch.uint8)
            )
            received = self.move(plan, [send.view(-1, CHUNK)], [rows])[0].numpy().tobytes()
            starts = (np.cumsum(rows[mine]) - rows[mine]) * CHUNK
            ends = starts + nbytes[mine]
        view = memoryview(received)
        return [pickle.loads(view[a:b]) for a, b in zip(starts, ends, strict=True)], sent

    def absent(self, exc: BaseException, *, call: str, what: str) -> PeerFailed | None:
        """After the collective ``what`` failed with ``exc``: a roll call named ``call`` (the
        same on every rank, unique in the job) on the moving group; the error naming the
        ranks that did not answer, or None when every rank did (``exc`` is then the error).

        Args:
            exc: the collective's error.
            call: the roll call's name.
            what: the collective, as the error names it.

        Returns:
            A :class:`~orchmllm.dist.agreement.PeerFailed` naming the absent ranks, or None.
        """
        if not self.distributed:
            return None
        timeout = self.topology.timeout
        missing = comm.roll_call(self.group, call=call, timeout=timeout)
        if not missing:
            return None
        return PeerFailed(comm.absent_message(what, exc, ranks_text(missing), timeout=timeout))
