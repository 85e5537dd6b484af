"""Rearrangement plans: where every item is before and after a move.

A plan is pure bookkeeping (numpy, no torch, no ranks): for every item in the global
order (rank 0's items in local order, then rank 1's, ...) it records the rank and slot
the item comes from and the rank and slot it goes to. Every rank builds the same plan
from the same gathered lengths, so the split sizes of the all-to-all can be computed
locally and no size exchange is needed. Plans compose, which lets encoder outputs go
straight from an encoder layout to the LLM layout in one move.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

import orchmllm._core as _core

__all__ = ["Rearrangement", "RankSchedule", "expand_rows"]


_FIELDS = ("src_rank", "src_slot", "dst_rank", "dst_slot")


def _as_index_array(name: str, values: object) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if (
        arr.size
        and not np.issubdtype(arr.dtype, np.integer)
        and (not np.all(np.isfinite(arr)) or not np.all(arr == np.round(arr)))
    ):
        raise ValueError(f"{name} must hold integers, got {arr[:8]!r}")
    return arr.astype(np.int64, copy=True)


def _check_ranks(name: str, ranks: np.ndarray, num_ranks: int) -> None:
    bad = (ranks < 0) | (ranks >= num_ranks)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{name}[{i}] = {int(ranks[i])} is outside [0, {num_ranks})")


def _check_slots(name: str, ranks: np.ndarray, slots: np.ndarray, num_ranks: int) -> None:
    """Slots on each rank must be exactly 0..count-1 (a permutation)."""
    if slots.size and slots.min() < 0:
        raise ValueError(f"{name} has a negative slot: {int(slots.min())}")
    counts = np.bincount(ranks, minlength=num_ranks)
    if slots.size and np.any(slots >= counts[ranks]):
        i = int(np.flatnonzero(slots >= counts[ranks])[0])
        raise ValueError(
            f"{name}[{i}] = {int(slots[i])} but rank {int(ranks[i])} holds {int(counts[ranks[i]])}"
        )
    # Each (rank, slot) as one index into 0..n-1; a permutation iff every index appears once.
    first = np.cumsum(counts) - counts
    if slots.size and np.any(np.bincount(first[ranks] + slots, minlength=slots.size) != 1):
        raise ValueError(f"{name} assigns two items to the same (rank, slot)")


def expand_rows(starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Row indices ``concat(arange(s, s + n) for s, n in zip(starts, sizes))``."""
    starts = np.asarray(starts, dtype=np.int64)
    sizes = np.asarray(sizes, dtype=np.int64)
    total = int(sizes.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    item_first = np.cumsum(sizes) - sizes  # first output row of each item
    return np.repeat(starts - item_first, sizes) + np.arange(total, dtype=np.int64)


@dataclass(frozen=True)
class RankSchedule:
    """What one rank does in a move, in rows of a row-major buffer.

    Built by :meth:`Rearrangement.schedule`: gather ``send_index``, one all-to-all with these
    splits, gather ``recv_index``.

    Attributes:
        send_index: int64 rows of the local input (source-slot order) in send order (grouped
            by destination peer), or None when the input is already in send order.
        send_splits: int64 ``(num_ranks,)`` rows sent to each peer (this rank included).
        recv_splits: int64 ``(num_ranks,)`` rows received from each peer (this rank included).
        recv_index: int64 rows of the received buffer (grouped by source peer) in
            destination-slot order, or None when already so.
    """

    send_index: np.ndarray | None
    send_splits: np.ndarray
    recv_splits: np.ndarray
    recv_index: np.ndarray | None

    @property
    def num_send_rows(self) -> int:
        """Rows this rank sends in all, itself included (the send buffer's length)."""
        return int(self.send_splits.sum())

    @property
    def num_recv_rows(self) -> int:
        """Rows this rank receives in all, itself included (the receive buffer's length)."""
        return int(self.recv_splits.sum())


def _in_slot_order(ranks: np.ndarray, slots: np.ndarray, rank: int) -> np.ndarray:
    """Ids of the items on ``rank`` (one side of a plan), in slot order."""
    ids = np.flatnonzero(ranks == rank)
    return ids[np.argsort(slots[ids], kind="stable")]


def _identity_or(index: np.ndarray) -> np.ndarray | None:
    return None if np.array_equal(index, np.arange(index.size)) else index


@dataclass(frozen=True, eq=False)
class Rearrangement:
    """Source and destination (rank, slot) of every item, in global item order.

    Slots on a rank are positions in that rank's local order. Build one with
    :meth:`from_assignment`; the constructor validates that slots on every rank are a
    permutation of ``0..count-1`` on both sides. Arrays are stored as read-only int64 copies.

    Attributes:
        num_ranks: number of ranks the items move among, an integer >= 1.
        src_rank: int64 ``(n,)`` rank holding each item before the move.
        src_slot: int64 ``(n,)`` each item's position in its source rank's local order.
        dst_rank: int64 ``(n,)`` rank holding each item after the move.
        dst_slot: int64 ``(n,)`` each item's position in its destination rank's local order.

    Raises:
        ValueError: ``num_ranks`` is not an integer >= 1, an array is not 1-D integers or
            differs in size from ``src_rank``, a rank is outside ``[0, num_ranks)``, or the
            slots on a rank are not a permutation of ``0..count-1``.
    """

    num_ranks: int
    src_rank: np.ndarray
    src_slot: np.ndarray
    dst_rank: np.ndarray
    dst_slot: np.ndarray

    def __post_init__(self) -> None:
        if isinstance(self.num_ranks, bool) or not isinstance(self.num_ranks, (int, np.integer)):
            raise ValueError(f"num_ranks must be an integer, got {self.num_ranks!r}")
        if self.num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {self.num_ranks}")
        object.__setattr__(self, "num_ranks", int(self.num_ranks))
        arrays = {name: _as_index_array(name, getattr(self, name)) for name in _FIELDS}
        n = arrays["src_rank"].size
        for name, arr in arrays.items():
            if arr.size != n:
                raise ValueError(f"{name} has {arr.size} entries, src_rank has {n}")
        _check_ranks("src_rank", arrays["src_rank"], self.num_ranks)
        _check_ranks("dst_rank", arrays["dst_rank"], self.num_ranks)
        _check_slots("src_slot", arrays["src_rank"], arrays["src_slot"], self.num_ranks)
        _check_slots("dst_slot", arrays["dst_rank"], arrays["dst_slot"], self.num_ranks)
        for name, arr in arrays.items():
            arr.setflags(write=False)
            object.__setattr__(self, name, arr)

    # -- construction -------------------------------------------------------------------

    @classmethod
    def _valid(cls, num_ranks: int, *arrays: np.ndarray) -> Rearrangement:
        """A plan valid by construction (``from_assignment``, or the inverse or composition
        of valid plans): skips ``__post_init__``'s checks, which cost more than building the
        plan at 10^5-10^6 items. ``arrays`` in field order, int64 (shared, made read-only)."""
        plan = object.__new__(cls)
        object.__setattr__(plan, "num_ranks", int(num_ranks))
        for name, arr in zip(_FIELDS, arrays, strict=True):
            arr.setflags(write=False)
            object.__setattr__(plan, name, arr)
        return plan

    @classmethod
    def from_assignment(cls, src: object, dst: object, *, num_ranks: int) -> Rearrangement:
        """Plan that sends item ``i`` from rank ``src[i]`` to rank ``dst[i]``.

        Source slots follow the global order within each source rank. Destination slots
        are ordered by (source rank, source slot), so the receiver gets its items in the
        order of the global gather and needs no reordering after the all-to-all.

        Args:
            src: rank holding each item now, 1-D integers in global item order.
            dst: rank each item goes to, same size as ``src``.
            num_ranks: number of ranks, an integer >= 1.

        Returns:
            The plan (valid by construction, so not checked again).

        Raises:
            ValueError: ``num_ranks`` is not an integer >= 1, ``src`` or ``dst`` is not 1-D
                integers, their sizes differ, or a rank is outside ``[0, num_ranks)``.
        """
        if isinstance(num_ranks, bool) or not isinstance(num_ranks, (int, np.integer)):
            raise ValueError(f"num_ranks must be an integer, got {num_ranks!r}")
        if num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
        src_arr = _as_index_array("src", src)
        dst_arr = _as_index_array("dst", dst)
        if src_arr.size != dst_arr.size:
            raise ValueError(f"dst has {dst_arr.size} entries, src has {src_arr.size}")
        _check_ranks("src", src_arr, num_ranks)
        _check_ranks("dst", dst_arr, num_ranks)
        src_slot, dst_slot = _core.plan_slots(src_arr, dst_arr, int(num_ranks))
        return cls._valid(num_ranks, src_arr, src_slot, dst_arr, dst_slot)

    @classmethod
    def identity(cls, src: object, *, num_ranks: int) -> Rearrangement:
        """Plan that leaves every item where it is.

        Args:
            src: rank holding each item, 1-D integers in global item order.
            num_ranks: number of ranks, an integer >= 1.

        Returns:
            The plan with ``dst_rank == src_rank`` and ``dst_slot == src_slot``.

        Raises:
            ValueError: as :meth:`from_assignment`.
        """
        return cls.from_assignment(src, src, num_ranks=num_ranks)

    # -- algebra ------------------------------------------------------------------------

    @property
    def num_items(self) -> int:
        """Number of items in the plan, moved or not."""
        return int(self.src_rank.size)

    def inverse(self) -> Rearrangement:
        """Plan that moves every item back to where it came from.

        Returns:
            The plan with source and destination swapped (sharing this plan's arrays).
        """
        return self._valid(
            self.num_ranks, self.dst_rank, self.dst_slot, self.src_rank, self.src_slot
        )

    def compose(self, other: Rearrangement) -> Rearrangement:
        """``self`` after ``other``: items go from other's source to self's destination.

        Both plans describe the same items (same global ids) and other's destination must
        be self's source, e.g. ``llm_plan.compose(enc_plan.inverse())`` moves encoder
        outputs from the encoder layout straight to the LLM layout.

        Args:
            other: the plan applied first; its destination (rank, slot) of every item must be
                this plan's source.

        Returns:
            The plan from ``other``'s source to this plan's destination.

        Raises:
            ValueError: ``other`` is not a :class:`Rearrangement`, has another ``num_ranks``
                or item count, or puts an item elsewhere than this plan takes it from.
        """
        if not isinstance(other, Rearrangement):
            raise ValueError(f"other must be a Rearrangement, got {type(other).__name__}")
        if other.num_ranks != self.num_ranks:
            raise ValueError(f"other.num_ranks = {other.num_ranks}, expected {self.num_ranks}")
        if other.num_items != self.num_items:
            raise ValueError(f"other has {other.num_items} items, expected {self.num_items}")
        mismatch = (other.dst_rank != self.src_rank) | (other.dst_slot != self.src_slot)
        if mismatch.any():
            i = int(np.flatnonzero(mismatch)[0])
            raise ValueError(
                f"other puts item {i} at (rank {int(other.dst_rank[i])}, slot "
                f"{int(other.dst_slot[i])}) but self takes it from (rank "
                f"{int(self.src_rank[i])}, slot {int(self.src_slot[i])})"
            )
        return self._valid(
            self.num_ranks, other.src_rank, other.src_slot, self.dst_rank, self.dst_slot
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Rearrangement):
            return NotImplemented
        return self.num_ranks == other.num_ranks and all(
            np.array_equal(getattr(self, k), getattr(other, k))
            for k in ("src_rank", "src_slot", "dst_rank", "dst_slot")
        )

    __hash__ = None  # type: ignore[assignment]

    def fingerprint(self) -> int:
        """A 63-bit digest of the plan, equal on ranks that computed the same plan.

        Cheap to compare across ranks to check that they all planned alike.

        Returns:
            A non-negative int below ``2**63`` (blake2b of ``num_ranks`` and the four arrays).
        """
        h = hashlib.blake2b(digest_size=8)
        h.update(np.int64(self.num_ranks).tobytes())
        for arr in (self.src_rank, self.src_slot, self.dst_rank, self.dst_slot):
            h.update(np.ascontiguousarray(arr).tobytes())
        return int.from_bytes(h.digest(), "little") >> 1

    # -- per-rank views -----------------------------------------------------------------

    def _check_rank(self, rank: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)):
            raise ValueError(f"rank must be an integer, got {rank!r}")
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank = {rank} is outside [0, {self.num_ranks})")
        return int(rank)

    def _sizes(self, sizes: object | None) -> np.ndarray:
        if sizes is None:
            return np.ones(self.num_items, dtype=np.int64)
        arr = _as_index_array("sizes", sizes)
        if arr.size != self.num_items:
            raise ValueError(f"sizes has {arr.size} entries, plan has {self.num_items} items")
        if arr.size and arr.min() < 0:
            raise ValueError(f"sizes must be >= 0, got {int(arr.min())}")
        return arr

    def items_at(self, rank: int) -> np.ndarray:
        """Global ids of the items ``rank`` holds after the move, in destination-slot order.

        Args:
            rank: the rank, an integer in ``[0, num_ranks)``.

        Returns:
            int64 global item ids; entry ``k`` is the item in destination slot ``k``.

        Raises:
            ValueError: ``rank`` is not an integer in ``[0, num_ranks)``.
        """
        return _in_slot_order(self.dst_rank, self.dst_slot, self._check_rank(rank))

    def source_items_at(self, rank: int) -> np.ndarray:
        """Global ids of the items ``rank`` holds before the move, in source-slot order.

        Args:
            rank: the rank, an integer in ``[0, num_ranks)``.

        Returns:
            int64 global item ids; entry ``k`` is the item in source slot ``k``.

        Raises:
            ValueError: ``rank`` is not an integer in ``[0, num_ranks)``.
        """
        return _in_slot_order(self.src_rank, self.src_slot, self._check_rank(rank))

    def count_matrix(self, *, sizes: object | None = None) -> np.ndarray:
        """``M[s, t]`` = items (or sum of ``sizes``) moving from rank s to rank t.

        Args:
            sizes: weight of every item (e.g. tokens or rows), non-negative integers, one per
                item; None counts items.

        Returns:
            int64 ``(num_ranks, num_ranks)``; the diagonal holds what stays on its rank.

        Raises:
            ValueError: ``sizes`` is not 1-D non-negative integers with one entry per item.
        """
        w = self._sizes(sizes)
        flat = self.src_rank * self.num_ranks + self.dst_rank
        m = np.bincount(flat, weights=w, minlength=self.num_ranks**2)
        return np.rint(m).astype(np.int64).reshape(self.num_ranks, self.num_ranks)

    def send_counts(self, rank: int, *, sizes: object | None = None) -> np.ndarray:
        """Items (or tokens, with ``sizes``) that ``rank`` sends to each peer (self included).

        Args:
            rank: the sending rank, an integer in ``[0, num_ranks)``.
            sizes: weight of every item, as in :meth:`count_matrix`; None counts items.

        Returns:
            int64 ``(num_ranks,)``: row ``rank`` of :meth:`count_matrix`.

        Raises:
            ValueError: a bad ``rank`` or ``sizes``.
        """
        rank = self._check_rank(rank)
        return self.count_matrix(sizes=sizes)[rank]

    def recv_counts(self, rank: int, *, sizes: object | None = None) -> np.ndarray:
        """Items (or tokens, with ``sizes``) that ``rank`` receives from each peer.

        Args:
            rank: the receiving rank, an integer in ``[0, num_ranks)``.
            sizes: weight of every item, as in :meth:`count_matrix`; None counts items.

        Returns:
            int64 ``(num_ranks,)``: column ``rank`` of :meth:`count_matrix` (self included).

        Raises:
            ValueError: a bad ``rank`` or ``sizes``.
        """
        rank = self._check_rank(rank)
        return self.count_matrix(sizes=sizes)[:, rank]

    def traffic(self, *, sizes: object | None = None, ranks_per_node: int | None = None) -> dict:
        """Volume that leaves its rank, split into intra- and inter-node.

        Items that stay are not counted as moved (only as ``kept``).

        Args:
            sizes: weight of every item (e.g. tokens), as in :meth:`count_matrix`; None counts
                items.
            ranks_per_node: ranks per node, rank ``r`` on node ``r // ranks_per_node``; None
                puts every rank on one node.

        Returns:
            A dict of ints: ``intra`` and ``inter`` (volume moved within and across nodes),
            ``kept`` (volume that stays on its rank), ``max_sent_rank`` and ``max_recv_rank``
            (the most any one rank sends to or receives from other ranks).

        Raises:
            ValueError: ``ranks_per_node`` is not a positive integer, or a bad ``sizes``.
        """
        if ranks_per_node is not None and (
            isinstance(ranks_per_node, bool)
            or not isinstance(ranks_per_node, (int, np.integer))
            or ranks_per_node < 1
        ):
            raise ValueError(f"ranks_per_node must be a positive integer, got {ranks_per_node!r}")
        w = self._sizes(sizes)
        moved = self.src_rank != self.dst_rank
        rpn = ranks_per_node or self.num_ranks
        inter = moved & (self.src_rank // rpn != self.dst_rank // rpn)
        sent = np.bincount(self.src_rank[moved], weights=w[moved], minlength=self.num_ranks)
        recv = np.bincount(self.dst_rank[moved], weights=w[moved], minlength=self.num_ranks)
        return {
            "intra": int(w[moved & ~inter].sum()),
            "inter": int(w[inter].sum()),
            "kept": int(w[~moved].sum()),
            "max_sent_rank": int(np.rint(sent.max())),
            "max_recv_rank": int(np.rint(recv.max())),
        }

    def schedule(self, rank: int, *, sizes: object | None = None) -> RankSchedule:
        """Row bookkeeping for ``rank`` moving a buffer with ``sizes[i]`` rows per item.

        The sender orders its items by (destination rank, destination slot); the receiver
        therefore gets them grouped by source peer, each group in destination-slot order,
        and reorders to destination-slot order (a no-op for ``from_assignment`` plans).

        Args:
            rank: the rank whose part of the move this is, an integer in ``[0, num_ranks)``.
            sizes: rows of every item in the buffer (e.g. tokens of a packed sequence buffer),
                non-negative integers, one per item; None is one row per item.

        Returns:
            The :class:`RankSchedule` of ``rank``.

        Raises:
            ValueError: a bad ``rank`` or ``sizes``.
        """
        rank = self._check_rank(rank)
        w = self._sizes(sizes)
        # Sender: local items in source-slot order, rows start at cumulative offsets.
        local = self.source_items_at(rank)
        offset = np.zeros(self.num_items, dtype=np.int64)
        offset[local] = np.cumsum(w[local]) - w[local]
        send_ids = local[np.lexsort((self.dst_slot[local], self.dst_rank[local]))]
        send_index = expand_rows(offset[send_ids], w[send_ids])
        send_splits = np.bincount(
            self.dst_rank[send_ids], weights=w[send_ids], minlength=self.num_ranks
        )
        # Receiver: buffer grouped by source peer, each group in destination-slot order.
        incoming = np.flatnonzero(self.dst_rank == rank)
        recv_ids = incoming[np.lexsort((self.dst_slot[incoming], self.src_rank[incoming]))]
        offset[recv_ids] = np.cumsum(w[recv_ids]) - w[recv_ids]
        final = self.items_at(rank)
        recv_index = expand_rows(offset[final], w[final])
        recv_splits = np.bincount(
            self.src_rank[recv_ids], weights=w[recv_ids], minlength=self.num_ranks
        )
        return RankSchedule(
            send_index=_identity_or(send_index),
            send_splits=np.rint(send_splits).astype(np.int64),
            recv_splits=np.rint(recv_splits).astype(np.int64),
            recv_index=_identity_or(recv_index),
        )
