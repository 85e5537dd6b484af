import numpy as np
import orchmllm._core as _core
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchmllm.planner.balance import balance
from orchmllm.planner.cost import CostModel
from orchmllm.planner.exact import min_makespan
from tests.conftest import brute_force_min_load

PACKED = CostModel("packed")


@settings(max_examples=40, deadline=None)
@given(
    d=st.integers(2, 3),
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=7),
    slack=st.integers(0, 7),
)
def test_min_makespan_is_the_brute_force_minimum(d, lengths, slack):
    n = len(lengths)
    cap = min(n, -(-n // d) + slack)
    found = min_makespan(np.array(lengths, dtype=np.float64), d, max_items=cap)
    assert found.proven
    assert np.bincount(found.dst, minlength=d).max() <= cap
    best = brute_force_min_load(lengths, d, PACKED, cap)
    assert PACKED.loads(np.array(lengths), found.dst, d).max() == best


@settings(max_examples=60, deadline=None)
@given(
    d=st.integers(2, 4),
    lengths=st.lists(st.integers(1, 60), min_size=2, max_size=8),
    unit=st.sampled_from([1, 4, 28]),
    slack=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_improve_exact_from_any_start_is_the_brute_force_minimum(d, lengths, unit, slack, seed):
    """From any capped start (the pairs and three-rank chains rebalance it before bin
    completion), on weights with a common divisor: a proven plan is the minimum, and every
    plan meets the cap and is no heavier than the start."""
    w = np.sort(np.array(lengths, dtype=np.float64) * unit)[::-1].copy()
    n = w.size
    cap = min(n, -(-n // d) + slack)
    start = np.arange(n, dtype=np.int64) % d
    np.random.default_rng(seed).shuffle(start)  # counts stay within ceil(n / d) <= cap
    floor = _core.makespan_floor(w, d)
    dst, proven, _ = _core.improve_exact(w, d, cap, floor, _core.EXACT_NODES, start)
    loads = np.bincount(dst, weights=w, minlength=d)
    assert np.bincount(dst, minlength=d).max() <= cap
    assert loads.max() <= np.bincount(start, weights=w, minlength=d).max()
    best = brute_force_min_load(w.astype(np.int64), d, PACKED, cap)
    assert proven and loads.max() == best


def test_min_makespan_proves_within_a_budget_that_bin_completion_alone_did_not():
    """Two ranks, eight weights: pair balancing (exact on one pair) reaches the lightest split
    (188) at once, leaving bin completion only the capacities below it to refute; bin
    completion alone, from LPT's plan (190), used up 30 nodes without a proof."""
    w = np.array([41, 29, 18, 32, 71, 31, 91, 58], dtype=np.float64)
    dst, proven, nodes = _core.min_makespan(w, 2, 8, 30)
    assert proven and nodes <= 30
    assert np.bincount(dst, weights=w, minlength=2).max() == 188
    assert brute_force_min_load(w.astype(np.int64), 2, PACKED, 8) == 188


def test_greedy_proves_a_bench_instance_by_reaching_the_floor():
    """64 bimodal chat lengths on 8 ranks (balance_bench's peer instance): a plan at the mean
    exists; greedy's search budget did not find it with bin completion alone (5.9 ms, unproven);
    rebalancing pairs and chains of three ranks does, proven by the floor."""
    lengths = np.array([324, 209, 135, 3692, 187, 2318, 264, 94, 4923, 5171, 3723, 197, 148,
                        297, 108, 1735, 112, 4000, 58, 112, 269, 90, 3019, 216, 163, 343, 243,
                        122, 318, 250, 4890, 197, 3311, 104, 320, 2500, 176, 3467, 257, 2875,
                        116, 286, 256, 254, 105, 249, 204, 184, 231, 167, 296, 191, 441, 207,
                        4162, 199, 115, 170, 3909, 3042, 7937, 4565, 277, 203])  # fmt: skip
    a = balance(lengths, 8)
    assert a.stats["proven_optimal"] == 1.0
    assert np.bincount(a.dst, weights=lengths, minlength=8).max() == -(-lengths.sum() // 8)


def test_min_makespan_handles_fractional_weights_and_no_items():
    w = np.array([0.5, 0.25, 0.75, 1.5])
    found = min_makespan(w, 2, max_items=2)
    assert found.proven and np.bincount(found.dst, weights=w, minlength=2).max() == 1.75
    empty = min_makespan(np.zeros(0), 4, max_items=1)
    assert empty.proven and empty.dst.size == 0
    # A cost model's weights: the optimum fills one rank to a sum that float rounding of a
    # capacity-minus-total waste count would refute; the proven value is the brute-force one.
    quad = CostModel("packed", alpha=3.5e-4, beta=3.0e-8)
    lengths = np.array([1, 2, 6, 7, 36, 37])
    found = min_makespan(quad.item_costs(lengths), 2, max_items=6)
    best = brute_force_min_load(lengths, 2, quad, 6)
    assert found.proven and quad.loads(lengths, found.dst, 2).max() == pytest.approx(
        best, rel=1e-12
    )


def test_min_makespan_proves_a_hard_integer_instance():
    """32 Qwen2-VL patch counts on 8 ranks: the optimum (13,684) sits 12 above the floor and
    longest-processing-time's plan above it; the proof needs dominance among the rank sets."""
    w = np.array([5084, 5032, 5016, 4992, 4992, 4988, 4988, 4988, 4968, 4960, 4960, 4920, 4884,
                  4884, 4620, 4488, 4000, 3456, 2912, 2808, 2520, 2024, 2000, 1836, 1656, 1280,
                  1232, 1216, 1200, 960, 900, 600], dtype=np.float64)  # fmt: skip
    dst, proven, _ = _core.min_makespan(w, 8, 32, 1 << 22)
    assert proven and np.bincount(dst, weights=w, minlength=8).max() == 13684


def test_min_makespan_without_a_proof_still_returns_a_capped_plan():
    """Past the node budget the best plan found comes back, capped and never worse than the
    longest-processing-time plan the search starts from."""
    w = np.random.default_rng(5).integers(1, 1000, 600).astype(np.float64)
    found = min_makespan(w, 8, max_items=75)
    assert np.bincount(found.dst, minlength=8).max() <= 75
    order = sorted(range(w.size), key=lambda i: (-w[i], i))
    load, count = np.zeros(8), np.zeros(8, dtype=int)
    for i in order:  # LPT under the cap, as the search's start
        r = min((q for q in range(8) if count[q] < 75), key=lambda q: (load[q], q))
        load[r] += w[i]
        count[r] += 1
    assert np.bincount(found.dst, weights=w, minlength=8).max() <= load.max()


def test_min_makespan_on_64_items_takes_the_last_position_within_bounds():
    """64 integer weights fill bin completion's 64-bit item mask; a rank's set that takes
    position 63 once shifted the mask by 64 (undefined: on x86 it read past the weights and
    revisited the set's own items; ASAN and UBSAN flagged this draw). The plan stays at or
    above the floor and no heavier than longest-processing-time's."""
    rng = np.random.default_rng(7)
    d = int(rng.integers(2, 9))
    w = rng.integers(1, int(rng.choice([5, 50, 1000])), size=64).astype(np.float64)
    found = min_makespan(w, d, max_items=64)
    loads = np.bincount(found.dst, weights=w, minlength=d)
    assert loads.max() >= _core.makespan_floor(np.sort(w)[::-1].copy(), d)
    lpt = np.zeros(d)
    for x in np.sort(w)[::-1]:
        lpt[np.argmin(lpt)] += x
    assert loads.max() <= lpt.max()


def test_min_makespan_refuses_bad_input():
    with pytest.raises(ValueError, match="max_items"):
        min_makespan(np.ones(5), 2, max_items=2)
    with pytest.raises(ValueError, match="weights"):
        min_makespan(np.array([1.0, np.nan]), 2, max_items=1)
