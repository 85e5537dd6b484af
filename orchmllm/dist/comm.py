"""Collectives for post-balancing: a metadata all-gather and a plan-driven all-to-all.

Only lengths (a few int64 per item) are all-gathered; every rank then computes the same
:class:`~orchmllm.planner.plan.Rearrangement`, so the split sizes of the all-to-all are known
locally and the payload moves in one ``all_to_all_single`` per wire dtype, without a size
exchange. Each rank sends at most its own batch, so traffic per rank does not grow with
the number of ranks (paper section 5.2.1). The all-gather strawman the paper compares
against is here too, for the benchmark.

Every collective waits at most ``timeout`` seconds (None: the group's own timeout), so
a rank that skipped a call makes the others fail instead of hanging.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist

from orchmllm import compat
from orchmllm.planner.plan import Rearrangement, expand_rows

__all__ = [
    "MismatchError",
    "all_gather_fixed",
    "all_gather_rows",
    "move",
    "move_many",
    "roll_call",
    "all_gather_move",
    "check_agreement",
    "fingerprint",
    "wire_dtype",
]

# Dtypes every backend we use moves natively; anything else travels as raw bytes (uint8),
# the same code on gloo and NCCL (gloo has no int16, for example).
_NATIVE = frozenset(
    {
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.int8,
        torch.uint8,
        torch.int32,
        torch.int64,
        torch.bool,
    }
)


ROLL_CALL_S = 3.0  # how long a roll call waits for the ranks that are still there


class MismatchError(RuntimeError):
    """Ranks passed inputs that must agree and do not. Raised on every rank alike (each
    judges the same gathered table), before the collective those inputs would break."""


def fingerprint(value: object) -> int:
    """A 63-bit digest of ``repr(value)``: equal on every process for values built from
    strings, numbers, tuples, dtypes and dataclasses of them (no object addresses)."""
    digest = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def check_agreement(
    table: np.ndarray, agree: Mapping[str, object], *, rank: int, what: str = ""
) -> None:
    """Raise :class:`MismatchError` unless every rank has the same column in ``table``.

    ``table``: (world, len(agree)) the gathered :func:`fingerprint` of each value of
    ``agree`` (this rank's values, in that order); ``what``: where, for the message.
    The message names every field that differs, the ranks off the majority (ties: the value
    of the lowest rank) and this rank's value.
    """
    problems = []
    for col, (name, value) in enumerate(agree.items()):
        column = table[:, col]
        uniq, first, counts = np.unique(column, return_index=True, return_counts=True)
        if uniq.size == 1:
            continue
        majority = uniq[np.lexsort((first, -counts))[0]]
        odd = np.flatnonzero(column != majority).tolist()
        same = np.flatnonzero(column == majority).tolist()
        problems.append(
            f"{name!r} differs: ranks {odd} pass another value than ranks {same} "
            f"(rank {rank} passes {value!r})"
        )
    if problems:
        where = f"{what}: " if what else ""
        raise MismatchError(f"{where}ranks disagree: " + "; ".join(problems))


def wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor of ``dtype`` is sent as."""
    return dtype if dtype in _NATIVE else torch.uint8


def _rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def roll_call(group: dist.ProcessGroup | None, *, call: str, timeout: float) -> list[int]:
    """After a failed collective: the ranks of ``group`` that do not say they are there within
    ``ROLL_CALL_S`` seconds (or ``timeout``, if shorter), by the job's key-value store (the
    default group's). ``call`` names the collective, the same on every rank and unique in the
    job (a step's number). Every rank whose collective failed calls it, at about the same
    time (a timeout or a dead rank's closed connections end it everywhere at once); a rank
    that cannot reach the store returns [] (nothing known)."""
    try:
        rank, size = _rank_and_size(group)
        name = group.group_name if group is not None else dist.group.WORLD.group_name
        store = dist.PrefixStore(f"orchmllm/roll-call/{name}/{call}", compat.default_store())
        store.set(str(rank), "here")
        store.add("count", 1)
        deadline = time.monotonic() + min(timeout, ROLL_CALL_S)
        while store.add("count", 0) < size and time.monotonic() < deadline:
            time.sleep(0.05)
        return [r for r in range(size) if not store.check([str(r)])]
    except Exception:  # the store is gone too: nothing to add
        return []


def absent_message(what: str, exc: BaseException, absent: str, *, timeout: float) -> str:
    """The error of collective ``what`` that failed with ``exc`` while ranks ``absent`` (as
    the message shows them) did not answer :func:`roll_call`."""
    first = (str(exc).strip().splitlines() or [""])[0][:200]
    return (
        f"{what} failed ({type(exc).__name__}: {first}); rank(s) {absent} did not answer a "
        f"roll call within {min(timeout, ROLL_CALL_S):.0f} s: failed, stopped or dead (their "
        "own logs say why), or busy elsewhere"
    )


def _meta_device(group: dist.ProcessGroup | None) -> torch.device:
    """Metadata lives where the group's backend can reach it (CUDA for NCCL)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_fixed(
    local: np.ndarray, *, group: dist.ProcessGroup | None = None, timeout: float | None = None
) -> np.ndarray:
    """All-gather a 1-D int64 vector of the same length on every rank -> (world, m)."""
    vec = np.ascontiguousarray(local, dtype=np.int64).reshape(-1)
    _, world = _rank_and_size(group)
    t = torch.from_numpy(vec.copy()).to(_meta_device(group))
    out = [torch.empty_like(t) for _ in range(world)]
    compat.collective(
        lambda: dist.all_gather(out, t, group=group, async_op=True),
        tensors=[*out, t],
        timeout=timeout,
    )
    return torch.stack(out).cpu().numpy()


def all_gather_rows(
    local: np.ndarray,
    *,
    group: dist.ProcessGroup | None = None,
    timeout: float | None = None,
    agree: Mapping[str, object] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """All-gather a variable number of int64 rows per rank, in rank order.

    ``local`` is (k, m) with k free per rank and m equal on all ranks. Returns
    ``(rows, src)``: rows (sum k, m) ordered rank 0's rows, then rank 1's, ..., and the
    source rank of each row. Intended for a CPU (gloo) group, so that it can run in a
    background thread while NCCL is busy with the model.

    ``agree``: values every rank must share (what it is about to move, how it plans); their
    :func:`fingerprint` rides in the row counts' gather, no extra collective, and a
    difference raises :class:`MismatchError` on every rank (:func:`check_agreement`). Pass
    the same keys on every rank.
    """
    arr = np.asarray(local)
    if arr.ndim != 2:
        raise ValueError(f"local must be 2-D (k, m), got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"local must hold integers, got dtype {arr.dtype}")
    arr = np.ascontiguousarray(arr, dtype=np.int64)
    agree = agree or {}
    header = [*arr.shape, *(fingerprint(v) for v in agree.values())]
    shapes = all_gather_fixed(np.array(header), group=group, timeout=timeout)
    check_agreement(shapes[:, 2:], agree, rank=dist.get_rank(group))
    counts, widths = shapes[:, 0], shapes[:, 1]
    if np.any(widths != widths[0]):
        raise ValueError(f"local must have the same number of columns on every rank, got {widths}")
    width, max_k = int(widths[0]), int(counts.max())
    src = np.repeat(np.arange(counts.size, dtype=np.int64), counts)
    if max_k == 0 or width == 0:
        return np.zeros((int(counts.sum()), width), dtype=np.int64), src
    padded = np.zeros((max_k, width), dtype=np.int64)
    padded[: arr.shape[0]] = arr
    gathered = all_gather_fixed(padded.reshape(-1), group=group, timeout=timeout)
    gathered = gathered.reshape(counts.size, max_k, width)
    rows = np.concatenate([gathered[r, : counts[r]] for r in range(counts.size)])
    return rows, src


def _check_plan(plan: Rearrangement, group: dist.ProcessGroup | None) -> int:
    if not isinstance(plan, Rearrangement):
        raise ValueError(f"plan must be a Rearrangement, got {type(plan).__name__}")
    rank, world = _rank_and_size(group)
    if plan.num_ranks != world:
        raise ValueError(f"plan.num_ranks = {plan.num_ranks} but the group has {world} ranks")
    return rank


def _to_wire(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Flat buffer in the wire dtype and the number of wire elements per row."""
    # An empty tensor counts as contiguous whatever its strides (an expanded one has stride
    # 0), and viewing it as bytes needs stride 1: give it a fresh buffer.
    flat = t.contiguous().reshape(-1) if t.numel() else t.new_empty(0)
    per_row = int(np.prod(t.shape[1:], dtype=np.int64))
    if t.dtype in _NATIVE:
        return flat, per_row
    return flat.view(torch.uint8), per_row * t.element_size()


def _from_wire(buf: torch.Tensor, like: torch.Tensor, rows: int) -> torch.Tensor:
    if like.dtype not in _NATIVE:
        buf = buf.view(like.dtype)
    return buf.reshape(rows, *like.shape[1:])


def _index(x: torch.Tensor, index: np.ndarray | None) -> torch.Tensor:
    if index is None:
        return x
    return x.index_select(0, torch.from_numpy(index).to(x.device))


def _all_to_all(
    recv: torch.Tensor,
    send: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group: dist.ProcessGroup | None,
    timeout: float | None,
) -> None:
    compat.collective(
        lambda: dist.all_to_all_single(
            recv, send, out_splits, in_splits, group=group, async_op=True
        ),
        tensors=[recv, send],
        timeout=timeout,
    )


def _move_group(
    plan: Rearrangement,
    tensors: Sequence[torch.Tensor],
    sizes: Sequence[np.ndarray],
    group: dist.ProcessGroup | None,
    timeout: float | None,
) -> list[torch.Tensor]:
    """One all-to-all for tensors that share a wire dtype (no autograd).

    Outputs own their storage (never views of the receive buffer), so callers may modify
    them in place.
    """
    rank = dist.get_rank(group)
    d = plan.num_ranks
    scheds = [plan.schedule(rank, sizes=s) for s in sizes]
    for t, sched in zip(tensors, scheds, strict=True):
        if t.shape[0] != sched.num_send_rows:
            raise ValueError(
                f"tensor has {t.shape[0]} rows but this rank's items have "
                f"{sched.num_send_rows} (sizes of items in source-slot order)"
            )
    if len(tensors) == 1 and tensors[0].dtype in _NATIVE:
        # Common case: split along rows of the tensor itself, no packing copies.
        t, sched = tensors[0], scheds[0]
        send = _index(t, sched.send_index).contiguous()
        recv = t.new_empty((sched.num_recv_rows, *t.shape[1:]))
        splits = (sched.recv_splits.tolist(), sched.send_splits.tolist())
        _all_to_all(recv, send, *splits, group, timeout)
        return [_index(recv, sched.recv_index)]
    # General case: per peer, the flat rows of tensor 0, then tensor 1, ... in one buffer.
    per_row = [_to_wire(t[:0])[1] for t in tensors]
    send_el = np.stack([s.send_splits * k for s, k in zip(scheds, per_row, strict=True)])
    recv_el = np.stack([s.recv_splits * k for s, k in zip(scheds, per_row, strict=True)])
    send_chunks = [
        torch.split(_to_wire(_index(t, s.send_index))[0], row.tolist())
        for t, s, row in zip(tensors, scheds, send_el, strict=True)
    ]
    send = torch.cat([send_chunks[j][p] for p in range(d) for j in range(len(tensors))])
    recv = send.new_empty(int(recv_el.sum()))
    splits = (recv_el.sum(0).tolist(), send_el.sum(0).tolist())
    _all_to_all(recv, send, *splits, group, timeout)
    chunks = torch.split(recv, recv_el.T.reshape(-1).tolist())
    outs = []
    for j, (t, sched) in enumerate(zip(tensors, scheds, strict=True)):
        mine = [chunks[p * len(tensors) + j] for p in range(d)]
        if t.dtype in _NATIVE:  # shape each chunk, then cat: a fresh tensor, not a view
            rows = sched.recv_splits.tolist()
            out = torch.cat([c.reshape(r, *t.shape[1:]) for c, r in zip(mine, rows, strict=True)])
            outs.append(_index(out, sched.recv_index))
        else:  # bytes: join first (alignment), reinterpret, and own the storage
            out = _from_wire(torch.cat(mine), t, sched.num_recv_rows)
            outs.append(out.clone() if sched.recv_index is None else _index(out, sched.recv_index))
    return outs


class _Move(torch.autograd.Function):
    """All-to-all whose backward is the all-to-all of the inverse plan."""

    @staticmethod
    def forward(ctx, plan, sizes, group, timeout, *tensors):  # noqa: ANN001
        ctx.plan, ctx.sizes, ctx.group, ctx.timeout = plan, sizes, group, timeout
        outs = _move_group(plan, tensors, sizes, group, timeout)
        for t, o in zip(tensors, outs, strict=True):
            if not t.is_floating_point():
                ctx.mark_non_differentiable(o)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):  # noqa: ANN001
        back = _move_group(ctx.plan.inverse(), grads, ctx.sizes, ctx.group, ctx.timeout)
        return (None, None, None, None, *back)


