"""Plan agreement: every rank of a group executes the same plan.

Most plans are a pure function of metadata every rank gathered, so each rank computes the plan
itself and no collective is needed. A plan that is not (a time-limited ILP placement can stop
at another point on a busy rank) is computed on rank 0 and broadcast on a CPU (gloo) group:
computed on every rank, such plans could differ, and the all-to-all that follows would fail or
corrupt data.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from orchmllm import compat

__all__ = ["PeerFailed", "agreed_plan"]

T = TypeVar("T")


class PeerFailed(RuntimeError):
    """Another rank failed while preparing this step (its own error is raised there)."""


def agreed_plan(
    compute: Callable[[], T],
    *,
    deterministic: bool,
    group: dist.ProcessGroup | None,
    timeout: float,
) -> T:
    """The plan every rank of ``group`` uses: ``compute()`` on every rank when the plan is a
    pure function of metadata the ranks share (no collective), otherwise ``compute()`` on
    rank 0 of ``group`` alone, broadcast to the others on ``group`` (a CPU group) within
    ``timeout`` seconds. Collective in the second case: every rank calls it together.

    Used for every plan that :func:`orchmllm.planner.balance.plan_is_deterministic` rejects. If
    ``compute()`` raises on rank 0,
    the error is raised there and :class:`PeerFailed` on the other ranks.
    """
    alone = not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1
    if deterministic or alone:
        return compute()
    if dist.get_rank(group) != 0:
        ok, value = pickle.loads(_broadcast_from_first(None, group, timeout))
        if not ok:
            raise PeerFailed(f"rank 0 failed to compute the plan: {value}")
        return value
    try:
        value = compute()
        payload = pickle.dumps((True, value), protocol=5)
    except Exception as exc:
        _broadcast_from_first(pickle.dumps((False, f"{type(exc).__name__}: {exc}")), group, timeout)
        raise
    _broadcast_from_first(payload, group, timeout)
    return value


def _broadcast_from_first(
    payload: bytes | None, group: dist.ProcessGroup | None, timeout: float
) -> bytes:
    """Rank 0's ``payload`` on every rank of ``group`` (the others pass None)."""
    size = torch.tensor([0 if payload is None else len(payload)], dtype=torch.int64)
    _broadcast(size, group, timeout)
    if payload is None:
        buf = torch.empty(int(size.item()), dtype=torch.uint8)
    else:
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    _broadcast(buf, group, timeout)
    return payload if payload is not None else buf.numpy().tobytes()


def _broadcast(t: torch.Tensor, group: dist.ProcessGroup | None, timeout: float) -> None:
    compat.collective(
        lambda: compat.broadcast(t, group=group, group_src=0, async_op=True),
        tensors=[t],
        timeout=timeout,
    )
