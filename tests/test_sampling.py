"""Local mini-batches follow DistributedSampler exactly; every rank gets the same step count."""

from collections import Counter

import pytest
from torch.utils.data.distributed import DistributedSampler

from orchmllm.data.sampling import local_batches, steps_per_epoch


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
