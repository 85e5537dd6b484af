"""Local mini-batches follow DistributedSampler exactly; every rank gets the same step count."""

from collections import Counter

import pytest
from torch.utils.data.distributed import DistributedSampler

from orchmllm.data.sampling import (
    local_batches,
    rank_indices,
    steps_per_epoch,
    token_budget_batches,
)


@pytest.mark.parametrize(
    "n,world,batch,drop_last",
    [(20, 4, 3, False), (23, 4, 2, False), (23, 4, 2, True), (3, 4, 2, False)],
)
def test_same_multiset_as_distributed_sampler(n, world, batch, drop_last):
    got: Counter = Counter()
    steps = set()
    for rank in range(world):
        batches = local_batches(
            n, rank=rank, num_replicas=world, batch_size=batch, epoch=5, seed=7, drop_last=drop_last
        )
        steps.add(len(batches))
        assert all(1 <= len(b) <= batch for b in batches)
        sampler = DistributedSampler(
            range(n), num_replicas=world, rank=rank, seed=7, drop_last=drop_last
        )
        sampler.set_epoch(5)
        assert [i for b in batches for i in b] == list(sampler)
        got.update(i for b in batches for i in b)
    assert len(steps) == 1
    assert steps == {steps_per_epoch(n, num_replicas=world, batch_size=batch, drop_last=drop_last)}
    if n % world == 0:
        assert got == Counter(range(n))  # exactly once


def test_epoch_changes_order_and_seed_is_deterministic():
    a = local_batches(50, rank=1, num_replicas=2, batch_size=4, epoch=0)
    assert a == local_batches(50, rank=1, num_replicas=2, batch_size=4, epoch=0)
    assert a != local_batches(50, rank=1, num_replicas=2, batch_size=4, epoch=1)


def test_bad_arguments():
    with pytest.raises(ValueError, match="batch_size"):
        local_batches(10, rank=0, num_replicas=2, batch_size=0)
    with pytest.raises(ValueError, match="rank"):
        local_batches(10, rank=2, num_replicas=2, batch_size=1)


def test_token_budget_batches_hold_every_example_once_within_the_budget(rng):
    lengths = rng.integers(1, 300, size=500)
    steps = token_budget_batches(lengths, num_replicas=4, max_tokens=1000, epoch=2, seed=7)
    assert all(len(per_rank) == 4 for per_rank in steps)
    loads = [[int(lengths[b].sum()) for b in per_rank] for per_rank in steps]
    assert max(max(x) for x in loads) <= 1000
    # Steps take consecutive runs of the epoch's order (every example once), and a step
    # ends only when even its least-loaded rank cannot take the next example.
    order = rank_indices(500, rank=0, num_replicas=1, epoch=2, seed=7)
    start = 0
    for s, per_rank in enumerate(steps):
        end = start + sum(len(b) for b in per_rank)
        assert sorted(i for b in per_rank for i in b) == sorted(order[start:end])
        if s + 1 < len(steps):
            assert min(loads[s]) + lengths[order[end]] > 1000
        start = end
    assert start == 500
    again = token_budget_batches(lengths, num_replicas=4, max_tokens=1000, epoch=2, seed=7)
    assert again == steps  # a pure function: every rank computes the same steps
    assert token_budget_batches(lengths, num_replicas=4, max_tokens=1000, epoch=3, seed=7) != steps
    dropped = token_budget_batches(
        lengths, num_replicas=4, max_tokens=1000, epoch=2, seed=7, drop_last=True
    )
    assert dropped == steps[:-1]


def test_token_budget_batches_reject_an_example_over_the_budget():
    with pytest.raises(
        ValueError, match=r"max_tokens_per_rank=5 is below the length of example 2 \(9\)"
    ):
        token_budget_batches([1, 2, 9, 3], num_replicas=2, max_tokens=5)
    assert token_budget_batches([], num_replicas=2, max_tokens=5) == []
