"""One step of post-balancing on a CPU group: gather metadata, plan, move examples.

Shared by the prefetching loader and the collator wrapper. Each step starts with a 4-int
header per rank (status, item count, metadata width, fingerprint of the planner), so that a
rank that failed to prepare its batch, or has run out of data, tells the others instead of
leaving them waiting in a collective, and ranks that would plan differently (another policy,
cost model, placement or phase set) fail the step together with an error naming the ranks,
instead of moving data by plans that do not match: every rank leaves the step the same way.

Examples travel as pickled bytes in one all-to-all, by the move path the dispatcher uses
too (:meth:`orchmllm.dist.move_path.MovePath.move_objects`), so any example type works and the
user's collate function runs on the balanced set.

A rank that fails outside the exchange (its DataLoader raised before the collator was called,
its training step failed, it was killed) cannot tell the others through a header: their
header exchange fails ("Connection closed by peer", or a timeout). Then every rank that
noticed takes a roll call in the job's key-value store
(:meth:`~orchmllm.dist.move_path.MovePath.absent`) and the error names the ranks that did not
answer.
"""

from __future__ import annotations

import dataclasses
import pickle
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch.distributed as dist

from orchmllm.dist import comm, watch
from orchmllm.dist.agreement import PeerFailed
from orchmllm.dist.move_path import MovePath, ranks_text
from orchmllm.dist.topology import Topology
from orchmllm.planner.plan import Rearrangement

OK, EXHAUSTED, FAILED, CLOSED = 0, 1, 2, 3  # CLOSED: the loop left the epoch (see leave_epoch)
PAD = -1  # fills metadata rows shorter than the widest one
_INT64 = 8

Planner = Callable[[np.ndarray, np.ndarray, int], Any]
"""``planner(meta, src, num_ranks)``: meta (n, m) int64 rows in global order (rank 0's
items, then rank 1's, ...; shorter rows padded with -1), ``src`` the rank of each row.
Every rank calls it on the same input and must get the same plan, unless the planner has
``deterministic = False``: then only rank 0 calls it and broadcasts the result (see
:func:`agreed_plan`; a planner without the attribute counts as deterministic)."""


class EpochMismatch(RuntimeError):
    """Ranks left an epoch after different numbers of batches (raised on every rank)."""


@dataclass(frozen=True)
class Gathered:
    """Every rank's metadata for one step, identical on all ranks."""

    meta: np.ndarray  # (n, width) int64, global item order
    src: np.ndarray  # (n,) source rank of each item
    status: np.ndarray  # (world,) OK / EXHAUSTED per rank
    bytes_sent: int  # metadata bytes this rank sent (logical: its share times peers)


