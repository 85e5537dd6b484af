"""BalancePlanner: the plan of orchmllm.balance on the gathered lengths, as a Rearrangement."""

import numpy as np
import pytest

import orchmllm
from orchmllm.data.planners import BalancePlanner


@pytest.mark.parametrize("policy", ["greedy", "kk", "identity"])
def test_plan_matches_balance(rng, policy):
    lengths = rng.integers(1, 500, size=40)
    src = np.repeat(np.arange(4), 10)
    meta = np.stack([lengths, rng.integers(0, 9, size=40)], axis=1)  # extra columns ignored
    plan = BalancePlanner(policy=policy)(meta, src, 4)
    expected = orchmllm.balance(lengths, 4, policy, src=src)
    np.testing.assert_array_equal(plan.dst_rank, expected.dst)
    np.testing.assert_array_equal(plan.src_rank, src)
    loads = np.bincount(plan.dst_rank, weights=lengths, minlength=4)
    if policy != "identity":
        assert loads.max() <= lengths.sum() / 4 + lengths.max()


def test_empty_step_is_identity():
    plan = BalancePlanner()(np.zeros((0, 1), dtype=np.int64), np.zeros(0, dtype=np.int64), 3)
    assert plan.num_items == 0 and plan.num_ranks == 3


def test_deterministic():
    lengths = np.array([[5], [5], [5], [5], [3], [3]])
    src = np.array([0, 0, 0, 1, 1, 1])
    a, b = BalancePlanner()(lengths, src, 2), BalancePlanner()(lengths, src, 2)
    np.testing.assert_array_equal(a.dst_rank, b.dst_rank)
