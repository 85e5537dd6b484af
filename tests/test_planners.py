"""Planners: the plan of orchmllm.balance on the gathered lengths, and which plans are a pure
function of them (the others are computed on rank 0 and broadcast)."""

import warnings

import numpy as np
import pytest

import orchmllm
from orchmllm.data.orchestrated import OrchestratorPlanner
from orchmllm.data.planners import (
    BalancePlanner,
    LayoutMismatchWarning,
    collate_layout,
    warn_on_layout_mismatch,
)
from orchmllm.dist.orchestrator import Orchestrator
from orchmllm.planner.balance import PLACEMENTS, plan_is_deterministic
from orchmllm.planner.step_options import StepOptions, default_phases
from orchmllm.schema import EncodingRates


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
        options = StepOptions(phases, mode=mode, placement=placement, ranks_per_node=2)
        orch = Orchestrator(options)
        # mode="none" balances nothing, so it never reaches the placement.
        expected = placement != "ilp" or mode == "none"
        assert OrchestratorPlanner(orch).deterministic == expected


def _padding_collate(examples):
    return examples


_padding_collate.orchmllm_layout = "padded"


def test_collate_layout_reads_declarations_and_knows_hf_collators():
    hf = pytest.importorskip("transformers")
    DataCollatorForSeq2Seq, DataCollatorWithFlattening = (
        hf.DataCollatorForSeq2Seq,
        hf.DataCollatorWithFlattening,
    )
    assert collate_layout(_padding_collate) == "padded"
    assert collate_layout(DataCollatorForSeq2Seq(tokenizer=None)) == "padded"
    assert collate_layout(DataCollatorWithFlattening()) == "packed"
    assert collate_layout(lambda examples: examples) is None  # never guessed

    def odd(examples):
        return examples

    odd.orchmllm_layout = "ragged"
    with pytest.raises(ValueError, match="orchmllm_layout must be one of.*'ragged'"):
        collate_layout(odd)


@pytest.mark.parametrize(
    ("layout", "policy", "warns"),
    [
        ("padded", "greedy", "padded_cost"),
        ("padded", "padded_cost", None),
        ("packed", "binary_search", "policy='greedy'"),
        ("packed", "greedy", None),
    ],
)
def test_a_policy_for_the_other_layout_warns(layout, policy, warns):
    def collate(examples):
        return examples

    collate.orchmllm_layout = layout
    planner = BalancePlanner(policy=policy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_on_layout_mismatch(collate, planner)
        warn_on_layout_mismatch(collate, lambda meta, src, d: None)  # a custom planner: trusted
    messages = [str(w.message) for w in caught if w.category is LayoutMismatchWarning]
    if warns is None:
        assert messages == []
    else:
        assert len(messages) == 1
        assert warns in messages[0] and f"policy={policy!r}" in messages[0]
