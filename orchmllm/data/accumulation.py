"""Gradient accumulation over a balanced loader: ``grad_accum`` micro-steps per optimizer step.

Each micro-step's forward and backward synchronise the ranks (FSDP2's collectives), so each
must be balanced on its own: the loader samples, plans and moves it like any other step.
Grouping the loader's steps K at a time
keeps the step count equal on every rank because the loader gives every rank the same
number of micro-batches per epoch; when K does not divide them, the epoch's last group is
shorter, on every rank alike.

Normalise every micro-step's summed loss by the global count of loss-bearing items over the
whole group (all K micro-batches, all ranks), known before the first forward::

    for group in orchmllm.accumulate(loader, grad_accum=4):
        n = orchmllm.global_num_items(sum(count(b) for b in group))
        for b in group:
            (loss_sum(model, b) / n).backward()
        optimizer.step()
        optimizer.zero_grad()

Then the accumulated gradient is one step's over the group's examples, whichever rank
computed which example (``orchmllm.train`` does this with the orchestrator's plans, whose
``num_targets`` is already global).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

from orchmllm.schema import is_integer

__all__ = ["accumulate"]

T = TypeVar("T")


def accumulate(batches: Iterable[T], *, grad_accum: int) -> Iterator[list[T]]:
    """The micro-batches of ``batches`` in consecutive groups of ``grad_accum``, one group per
    optimizer step (the last may be shorter: the same on every rank for a balanced loader).

    Args:
        batches: A :class:`~orchmllm.data.loader.BalancedDataLoader` (an epoch of it) or
            any iterable of micro-batches.
        grad_accum: Micro-steps per optimizer step, an integer >= 1 (1: one each).

    Returns:
        An iterator of lists of micro-batches, each list one optimizer step's, taken from
        ``batches`` only as the groups are asked for.

    Raises:
        ValueError: ``grad_accum`` is not an integer >= 1 (raised here, not when iterated).
    """
    if not is_integer(grad_accum) or grad_accum < 1:
        raise ValueError(f"grad_accum must be an integer >= 1, got {grad_accum!r}")
    return _groups(iter(batches), int(grad_accum))


def _groups(it: Iterator[T], size: int) -> Iterator[list[T]]:
    while True:
        group = []
        for item in it:
            group.append(item)
            if len(group) == size:
                break
        if group:
            yield group
        if len(group) < size:  # the batches ended: ask no more of them
            return