class Group:
    """The CPU group the loader talks on, or a single process without torch.distributed."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology  # held: dropping a topology destroys the groups it created
        self.timeout = topology.timeout
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(topology.meta_group) if self.distributed else 0
        self.size = dist.get_world_size(topology.meta_group) if self.distributed else 1
        self.path = MovePath(topology, on="meta")  # plans agreed and examples moved on it

    @property
    def group(self) -> dist.ProcessGroup | None:
        """Read from the topology at each use, never kept: closing the topology frees it."""
        return self.topology.meta_group

    def all_gather_fixed(self, vec: Sequence[int]) -> np.ndarray:
        arr = np.asarray(vec, dtype=np.int64).reshape(1, -1)
        if not self.distributed:
            return arr
        return comm.all_gather_fixed(arr[0], group=self.group, timeout=self.timeout)

    def all_gather_rows(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if not self.distributed:
            return rows, np.zeros(rows.shape[0], dtype=np.int64)
        return comm.all_gather_rows(rows, group=self.group, timeout=self.timeout)


def planner_signature(planner: object) -> object:
    """What decides a planner's plans, comparable across processes: its ``signature``
    attribute, else a dataclass planner itself (its repr lists its options), else the
    qualified name of its type or function."""
    signature = getattr(planner, "signature", None)
    if signature is not None:
        return signature
    if dataclasses.is_dataclass(planner):
        return planner
    named = planner if hasattr(planner, "__qualname__") else type(planner)
    return f"{named.__module__}.{named.__qualname__}"


def planner_at(planner: Planner, epoch: int, step: int) -> Planner:
    """The planner of ``step`` of ``epoch``: ``planner.at(epoch, step)`` for a planner that
    changes during a run (costs learned from it), else ``planner`` itself. Such a planner
    schedules each change from a step every rank names alike, so all plan a step alike."""
    at = getattr(planner, "at", None)
    return planner if at is None else at(epoch, step)


def run_planner(g: Group, planner: Planner, meta: np.ndarray, src: np.ndarray) -> Any:
    """``planner(meta, src, g.size)``, the same on every rank (see
    :meth:`~orchmllm.dist.move_path.MovePath.plan`)."""
    deterministic = getattr(planner, "deterministic", True)
    return g.path.plan(lambda: planner(meta, src, g.size), deterministic=deterministic)


def gather_step(
    g: Group,
    local: Sequence[Sequence[int]] | None,
    *,
    status: int = OK,
    error: BaseException | None = None,
    step: int = -1,
    planner: object = None,
) -> Gathered:
    """All-gather this rank's metadata rows (one per local item).

    Pass ``error`` when this rank could not prepare its rows: the peers are told, the
    error is re-raised here and :class:`PeerFailed` is raised on every other rank. Pass
    the ``planner`` that will plan the step: ranks whose planners differ (see
    :func:`planner_signature`) raise :class:`~orchmllm.dist.comm.MismatchError` together.
    """
    watch.arrive("exchange", step)
    if error is not None:
        status, local = FAILED, []
    rows = [list(r) for r in (local if local is not None else [])]
    width = max((len(r) for r in rows), default=0)
    agree = {"planner": None if planner is None else planner_signature(planner)}
    mine = [status, len(rows), width, *(comm.fingerprint(v) for v in agree.values())]
    try:
        header = g.all_gather_fixed(mine)
    except Exception as exc:
        named = g.path.absent(exc, call=str(step), what=f"the metadata exchange of step {step}")
        if named is None:
            raise
        raise named from exc
    bytes_sent = len(mine) * _INT64 * (g.size - 1)
    if error is not None:
        raise error
    failed = np.flatnonzero(header[:, 0] == FAILED)
    if failed.size:
        raise PeerFailed(f"rank(s) {failed.tolist()} failed to prepare step {step}; see their logs")
    if np.any(header[:, 0] == CLOSED):
        raise _epoch_mismatch(header, step)
    comm.check_agreement(header[:, 3:], agree, rank=g.rank, what=f"step {step}")
    width = int(header[:, 2].max())
    padded = np.full((len(rows), width), PAD, dtype=np.int64)
    for i, r in enumerate(rows):
        padded[i, : len(r)] = r
    if int(header[:, 1].sum()) == 0:
        meta = np.zeros((0, width), dtype=np.int64)
        src = np.zeros(0, dtype=np.int64)
    else:
        meta, src = g.all_gather_rows(padded)
        bytes_sent += (2 + int(header[:, 1].max()) * width) * _INT64 * (g.size - 1)
    return Gathered(meta=meta, src=src, status=header[:, 0].copy(), bytes_sent=bytes_sent)


def leave_epoch(g: Group, *, consumed: int, step: int) -> None:
    """Tell the peers this rank's loop left the epoch after ``consumed`` batches.

    Called at ``step``, the first step no rank may have started when the loops stopped
    after the same number of batches; so a peer that consumed more is still in a step's
    gather there, and both sides see the difference in the header instead of waiting in
    mismatched collectives. Raises :class:`EpochMismatch` unless every rank left after
    ``consumed`` batches (a peer that failed in a step no loop consumed is ignored).
    """
    # Same header shape as a step's (status, count, width, planner fingerprint).
    header = g.all_gather_fixed([CLOSED, consumed, 0, comm.fingerprint(None)])
    status, count = header[:, 0], header[:, 1]
    if np.any((status != CLOSED) & (status != FAILED)) or np.any(
        count[status == CLOSED] != consumed
    ):
        raise _epoch_mismatch(header, step)


def _epoch_mismatch(header: np.ndarray, step: int) -> EpochMismatch:
    status, count = header[:, 0], header[:, 1]
    closed = status == CLOSED
    parts = [
        f"rank(s) {ranks_text(np.flatnonzero(closed & (count == c)))} stopped after {c} batch(es)"
        for c in np.unique(count[closed]).tolist()
    ]
    going = np.flatnonzero(~closed & (status != FAILED))
    if going.size:
        parts.append(f"rank(s) {ranks_text(going)} went on to step {step}")
    return EpochMismatch(
        "ranks left the epoch at different steps: " + "; ".join(parts) + ". Every rank must "
        "consume the same number of batches before leaving an epoch: break at the same step "
        "on every rank, or run the epoch to its end"
    )


def check_rearrangement(plan: object, g: Group, num_items: int) -> Rearrangement:
    """The planner output the loader can execute: a plan over exactly these items."""
    if not isinstance(plan, Rearrangement):
        raise ValueError(
            f"planner must return a Rearrangement in this mode, got {type(plan).__name__}"
        )
    if plan.num_ranks != g.size or plan.num_items != num_items:
        raise ValueError(
            f"planner returned a plan for {plan.num_items} items on {plan.num_ranks} ranks; "
            f"expected {num_items} items on {g.size} ranks"
        )
    return plan


def serialize(examples: Sequence[Any]) -> list[bytes]:
    """Each example as bytes (pickle protocol 5: numpy and torch arrays as raw buffers)."""
    return [pickle.dumps(ex, protocol=5) for ex in examples]


@dataclass(frozen=True)
class StepInfo:
    """What was done for one step (the metadata and plan are identical on all ranks).

    The loader keeps the latest one in ``BalancedDataLoader.last_step``; ``PlannedBatch.info``
    carries it in ``mode="local"``.

    Attributes:
        epoch: the epoch the step belongs to.
        step: the step's index in its epoch, from 0.
        meta: int64 ``(n, m)``, the gathered planner input (one row per item of the global
            batch, in global item order: rank 0's items, then rank 1's, ...).
        src: int64 ``(n,)``, the rank that sampled each item.
        indices: int64 ``(n,)``, the dataset index of each item in index mode; None in the
            other modes.
        plan: the planner's output (a :class:`~orchmllm.planner.plan.Rearrangement` for the default
            planner).
        plan_s: seconds to gather the metadata and plan.
        prep_s: seconds for the whole step (load, gather, plan, move, collate).
        bytes_meta: metadata bytes this rank sent (logical: its share times its peers).
        bytes_payload: example bytes this rank sent (move mode; 0 in the others).
    """

    epoch: int
    step: int
    meta: np.ndarray
    src: np.ndarray
    indices: np.ndarray | None
    plan: Any
    plan_s: float
    prep_s: float
    bytes_meta: int
    bytes_payload: int

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank sent for the step: ``bytes_meta + bytes_payload``."""
        return self.bytes_meta + self.bytes_payload


