"""Planners: the plan of orchmllm.balance on the gathered lengths, and which plans are a pure
function of them (the others are computed on rank 0 and broadcast)."""

import numpy as np
import pytest

import orchmllm
from orchmllm.balance import PLACEMENTS, plan_is_deterministic
from orchmllm.data.orchestrated import OrchestratorPlanner
from orchmllm.data.planners import BalancePlanner
from orchmllm.orchestrator import Orchestrator
from orchmllm.schema import EncodingRates
from orchmllm.step_plan import default_phases


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


def test_only_time_limited_plans_are_nondeterministic():
    for placement in PLACEMENTS:
        assert plan_is_deterministic(placement=placement) == (placement != "ilp")
        assert BalancePlanner(placement=placement).deterministic == (placement != "ilp")
    assert all(plan_is_deterministic(policies=[p]) for p in orchmllm.POLICIES)


@pytest.mark.parametrize("mode", ["none", "llm", "full"])
def test_orchestrator_plans_are_nondeterministic_only_when_balanced_with_ilp(mode):
    phases = default_phases(EncodingRates(), feature_dims={"vision": 12, "audio": 8})
    for placement in ("assign", "ilp"):
        orch = Orchestrator(phases, mode=mode, placement=placement, ranks_per_node=2)
        # mode="none" balances nothing, so it never reaches the placement.
        expected = placement != "ilp" or mode == "none"
        assert OrchestratorPlanner(orch).deterministic == expected
