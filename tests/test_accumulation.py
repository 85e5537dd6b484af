"""Gradient accumulation's grouping: K micro-steps per optimizer step, the same on every rank.

The trainer's use of it (losses and parameters equal to one step over the same examples) is
checked in ``tests/test_train.py``.
"""

import itertools

import pytest

from orchmllm.data import BalancedDataLoader, LoaderOptions, accumulate
from orchmllm.testing import run_distributed


def test_groups_of_k_in_order_the_last_shorter():
    assert list(accumulate(range(7), grad_accum=3)) == [[0, 1, 2], [3, 4, 5], [6]]
    assert list(accumulate(range(6), grad_accum=3)) == [[0, 1, 2], [3, 4, 5]]
    assert list(accumulate(range(3), grad_accum=1)) == [[0], [1], [2]]
    assert list(accumulate([], grad_accum=2)) == []


def test_takes_micro_batches_only_as_groups_are_asked_for():
    counter = itertools.count()
    taken = (next(counter) for _ in range(100))
    groups = accumulate(taken, grad_accum=4)
    assert next(groups) == [0, 1, 2, 3]
    assert next(counter) == 4  # nothing of the next group was read ahead


@pytest.mark.parametrize("bad", [0, -2, 2.5, True, "2", None])
def test_a_bad_grad_accum_is_refused_when_called(bad):
    with pytest.raises(ValueError, match=rf"grad_accum must be an integer >= 1, got {bad!r}"):
        accumulate(range(4), grad_accum=bad)


class _Stream:
    """This rank's shard of a stream, without a length: ``n`` examples (each its own length)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(1, self.n + 1))


def _uneven_worker(rank: int, world: int):
    # Rank 0 holds 7 examples, rank 1 holds 2: 4 micro-steps of 2 on rank 0, 1 on rank 1.
    loader = BalancedDataLoader(
        _Stream(7 if rank == 0 else 2),
        batch_size=2,
        length_fn=int,
        collate_fn=list,
        options=LoaderOptions(prefetch=2),
    )
    with loader:
        return list(accumulate(loader, grad_accum=3))


@pytest.mark.integration
def test_ranks_with_uneven_streams_take_the_same_optimizer_steps():
    """A stream's epoch lasts as long as its longest shard on every rank, so grouping its
    micro-batches gives every rank the same groups: 4 micro-steps as [3, 1] on both ranks;
    every example is computed once, somewhere."""
    out = run_distributed(_uneven_worker, 2, timeout=60)
    assert [[len(g) for g in groups] for groups in out] == [[3, 1], [3, 1]]
    seen = sorted(x for groups in out for g in groups for micro in g for x in micro)
    assert seen == sorted([*range(1, 8), 1, 2])