@dataclass(frozen=True)
class BalancedStep:
    examples: Any  # move: this rank's examples after the move; else what prepare() gave
    plan: Any
    meta: np.ndarray
    gathered: Gathered
    plan_s: float
    bytes_payload: int

    def info(self, *, epoch: int, step: int, prep_s: float) -> StepInfo:
        """The step's record (no dataset indices: only index mode, which does not run
        through :func:`balance_step`, has them)."""
        return StepInfo(
            epoch,
            step,
            self.meta,
            self.gathered.src,
            None,
            self.plan,
            self.plan_s,
            prep_s,
            self.gathered.bytes_sent,
            self.bytes_payload,
        )


def balance_step(
    g: Group,
    planner: Planner,
    prepare: Callable[[], tuple[Any, Sequence[Sequence[int]]]],
    *,
    step: int,
    move: bool,
) -> BalancedStep | None:
    """Gather metadata, plan and (if ``move``) move the examples, for one step.

    ``prepare()`` loads this rank's examples (a list, when ``move``) and their metadata
    rows, or returns ``(None, [])`` when this rank's data is exhausted; if it raises,
    every rank fails the step. Returns None when every rank is exhausted (the end of the
    epoch, on all ranks).
    """
    examples: Any = None
    rows: Sequence[Sequence[int]] | None = None
    blobs: list[bytes] = []
    error: BaseException | None = None
    try:
        examples, rows = prepare()
        if move:
            blobs = serialize(examples or [])
            rows = [[len(b), *r] for b, r in zip(blobs, rows, strict=True)]
    except Exception as exc:
        error = exc
    t0 = time.perf_counter()
    status = EXHAUSTED if examples is None else OK
    gathered = gather_step(g, rows, status=status, error=error, step=step, planner=planner)
    if np.all(gathered.status == EXHAUSTED):
        return None
    meta = gathered.meta[:, 1:] if move else gathered.meta
    plan = run_planner(g, planner, meta, gathered.src)
    if move:
        plan = check_rearrangement(plan, g, len(gathered.src))
    plan_s = time.perf_counter() - t0
    payload = 0
    if move:
        examples, payload = g.path.move_objects(plan, blobs, gathered.meta[:, 0])
    return BalancedStep(examples, plan, meta, gathered, plan_s, payload)
