"""Which examples each rank samples at each step: distributed-sampler semantics.

Post-balancing starts from the mini-batches a plain ``DistributedSampler`` would give,
so an epoch covers exactly the same multiset of examples (padding included); only the
rank that computes each example changes. Every rank gets the same number of steps.

With a token budget instead of a batch size (:func:`token_budget_batches`), the epoch's
examples are packed into steps of one batch per rank, each within the budget; every rank
computes the same packing from the lengths, so every rank again has the same step count.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import numpy as np
from torch.utils.data.distributed import DistributedSampler


class _Sized:
    """The sampler only needs ``len(dataset)``; never touch the data itself."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def rank_indices(
    num_examples: int,
    *,
    rank: int,
    num_replicas: int,
    epoch: int = 0,
    seed: int = 0,
    shuffle: bool = True,
    drop_last: bool = False,
) -> list[int]:
    """Rank ``rank``'s dataset indices for one epoch, in order: exactly those of
    ``DistributedSampler(num_replicas, rank, shuffle, seed, drop_last)`` after
    ``set_epoch(epoch)`` (every rank gets the same number)."""
    if num_examples < 0:
        raise ValueError(f"num_examples must be >= 0, got {num_examples}")
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if not 0 <= rank < num_replicas:
        raise ValueError(f"rank must be in [0, {num_replicas}), got {rank}")
    if num_examples == 0:
        return []
    sampler = DistributedSampler(
        _Sized(num_examples),
        num_replicas=num_replicas,
        rank=rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
    )
    sampler.set_epoch(epoch)
    return list(sampler)


def local_batches(
    num_examples: int,
    *,
    rank: int,
    num_replicas: int,
    batch_size: int,
    epoch: int = 0,
    seed: int = 0,
    shuffle: bool = True,
    drop_last: bool = False,
) -> list[list[int]]:
    """Rank ``rank``'s local mini-batches (dataset indices) for one epoch.

    The indices are exactly those of :func:`rank_indices` (``DistributedSampler``), cut
    into consecutive batches of ``batch_size`` (the last one may be smaller). The sampler
    gives every rank the same number of indices, so every rank gets the same number of steps.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    indices = rank_indices(
        num_examples,
        rank=rank,
        num_replicas=num_replicas,
        epoch=epoch,
        seed=seed,
        shuffle=shuffle,
        drop_last=drop_last,
    )
    return [indices[i : i + batch_size] for i in range(0, len(indices), batch_size)]


def over_budget(max_tokens: int, which: str, length: int) -> ValueError:
    """The error for an example that no batch within the budget can hold."""
    return ValueError(
        f"max_tokens_per_rank={max_tokens} is below the length of {which} ({length}); "
        "raise the budget or filter out such examples"
    )


def check_budget(lengths: np.ndarray, max_tokens: int) -> None:
    """Raise :func:`over_budget`'s error for the longest example if it exceeds the budget."""
    if lengths.size and lengths.max() > max_tokens:
        i = int(np.argmax(lengths))
        raise over_budget(max_tokens, f"example {i}", int(lengths[i]))


def token_budget_batches(
    lengths: Sequence[int] | np.ndarray,
    *,
    num_replicas: int,
    max_tokens: int,
    epoch: int = 0,
    seed: int = 0,
    shuffle: bool = True,
    drop_last: bool = False,
) -> list[list[list[int]]]:
    """Steps of per-rank batches (dataset indices) with at most ``max_tokens`` tokens each.

    Examples are taken in the epoch's order (``DistributedSampler``'s permutation for
    ``seed + epoch``, or index order without ``shuffle``); each goes to the least-loaded
    rank of the current step (ties: the lowest rank), and when even that rank cannot take
    it within the budget the step is full and the next one starts. Every example appears
    exactly once; ``drop_last`` drops the final step, which the data ran out in. A pure
    function of its arguments, so every rank computes the same steps.

    Returns ``steps[s][r]``: the dataset indices rank ``r`` samples at step ``s``.
    Raises ``ValueError`` if an example is longer than ``max_tokens``.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    check_budget(lengths, max_tokens)
    order = rank_indices(
        lengths.size, rank=0, num_replicas=1, epoch=epoch, seed=seed, shuffle=shuffle
    )
    steps: list[list[list[int]]] = []
    bins: list[list[int]] = [[] for _ in range(num_replicas)]
    heap = [(0, r) for r in range(num_replicas)]  # (tokens, rank) of the current step
    for i, length in zip(order, lengths[order].tolist(), strict=True):
        tokens, r = heap[0]
        if tokens + length > max_tokens:  # no rank of this step can take it
            steps.append(bins)
            bins = [[] for _ in range(num_replicas)]
            heap = [(0, r) for r in range(num_replicas)]
            tokens, r = 0, 0
        heapq.heapreplace(heap, (tokens + length, r))
        bins[r].append(i)
    if any(bins) and not drop_last:
        steps.append(bins)
    return steps


def steps_per_epoch(
    num_examples: int, *, num_replicas: int, batch_size: int, drop_last: bool = False
) -> int:
    """Number of steps every rank takes in one epoch (same on all ranks)."""
    if drop_last and num_examples % num_replicas:
        per_rank = num_examples // num_replicas
    else:
        per_rank = math.ceil(num_examples / num_replicas)
    return math.ceil(per_rank / batch_size)
