"""Node-wise placement (assign, ILP, auto) and movement-aware balancing (greedy_stay)."""

import itertools
import json
import subprocess
import sys
import time
import warnings

import numpy as np
import orchmllm._core as _core
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import linear_sum_assignment

import orchmllm
from orchmllm.data.workloads import sample_lengths
from orchmllm.planner.cost import CostModel
from orchmllm.planner.placement import (
    AUTO_EXACT_NODES,
    MAX_RANKS,
    METHODS,
    movement_aware_dst,
    movement_lower_bound,
    place_batches,
    traffic,
)
from tests.conftest import ROOT, every_plan, load_script


def _instance(rng, d, per_rank, *, mean_log=6.5):
    """Realistic-ish mini-batches: log-normal lengths, each rank holding `per_rank` items."""
    lengths = rng.lognormal(mean_log, 1.0, d * per_rank).astype(np.int64) + 1
    src = np.repeat(np.arange(d), per_rank)
    return lengths, src


def _greedy(lengths, src, d):
    return orchmllm.balance(lengths, d, "greedy", src=src).dst


def _rank_batch(lengths, src, dst, d):
    v = np.zeros((d, d), dtype=np.int64)
    np.add.at(v, (src, dst), lengths)
    return v


def _all_perms(d):
    return np.array(list(itertools.permutations(range(d))), dtype=np.int64)


def _check_loads_kept(lengths, dst, placed, d):
    """A placement only relabels batches: batch b's items all go to perm[b], loads permuted."""
    perm = placed.perm
    assert sorted(perm.tolist()) == list(range(d))
    np.testing.assert_array_equal(placed.dst, perm[dst])
    before = np.bincount(dst, weights=lengths, minlength=d)
    after = np.bincount(placed.dst, weights=lengths, minlength=d)
    np.testing.assert_array_equal(after[perm], before)
    assert sorted(after.tolist()) == sorted(before.tolist())


# ---------------------------------------------------------------------------------------------
# the C++ assignment core


def test_capacitated_assignment_matches_dense_hungarian(rng):
    """Exact search: the optimum, and a dual bound equal to it. A bounded search (a few
    settled columns per row): a feasible assignment, at most the optimum, at most its bound,
    and the bound is a true upper bound on the optimum."""
    for _ in range(300):
        cols, cap = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        rows = int(rng.integers(1, cols * cap + 1))
        profit = rng.integers(0, 20, (rows, cols)) * (rng.random((rows, cols)) < 0.5)
        r, c = np.nonzero(profit)
        indptr = np.searchsorted(r, np.arange(rows + 1)).astype(np.int64)
        dense = np.repeat(profit, cap, axis=1)
        i, j = linear_sum_assignment(dense, maximize=True)
        optimum = dense[i, j].sum()
        for max_settled in (0, 1, 2):
            col, bound = _core.capacitated_assignment(
                indptr, c.astype(np.int64), profit[r, c], cols, cap, max_settled
            )
            matched = col >= 0
            assert np.all(np.bincount(col[matched], minlength=cols) <= cap)
            got = profit[np.flatnonzero(matched), col[matched]].sum()
            assert got <= optimum <= bound
            if max_settled == 0:
                assert got == optimum == bound