def _check_sizes(plan: Rearrangement, sizes: object) -> np.ndarray:
    arr = np.asarray(sizes)
    if arr.ndim != 1 or arr.size != plan.num_items:
        raise ValueError(
            f"sizes must be 1-D with one entry per item ({plan.num_items}), got shape {arr.shape}"
        )
    if arr.size and (not np.issubdtype(arr.dtype, np.integer) or arr.min() < 0):
        raise ValueError(f"sizes must be non-negative integers, got {arr[:8]!r}")
    return arr.astype(np.int64)


def move_many(
    plan: Rearrangement,
    tensors: Sequence[torch.Tensor],
    sizes: Sequence[object],
    *,
    group: dist.ProcessGroup | None = None,
    timeout: float | None = None,
) -> list[torch.Tensor]:
    """Move several tensors with one all-to-all per wire dtype (autograd-aware).

    ``tensors[j]`` holds this rank's source items, rows concatenated in source-slot order,
    ``sizes[j][i]`` rows for global item ``i`` (token-major tensors use the lengths,
    item-major ones use ones). Returns this rank's destination items in destination-slot
    order. Trailing dims, dtypes and ``requires_grad`` must agree across ranks, and every
    rank must backpropagate through the outputs if any rank does (the backward is a
    collective too, like FSDP's).
    """
    _check_plan(plan, group)
    if len(tensors) != len(sizes):
        raise ValueError(f"got {len(tensors)} tensors but {len(sizes)} sizes")
    for j, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or t.dim() < 1:
            raise ValueError(f"tensors[{j}] must be a tensor with at least 1 dim, got {t!r}")
    checked = [_check_sizes(plan, s) for s in sizes]
    groups: dict[torch.dtype, list[int]] = {}
    for j, t in enumerate(tensors):
        groups.setdefault(wire_dtype(t.dtype), []).append(j)
    outs: list[torch.Tensor | None] = [None] * len(tensors)
    # Same group order on every rank: sorted by dtype name, not by first appearance.
    for key in sorted(groups, key=str):
        idx = groups[key]
        moved = _Move.apply(
            plan, [checked[j] for j in idx], group, timeout, *[tensors[j] for j in idx]
        )
        for j, o in zip(idx, moved, strict=True):
            outs[j] = o
    return outs  # type: ignore[return-value]


