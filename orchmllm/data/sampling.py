"""Which examples each rank samples at each step: distributed-sampler semantics.

Post-balancing starts from the mini-batches a plain ``DistributedSampler`` would give,
so an epoch covers exactly the same multiset of examples (padding included); only the
rank that computes each example changes. Every rank gets the same number of steps.
"""

from __future__ import annotations

import math

from torch.utils.data.distributed import DistributedSampler


class _Sized:
    """The sampler only needs ``len(dataset)``; never touch the data itself."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


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

    The indices are exactly those of ``DistributedSampler(num_replicas, rank, shuffle,
    seed, drop_last)`` after ``set_epoch(epoch)``, cut into consecutive batches of
    ``batch_size`` (the last one may be smaller). The sampler gives every rank the same
    number of indices, so every rank gets the same number of steps.
    """
    if num_examples < 0:
        raise ValueError(f"num_examples must be >= 0, got {num_examples}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
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
    indices = list(sampler)
    return [indices[i : i + batch_size] for i in range(0, len(indices), batch_size)]


def steps_per_epoch(
    num_examples: int, *, num_replicas: int, batch_size: int, drop_last: bool = False
) -> int:
    """Number of steps every rank takes in one epoch (same on all ranks)."""
    if drop_last and num_examples % num_replicas:
        per_rank = num_examples // num_replicas
    else:
        per_rank = math.ceil(num_examples / num_replicas)
    return math.ceil(per_rank / batch_size)