@pytest.mark.parametrize("scale", [1, 2**55])  # sums that fit a packed sort key, and not
def test_grouped_sums_matches_a_dense_table(rng, scale):
    """Rows of up to 80 distinct columns, many tied sums (ties by column), against numpy."""
    for _ in range(50):
        rows, cols = int(rng.integers(1, 9)), int(rng.choice([8, 80]))
        n = int(rng.integers(0, 60 * cols // 8))
        row, col = rng.integers(0, rows, n), rng.integers(0, cols, n)
        weight = rng.integers(0, 4, n) * scale
        dense = np.zeros((rows, cols), dtype=np.int64)
        np.add.at(dense, (row, col), weight)
        indptr, got_cols, sums = _core.grouped_sums(row, col, weight, rows, cols)
        r, c = np.nonzero(dense)
        order = np.lexsort((c, -dense[r, c], r))  # rows in order, by sum descending, by column
        np.testing.assert_array_equal(indptr, np.searchsorted(r, np.arange(rows + 1)))
        np.testing.assert_array_equal(got_cols, c[order])
        np.testing.assert_array_equal(sums, dense[r, c][order])


def test_capacitated_assignment_rejects_bad_csr():
    with pytest.raises(ValueError, match="too few column slots"):
        _core.capacitated_assignment(np.array([0, 0, 0, 0]), np.array([]), np.array([]), 1, 2)
    with pytest.raises(ValueError, match="profit"):
        _core.capacitated_assignment(np.array([0, 1]), np.array([0]), np.array([0]), 1, 1)


def test_traffic_rejects_ranks_per_node_below_one():
    """The core divides by it: zero is refused by name, not a division by zero."""
    ones = np.ones(2, dtype=np.int64)
    src = np.array([0, 1], dtype=np.int64)
    with pytest.raises(ValueError, match="ranks_per_node must be >= 1, got 0"):
        _core.traffic(ones, src, src, 2, 0)


def test_capacitated_assignment_refuses_profits_that_would_overflow():
    """Potentials are int64 sums of profits: a total above 2**58 is refused, not wrapped."""
    indptr, cols = np.array([0, 1, 2]), np.array([0, 1])
    with pytest.raises(ValueError, match="overflow"):
        _core.capacitated_assignment(indptr, cols, np.array([2**62, 2**62]), 2, 1)
    ok, bound = _core.capacitated_assignment(indptr, cols, np.array([2**57, 2**57]), 2, 1)
    assert ok.tolist() == [0, 1] and bound == 2**58


# ---------------------------------------------------------------------------------------------
# exactness against brute force over all permutations of the batches


@pytest.mark.parametrize("seed", range(4))
def test_assign_is_exact(seed):
    rng = np.random.default_rng(seed)
    d, c = 8, 2
    lengths, src = _instance(rng, d, 5)
    dst = rng.integers(0, d, lengths.size) if seed % 2 else _greedy(lengths, src, d)
    placed = place_batches(lengths, src, dst, num_ranks=d, ranks_per_node=c, method="assign")
    _check_loads_kept(lengths, dst, placed, d)

    v = _rank_batch(lengths, src, dst, d)
    node_batch = np.add.reduceat(v, np.arange(0, d, c), axis=0)  # [node, batch]
    perms = _all_perms(d)
    intra = node_batch[perms // c, np.arange(d)].sum(axis=1)  # tokens staying on their node
    kept = v[perms, np.arange(d)].sum(axis=1)  # tokens not moving at all
    got = traffic(lengths, src, placed.dst, num_ranks=d, ranks_per_node=c)
    assert got.kept + got.intra == intra.max()
    same_nodes = np.all(perms // c == placed.perm // c, axis=1)
    assert got.kept == kept[same_nodes].max()


# CBC's branch-and-bound nodes for a proven placement: a count, never the clock (these close
# at the root or in a few nodes).
ILP_NODES = 10_000


@pytest.mark.parametrize("seed", range(3))
def test_ilp_is_exact(seed):
    rng = np.random.default_rng(100 + seed)
    d, c = 8, 2
    lengths, src = _instance(rng, d, 4)
    dst = _greedy(lengths, src, d)
    placed = place_batches(
        lengths, src, dst, num_ranks=d, ranks_per_node=c, method="ilp", node_limit=ILP_NODES
    )
    _check_loads_kept(lengths, dst, placed, d)
    assert placed.stats["placement_optimal"] == 1.0

    v = _rank_batch(lengths, src, dst, d)
    perms = _all_perms(d)
    same_node = (np.arange(d)[:, None] // c) == (perms[:, None, :] // c)  # [perm, rank, batch]
    inter = v.sum(axis=1)[None, :] - (v[None] * same_node).sum(axis=2)
    assert placed.stats["inter_node_tokens_max_rank_after"] == inter.max(axis=1).min()


def test_ilp_node_limit_bounds_the_search_by_a_count():
    """16 ranks of 8, where CBC must branch: stopped at the root it proves nothing and keeps
    no worse than assign; with nodes to spare it proves the optimum auto proves."""
    rng = np.random.default_rng(11)
    d, c = 16, 8
    lengths, src = _instance(rng, d, 6)
    dst = _greedy(lengths, src, d)
    kw = dict(num_ranks=d, ranks_per_node=c)
    assign = place_batches(lengths, src, dst, method="assign", **kw)
    root = place_batches(lengths, src, dst, method="ilp", node_limit=0, **kw)
    proven = place_batches(lengths, src, dst, method="ilp", node_limit=ILP_NODES, **kw)
    auto = place_batches(lengths, src, dst, method="auto", time_limit_s=0.5, **kw)
    worst = "inter_node_tokens_max_rank_after"
    assert (root.stats["placement_optimal"], proven.stats["placement_optimal"]) == (0.0, 1.0)
    assert proven.stats[worst] == auto.stats[worst] <= root.stats[worst] <= assign.stats[worst]


def test_auto_is_exact_and_deterministic_at_two_nodes():
    """16 ranks of 8 with budget: auto solves the ILP to optimality (all node splits checked)."""
    rng = np.random.default_rng(11)
    d, c = 16, 8
    lengths, src = _instance(rng, d, 6)
    dst = _greedy(lengths, src, d)
    kw = dict(num_ranks=d, ranks_per_node=c, method="auto", time_limit_s=0.5)
    first = place_batches(lengths, src, dst, **kw)
    again = place_batches(lengths, src, dst, **kw)
    np.testing.assert_array_equal(first.perm, again.perm)
    assert first.stats["placement_optimal"] == 1.0

    v = _rank_batch(lengths, src, dst, d)
    best = np.inf
    for node0 in itertools.combinations(range(d), c):
        on_node0 = np.zeros(d, dtype=bool)
        on_node0[list(node0)] = True
        same = (np.arange(d)[:, None] < c) == on_node0[None, :]  # [rank, batch]
        best = min(best, (v.sum(axis=1) - (v * same).sum(axis=1)).max())
    assert first.stats["inter_node_tokens_max_rank_after"] == best


def _on_node(placed):
    return placed.stats["tokens_kept_after"] + placed.stats["intra_node_tokens_total_after"]


@pytest.mark.parametrize("d", [32, 1024])
def test_auto_search_is_exact_on_small_clusters_and_bounded_beyond(d):
    """Up to AUTO_EXACT_NODES nodes auto's node assignment is assign's (exact); beyond,
    it keeps at most what assign keeps and reports a true upper bound on it."""
    rng = np.random.default_rng(d)
    c = 4
    lengths, src = _instance(rng, d, 8)
    dst = _greedy(lengths, src, d)
    kw = dict(num_ranks=d, ranks_per_node=c)
    exact = place_batches(lengths, src, dst, method="assign", **kw)
    auto = place_batches(lengths, src, dst, method="auto", **kw)
    assert _on_node(exact) == exact.stats["on_node_tokens_bound"]
    assert auto.stats["on_node_tokens_bound"] >= _on_node(exact)
    if d // c <= AUTO_EXACT_NODES:
        np.testing.assert_array_equal(auto.perm, exact.perm)
    else:
        assert _on_node(auto) <= _on_node(exact)
        assert _on_node(auto) >= 0.9 * _on_node(exact)


def test_ilp_never_worse_than_assign(rng):
    d, c = 32, 4
    lengths, src = _instance(rng, d, 12)
    dst = _greedy(lengths, src, d)
    kw = dict(num_ranks=d, ranks_per_node=c)
    assign = place_batches(lengths, src, dst, method="assign", **kw)
    for method, limit in (("ilp", 0.05), ("ilp", 0.5), ("auto", 0.05)):
        got = place_batches(lengths, src, dst, method=method, time_limit_s=limit, **kw)
        _check_loads_kept(lengths, dst, got, d)
        after = got.stats["inter_node_tokens_max_rank_after"]
        assert after <= assign.stats["inter_node_tokens_max_rank_after"]


def test_auto_never_sends_more_across_nodes_than_identity():
    """assign maximises tokens kept in-node, which can load one rank's inter-node sends above the
    unpermuted batches; auto must then keep those (the paper's objective is the busiest rank)."""
    assign_worse = 0
    for seed in range(60):
        lengths, src = _instance(np.random.default_rng(seed), 16, 6)
        dst = _greedy(lengths, src, 16)
        kw = dict(num_ranks=16, ranks_per_node=8)
        assign = place_batches(lengths, src, dst, method="assign", **kw).stats
        auto = place_batches(lengths, src, dst, method="auto", **kw)
        _check_loads_kept(lengths, dst, auto, 16)
        worst, before = "inter_node_tokens_max_rank_after", "inter_node_tokens_max_rank_before"
        assert auto.stats[worst] <= auto.stats[before]
        assert auto.stats[worst] <= assign[worst]
        assign_worse += assign[worst] > assign[before]
    assert assign_worse > 0  # the case this guards against occurs in the sample


# ---------------------------------------------------------------------------------------------
# time limit, fallback, statistics, determinism, validation


def test_time_limit_is_honoured(rng):
    pytest.importorskip("cvxpy")
    cases = [(64, 8, 0.05), (64, 8, 0.3), (128, 8, 0.1), (512, 8, 0.05)]
    for d, c, limit in cases:
        lengths, src = _instance(rng, d, 20)
        dst = _greedy(lengths, src, d)
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # "does not fit" for the large one
            placed = place_batches(
                lengths, src, dst, num_ranks=d, ranks_per_node=c, method="ilp", time_limit_s=limit
            )
        wall = time.perf_counter() - start - placed.stats["placement_setup_ms"] / 1e3
        assert wall <= 1.5 * limit + 0.05, (d, limit, wall)
        assert placed.stats["placement_solve_ms"] <= wall * 1e3
        _check_loads_kept(lengths, dst, placed, d)


_FIRST_ILP = """
import json, sys, time
import numpy as np
from orchmllm.planner.placement import place_batches, prepare_ilp
assert "cvxpy" not in sys.modules
prepared = prepare_ilp() if sys.argv[1] == "prepare" else 0.0
rng = np.random.default_rng(0)
d = 64
lengths = rng.lognormal(6.5, 1.0, d * 20).astype(np.int64) + 1
src = np.repeat(np.arange(d), 20)
dst = rng.permutation(src)
calls = []
for _ in range(2):
    start = time.perf_counter()
    p = place_batches(lengths, src, dst, num_ranks=d, ranks_per_node=8, method="ilp")
    calls.append(dict(wall=time.perf_counter() - start, **p.stats))
print(json.dumps(dict(prepared=prepared, calls=calls)))
"""


@pytest.mark.integration
@pytest.mark.parametrize("prepare", [False, True])
def test_first_ilp_in_a_process_keeps_the_time_limit(repo_env, prepare):
    """cvxpy's import and the solver's first load (seconds) are paid outside the 50 ms budget,
    by prepare_ilp (explicitly, or by the first place_batches before its clock starts), and
    reported apart; the budgeted part keeps the limit on the first call too."""
    pytest.importorskip("cvxpy")
    arg = "prepare" if prepare else "first"
    proc = subprocess.run(
        [sys.executable, "-c", _FIRST_ILP, arg],
        env=repo_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    first, second = out["calls"]
    limit = 0.05
    assert (out["prepared"] > 0) == prepare
    assert (first["placement_setup_ms"] > 0) != prepare
    assert second["placement_setup_ms"] == 0.0
    for call in (first, second):
        budgeted = call["wall"] - call["placement_setup_ms"] / 1e3
        assert budgeted <= 1.5 * limit + 0.05, call
        assert call["placement_solve_ms"] <= budgeted * 1e3


def test_large_ilp_request_falls_back_with_warning(rng):
    d, c = 512, 8
    lengths, src = _instance(rng, d, 10)
    dst = _greedy(lengths, src, d)
    kw = dict(num_ranks=d, ranks_per_node=c, time_limit_s=0.05)
    with pytest.warns(RuntimeWarning, match="does not fit"):
        placed = place_batches(lengths, src, dst, method="ilp", **kw)
    assign = place_batches(lengths, src, dst, method="assign", **kw)
    np.testing.assert_array_equal(placed.perm, assign.perm)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # auto skips the ILP silently
        auto = place_batches(lengths, src, dst, method="auto", **kw)
    np.testing.assert_array_equal(auto.perm, assign.perm)


def test_missing_solver_falls_back_to_assign(rng):
    cp = pytest.importorskip("cvxpy")
    if "GUROBI" in cp.installed_solvers():
        pytest.skip("GUROBI is installed here; the test needs a solver that is not")
    d, c = 16, 4
    lengths, src = _instance(rng, d, 10)
    dst = _greedy(lengths, src, d)
    kw = dict(num_ranks=d, ranks_per_node=c, time_limit_s=1.0)
    with pytest.warns(RuntimeWarning, match="ILP failed.*GUROBI"):
        placed = place_batches(lengths, src, dst, method="ilp", solver="GUROBI", **kw)
    assign = place_batches(lengths, src, dst, method="assign", **kw)
    np.testing.assert_array_equal(placed.perm, assign.perm)
    assert placed.stats["placement_optimal"] in (0.0, 1.0)
    _check_loads_kept(lengths, dst, placed, d)


@pytest.mark.parametrize("method", METHODS)
def test_stats_account_for_every_token(rng, method):
    d, c = 64, 8
    lengths, src = _instance(rng, d, 15)
    dst = _greedy(lengths, src, d)
    placed = place_batches(lengths, src, dst, num_ranks=d, ranks_per_node=c, method=method)
    _check_loads_kept(lengths, dst, placed, d)
    s = placed.stats
    for when in ("before", "after"):
        total = (
            s[f"inter_node_tokens_total_{when}"]
            + s[f"intra_node_tokens_total_{when}"]
            + s[f"tokens_kept_{when}"]
        )
        assert total == lengths.sum()
        assert s[f"inter_node_tokens_max_rank_{when}"] <= s[f"inter_node_tokens_total_{when}"]
    assert placed.after.inter_sent.sum() == s["inter_node_tokens_total_after"]
    assert placed.after.inter_recv.sum() == s["inter_node_tokens_total_after"]
    if method == "identity":
        np.testing.assert_array_equal(placed.perm, np.arange(d))
    else:  # identity is feasible for the sum objective, and greedy batches leave room
        assert s["inter_node_tokens_total_after"] < s["inter_node_tokens_total_before"]
        assert s["inter_node_tokens_max_rank_after"] < s["inter_node_tokens_max_rank_before"]
    assert s["placement_solve_ms"] >= 0


def test_placement_is_deterministic(rng):
    d, c = 128, 8
    lengths, src = _instance(rng, d, 20)
    dst = _greedy(lengths, src, d)
    a = place_batches(lengths, src, dst, num_ranks=d, ranks_per_node=c, method="assign")
    b = place_batches(lengths.copy(), src.copy(), dst.copy(), num_ranks=d, ranks_per_node=c)
    np.testing.assert_array_equal(a.perm, b.perm)  # auto at 128 ranks = assign


def test_balance_dispatches_placement(rng):
    d, c = 32, 8
    lengths, src = _instance(rng, d, 10)
    plain = orchmllm.balance(lengths, d, "greedy", src=src)
    placed = orchmllm.balance(lengths, d, "greedy", src=src, ranks_per_node=c, placement="assign")
    assert sorted(placed.loads.tolist()) == sorted(plain.loads.tolist())
    assert "inter_node_tokens_max_rank_after" in placed.stats


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(ranks_per_node=3), "ranks_per_node"),
        (dict(num_ranks=0), "num_ranks"),
        (dict(method="fastest"), "method"),
        (dict(time_limit_s=0), "time_limit_s"),
        (dict(node_limit=-1), "node_limit must be an int >= 0 or None, got -1"),
        (dict(node_limit=2.5), "node_limit"),
        (dict(solver="MOSEK_PRO"), "solver"),
        (dict(src=[0, 1, 2, 9]), "src"),
        (dict(dst=[0, 1]), "dst"),
        (dict(lengths=[1, -2, 3, 4]), "lengths"),
        (dict(lengths=[1.5, 2, 3, 4]), "lengths"),
    ],
)
def test_bad_input_raises(kwargs, match):
    args = dict(lengths=[5, 6, 7, 8], src=[0, 1, 2, 3], dst=[3, 2, 1, 0], num_ranks=4)
    args.update(ranks_per_node=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        place_batches(args.pop("lengths"), args.pop("src"), args.pop("dst"), **args)


# ---------------------------------------------------------------------------------------------
# movement-aware balancing


@pytest.mark.parametrize("d", [16, 64, 256])
@pytest.mark.parametrize("shape", ["lognormal", "bimodal", "quadratic"])
def test_greedy_stay_balances_like_greedy_and_moves_little(d, shape):
    rng = np.random.default_rng(d)
    per_rank = int(rng.integers(20, 60))
    lengths, src = _instance(rng, d, per_rank)
    cost = None
    if shape == "bimodal":  # images next to short text: two length populations
        lengths = np.where(rng.random(lengths.size) < 0.3, lengths * 4, lengths // 4 + 1)
    if shape == "quadratic":  # attention-heavy: quadratic equals linear at 2k tokens
        cost = CostModel("packed", alpha=1.0, beta=1 / 2048)
    greedy = orchmllm.balance(lengths, d, "greedy_cost", src=src, cost=cost)
    stay = orchmllm.balance(lengths, d, "greedy_stay", src=src, cost=cost)
    assert stay.loads.max() <= greedy.loads.max() * (1 + 0.005) * (1 + 1e-12)

    # The bound is in load units: sum over ranks of max(0, load before - makespan).
    weights = (cost or CostModel("packed")).item_costs(lengths)
    load_bound = movement_lower_bound(weights, src, d, stay.loads.max())
    moved_load = weights[stay.dst != src].sum()
    assert load_bound <= moved_load <= 1.5 * load_bound
    # In tokens (fractional relaxation, exact for linear costs) it is a valid bound too.
    token_bound = movement_lower_bound(weights, src, d, stay.loads.max(), sizes=lengths)
    moved = lengths[stay.dst != src].sum()
    assert token_bound <= moved
    if cost is None:
        assert moved <= 1.5 * token_bound
    assert moved < 0.3 * lengths[greedy.dst != src].sum()


@pytest.mark.parametrize("dist", ["llava_image", "librispeech"])
@pytest.mark.parametrize("seed", range(3))
def test_greedy_stay_matches_refined_greedy_on_coarse_batches(dist, seed):
    """Few, quantised items per rank: where greedy's refinement gains most over Alg. 1 alone,
    greedy_stay still ends within 0.5% of the refined greedy and moves far less."""
    rng = np.random.default_rng(seed)
    d = 16
    lengths = sample_lengths(dist, d * 7, rng)
    src = rng.integers(0, d, lengths.size)
    greedy = orchmllm.balance(lengths, d, "greedy", src=src)
    alg1 = orchmllm.balance(lengths, d, "greedy", src=src, refine=False)
    assert greedy.loads.max() <= alg1.loads.max()
    for c in (None, 4):
        stay = orchmllm.balance(lengths, d, "greedy_stay", src=src, ranks_per_node=c)
        assert stay.loads.max() <= greedy.loads.max() * (1 + 0.005) * (1 + 1e-12)
        assert stay.stats["tokens_moved"] < 0.5 * greedy.stats["tokens_moved"]
        bound = movement_lower_bound(lengths, src, d, stay.loads.max())
        assert bound <= stay.stats["tokens_moved"]


def test_greedy_stay_with_placement_keeps_traffic_on_node(rng):
    d, c = 64, 8
    lengths, src = _instance(rng, d, 30)
    a = orchmllm.balance(lengths, d, "greedy_stay", src=src, ranks_per_node=c, placement="auto")
    g = orchmllm.balance(lengths, d, "greedy", src=src, ranks_per_node=c, placement="auto")
    assert a.stats["inter_node_tokens_total_after"] < 0.2 * g.stats["inter_node_tokens_total_after"]


def test_node_aware_greedy_stay_keeps_moves_on_node(rng):
    d, c = 256, 8
    lengths, src = _instance(rng, d, 30)
    w = lengths.astype(float)
    greedy_max = orchmllm.balance(lengths, d, "greedy").loads.max()
    plain = movement_aware_dst(w, src, d)
    nodes = movement_aware_dst(w, src, d, ranks_per_node=c)
    kw = dict(num_ranks=d, ranks_per_node=c)
    for dst in (plain, nodes):
        assert np.bincount(dst, weights=w, minlength=d).max() <= greedy_max * 1.005 * (1 + 1e-12)
    moved = lengths[nodes != src].sum()
    makespan = np.bincount(nodes, weights=w, minlength=d).max()
    assert moved <= 1.5 * movement_lower_bound(w, src, d, makespan)
    t_plain = traffic(lengths, src, plain, **kw)
    t_nodes = traffic(lengths, src, nodes, **kw)
    assert t_nodes.inter_total < 0.5 * t_plain.inter_total
    assert t_nodes.inter_sent.max() <= t_plain.inter_sent.max()


def test_movement_aware_is_deterministic_and_exact_when_balanced():
    src = np.repeat(np.arange(4), 3)
    weights = np.full(12, 10.0)  # already perfectly balanced: nothing may move
    np.testing.assert_array_equal(movement_aware_dst(weights, src, 4), src)
    rng = np.random.default_rng(7)
    w = rng.integers(1, 100, 200).astype(float)
    s = rng.integers(0, 8, 200)
    np.testing.assert_array_equal(movement_aware_dst(w, s, 8), movement_aware_dst(w, s, 8))


@settings(max_examples=60, deadline=None)
@given(
    d=st.integers(2, 3),
    lengths=st.lists(st.integers(1, 60), min_size=2, max_size=7),
    seed=st.integers(0, 99),
)
def test_greedy_stay_moves_the_fewest_tokens_on_small_instances(d, lengths, seed):
    """Against every plan of the instance: no plan within greedy_stay's makespan moves fewer
    tokens (its exact keep-set search runs to the end at these sizes)."""
    l = np.array(lengths, dtype=np.int64)
    src = np.random.default_rng(seed).integers(0, d, l.size)
    a = orchmllm.balance(l, d, "greedy_stay", src=src)
    makespan = a.loads.max()
    plans = every_plan(l.size, d)
    loads = np.stack([np.bincount(p, weights=l, minlength=d) for p in plans])
    fits = loads.max(axis=1) <= makespan
    fewest = min(int(l[p != src].sum()) for p in plans[fits])
    assert a.stats["tokens_moved"] == fewest


@pytest.fixture(scope="module")
def balance_bench():
    """benchmarks/balance_bench.py: its movement cost and its HiGHS minimum, loaded once."""
    return load_script(ROOT / "benchmarks" / "balance_bench.py")


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 60), min_size=2, max_size=7),
    seed=st.integers(0, 99),
)
def test_node_aware_greedy_stay_moves_the_least_on_small_instances(balance_bench, lengths, seed):
    """4 ranks on 2 nodes, against every plan: none within greedy_stay's makespan moves less,
    tokens leaving their node counted twice (the item search runs with nodes; a bound that
    cuts too much is caught by the proven-minimum tests below, where the heuristics alone
    fall short)."""
    d, rpn = 4, 2
    l = np.array(lengths, dtype=np.int64)
    src = np.random.default_rng(seed).integers(0, d, l.size)
    a = orchmllm.balance(l, d, "greedy_stay", src=src, ranks_per_node=rpn)
    plans = every_plan(l.size, d)
    loads = np.stack([np.bincount(p, weights=l, minlength=d) for p in plans])
    fits = plans[loads.max(axis=1) <= a.loads.max()]
    fewest = balance_bench.movement_cost(l, src, fits, rpn).sum(axis=1).min()
    assert balance_bench.movement_cost(l, src, a.dst, rpn).sum() == fewest


# HiGHS's branch-and-bound nodes for a proof of the fewest tokens moved: a count, so a proof
# never depends on the machine's load (the proofs below close in 1-19 nodes).
PROOF_NODES = 1000


def _proof(a) -> dict:
    """min_moved_exact's arguments for a proof: greedy_stay's plan as HiGHS's first incumbent
    (HiGHS then only proves the bound; a plan moving less would still replace it) and a node
    limit, not a time limit."""
    return {"start": a.dst, "node_limit": PROOF_NODES}


@pytest.mark.parametrize("per_rank", [4, 8])
def test_node_aware_greedy_stay_reaches_the_proven_minimum(balance_bench, per_rank):
    """8 ranks on 2 nodes, 4 or 8 LibriSpeech clips each: node-aware greedy_stay moves the
    least HiGHS proves possible within its makespan, counting tokens that leave their node
    twice (what it minimises). The keep-set search does not weigh nodes; the item search does
    (before it ran here, greedy_stay moved 1.32x that at 8 clips), and at 4 clips it needs
    its bound on what must leave each node (1.21x without it)."""
    d, rpn = 8, 4
    lengths = sample_lengths("librispeech", d * per_rank, rng=11 * d + per_rank)
    src = np.repeat(np.arange(d, dtype=np.int64), per_rank)
    a = orchmllm.balance(lengths, d, "greedy_stay", src=src, ranks_per_node=rpn)
    fewest, proven = balance_bench.min_moved_exact(
        lengths, src, d, float(a.loads.max()), ranks_per_node=rpn, **_proof(a)
    )
    assert proven
    moved = balance_bench.movement_cost(lengths, src, a.dst, rpn).sum()
    assert moved == pytest.approx(fewest, abs=1e-6)


@pytest.mark.parametrize("dist, per_rank", [("librispeech", 4), ("librispeech", 8), ("pareto", 6)])
def test_greedy_stay_reaches_the_proven_minimum_where_keep_sets_run_out(
    balance_bench, dist, per_rank
):
    """8 ranks of few long items under a tight limit: ranks below it must trade a short item
    for a long one to make room, so the cheapest keep-sets do not pack and the keep-set search
    spends its budget; the item search still reaches the minimum HiGHS proves (before it,
    greedy_stay moved 1.6-1.7x that on the audio clips). The Pareto lengths fill the limit to
    4 tokens a rank: only the item search's waste bound finds the minimum there (1.45x
    without it)."""
    d = 8
    lengths = sample_lengths(dist, d * per_rank, rng=11 * d + per_rank)
    src = np.repeat(np.arange(d, dtype=np.int64), per_rank)
    a = orchmllm.balance(lengths, d, "greedy_stay", src=src)
    fewest, proven = balance_bench.min_moved_exact(
        lengths, src, d, float(a.loads.max()), **_proof(a)
    )
    assert proven
    assert a.stats["tokens_moved"] == pytest.approx(fewest, abs=1e-6)


def test_greedy_stay_reaches_the_proven_minimum_at_16_ranks(balance_bench):
    """16 ranks x 6 uniform lengths (balance_bench's movement case): the stay-first item search
    spends its nodes under plans that keep heavy items home and shed too much; the second
    order, by the bound each choice leaves, reaches the minimum HiGHS proves (before it,
    greedy_stay moved 1.05x that; 1.25x at 4 items a rank)."""
    d, per_rank = 16, 6
    lengths = sample_lengths("uniform", d * per_rank, rng=11 * d + per_rank)
    src = np.repeat(np.arange(d, dtype=np.int64), per_rank)
    a = orchmllm.balance(lengths, d, "greedy_stay", src=src)
    fewest, proven = balance_bench.min_moved_exact(
        lengths, src, d, float(a.loads.max()), **_proof(a)
    )
    assert proven
    assert a.stats["tokens_moved"] == pytest.approx(fewest, abs=1e-6)


@pytest.mark.parametrize("dist, per_rank", [("llava_image", 4), ("pareto", 6), ("pareto", 8)])
def test_no_pair_of_ranks_can_resplit_greedy_stays_plan_to_move_less(dist, per_rank):
    """On 8 ranks where both exact searches spend their budgets, no two ranks holding at most
    RESPLIT_MAX_ITEMS items together can split them otherwise, within greedy_stay's makespan,
    and move fewer tokens (all 2^k splits of every pair, by brute force here)."""
    d = 8
    lengths = sample_lengths(dist, d * per_rank, rng=11 * d + per_rank)
    src = np.repeat(np.arange(d, dtype=np.int64), per_rank)
    a = orchmllm.balance(lengths, d, "greedy_stay", src=src)
    makespan = a.loads.max()
    for r, q in itertools.combinations(range(d), 2):
        items = np.flatnonzero((a.dst == r) | (a.dst == q))
        if items.size > _core.RESPLIT_MAX_ITEMS:
            continue
        w, home = lengths[items], src[items]
        on_r = (np.arange(2**items.size)[:, None] >> np.arange(items.size)) & 1 == 1
        load_r = on_r @ w
        moved = np.where(on_r, home != r, home != q) @ w
        fits = (load_r <= makespan) & (w.sum() - load_r <= makespan)
        now = int(lengths[items][a.dst[items] != home].sum())
        assert moved[fits].min() >= now, (r, q)


def test_movement_lower_bound_is_a_bound():
    """Exhaustively: no assignment within the makespan moves fewer tokens than the bound."""
    rng = np.random.default_rng(3)
    for _ in range(20):
        n, d = 6, 3
        sizes = rng.integers(1, 20, n)
        weights = sizes + sizes**2 / 10.0
        src = rng.integers(0, d, n)
        assignments = every_plan(n, d)
        loads = np.stack([np.bincount(a, weights=weights, minlength=d) for a in assignments])
        makespan = np.sort(loads.max(axis=1))[len(assignments) // 3]
        feasible = assignments[loads.max(axis=1) <= makespan]
        least = min(sizes[a != src].sum() for a in feasible)
        bound = movement_lower_bound(weights, src, d, makespan, sizes=sizes)
        assert bound <= least + 1e-9
        plain = movement_lower_bound(weights, src, d, makespan)
        excess = np.bincount(src, weights=weights, minlength=d) - makespan
        assert plain == pytest.approx(np.maximum(excess, 0).sum())


@pytest.mark.parametrize(
    "args, match",
    [
        (([1.0, -1.0], [0, 1], 2), "weights"),
        (([1.0, 1.0], [0, 2], 2), "src"),
        (([1.0, 1.0], [0, 1], 0), "num_ranks"),
    ],
)
def test_movement_aware_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        movement_aware_dst(*args)
    with pytest.raises(ValueError, match="tolerance"):
        movement_aware_dst([1.0], [0], 1, tolerance=-0.1)
    with pytest.raises(ValueError, match="sizes"):
        movement_aware_dst([1.0], [0], 1, sizes=[1, 2])
    with pytest.raises(ValueError, match="ranks_per_node"):
        movement_aware_dst([1.0, 1.0], [0, 1], 2, ranks_per_node=3)


# ---------------------------------------------------------------------------------------------
# edges: huge inputs, and the solver-failure warning


def test_huge_inputs_are_refused_with_the_value():
    src, dst = np.array([0, 1]), np.array([1, 0])
    kw = dict(num_ranks=2, ranks_per_node=1)
    with pytest.raises(ValueError, match="9223372036854775808"):
        place_batches(np.array([1, 2**63], dtype=np.uint64), src, dst, **kw)
    with pytest.raises(ValueError, match="sum to at most 2\\*\\*53"):
        traffic([2**62, 2**62], src, dst, **kw)
    too_many = dict(num_ranks=MAX_RANKS * 2, ranks_per_node=1)
    with pytest.raises(ValueError, match=f"num_ranks must be at most MAX_RANKS={MAX_RANKS}"):
        place_batches([1, 2], src, dst, **too_many)
    with pytest.raises(ValueError, match="num_ranks"):
        movement_aware_dst([1.0, 1.0], src, 10**9)
    with pytest.raises(ValueError, match="num_ranks"):
        movement_lower_bound([1.0, 1.0], src, 10**9, 1.0)


_NO_CYLP = """
import sys, warnings
sys.modules["cylp"] = None  # as on a machine without cylp: cvxpy finds no CBC
import numpy as np
import orchmllm
from orchmllm.planner.placement import place_batches
rng = np.random.default_rng(0)
d = 16
lengths = rng.integers(1, 1000, d * 10)
src = np.repeat(np.arange(d), 10)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for step in range(6):
        dst = rng.permutation(src)
        p = place_batches(lengths, src, dst, num_ranks=d, ranks_per_node=4, method="ilp",
                          time_limit_s=1.0)
        a = place_batches(lengths, src, dst, num_ranks=d, ranks_per_node=4, method="assign")
        assert (p.perm == a.perm).all()
        orchmllm.balance(lengths, d, src=src, ranks_per_node=4, placement="ilp")
print(sum("ILP failed" in str(w.message) for w in caught))
"""


@pytest.mark.integration
def test_missing_solver_warns_once_per_process(repo_env):
    """Without cylp the ILP falls back to assign on every call, and says so once, not every
    step (the old code warned 11 times in these 12 calls)."""
    pytest.importorskip("cvxpy")
    proc = subprocess.run(
        [sys.executable, "-c", _NO_CYLP],
        env=repo_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["1"]