def move(
    plan: Rearrangement,
    tensor: torch.Tensor,
    *,
    sizes: object,
    group: dist.ProcessGroup | None = None,
    timeout: float | None = None,
) -> torch.Tensor:
    """Move one tensor by ``plan`` (see :func:`move_many`); backward is the inverse move."""
    return move_many(plan, [tensor], [sizes], group=group, timeout=timeout)[0]


def all_gather_move(
    plan: Rearrangement,
    tensor: torch.Tensor,
    *,
    sizes: object,
    group: dist.ProcessGroup | None = None,
    timeout: float | None = None,
) -> torch.Tensor:
    """The paper's strawman: every rank gathers every batch, then keeps its own items.

    Same inputs and result as :func:`move` (no autograd). Each rank receives
    ``(d - 1) * max batch`` rows (all-gather of buffers padded to the largest batch) and
    holds ``(d + 1) * max batch`` extra rows at once, which is what the all-to-all avoids.
    """
    rank = _check_plan(plan, group)
    w = _check_sizes(plan, sizes)
    d = plan.num_ranks
    rows_per_rank = np.bincount(plan.src_rank, weights=w, minlength=d).astype(np.int64)
    if tensor.shape[0] != rows_per_rank[rank]:
        raise ValueError(f"tensor has {tensor.shape[0]} rows, expected {rows_per_rank[rank]}")
    max_rows = int(rows_per_rank.max())
    mine = plan.items_at(rank)
    if max_rows == 0:  # every rank knows this from the plan: nobody enters the collective
        return tensor.new_empty((0, *tensor.shape[1:]))
    wire, k = _to_wire(tensor.detach())
    padded = wire.new_zeros(max_rows * k)
    padded[: wire.numel()] = wire
    gathered = wire.new_empty((d, max_rows * k))
    parts = list(gathered.unbind(0))
    compat.collective(
        lambda: dist.all_gather(parts, padded, group=group, async_op=True),
        tensors=[*parts, padded],
        timeout=timeout,
    )
    # Rank r's batch starts at row r * max_rows; items follow in source-slot order.
    start = np.zeros(plan.num_items, dtype=np.int64)
    for r in range(d):
        ids = plan.source_items_at(r)
        start[ids] = r * max_rows + np.cumsum(w[ids]) - w[ids]
    everything = _from_wire(gathered.reshape(-1), tensor, d * max_rows)
    return _index(everything, expand_rows(start[mine], w[mine]))
