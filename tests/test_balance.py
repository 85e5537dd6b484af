import ast
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import orchmllm
from orchmllm.data.workloads import DISTRIBUTIONS, sample_lengths
from orchmllm.planner.balance import InfeasibleCapError, balance
from orchmllm.planner.cost import CostModel
from orchmllm.planner.placement import MAX_RANKS
from orchmllm.planner.policies import PADDED_POLICIES, POLICIES, REGISTRY, default_cost
from orchmllm.planner.reference import ref_karmarkar_karp, ref_lpt, ref_multifit
from tests.conftest import brute_force_min_load

# greedy_stay is the placement module's algorithm; its own tests check it.
OWN = tuple(p for p in POLICIES if p != "greedy_stay")
CAPPED = ("greedy", "greedy_cost", "greedy_tolerance", "binary_search", "padded_cost", "conv")
QUAD = CostModel("packed", alpha=3.5e-4, beta=3.0e-8, const=0.6)  # H100 hidden-1280 block fit
AUDIO = CostModel("padded", alpha=3.6e-4, beta=6.3e-8, const=0.73)  # H100 audio-10b fit


def _cost_for(policy: str) -> CostModel | None:
    if policy in PADDED_POLICIES:
        return AUDIO
    return QUAD if policy in ("greedy_cost", "kk", "kk_equal") else None


def _with_src(lengths: list[int], d: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, d, size=len(lengths))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(0, 5000), min_size=0, max_size=40),
    d=st.integers(1, 9),
    policy=st.sampled_from(OWN),
    seed=st.integers(0, 2**16),
    capped=st.booleans(),
    refine=st.booleans(),
)
def test_cpp_matches_reference_and_loads(lengths, d, policy, seed, capped, refine):
    src = _with_src(lengths, d, seed)
    n = len(lengths)
    kwargs = {"src": src, "cost": _cost_for(policy), "refine": refine}
    if capped and policy in CAPPED:
        kwargs["max_items_per_rank"] = max(1, -(-n // d))
    a = balance(lengths, d, policy, **kwargs)
    b = balance(lengths, d, policy, backend="python", **kwargs)
    assert a.dst.dtype == np.int64 and a.dst.shape == (n,)
    assert ((a.dst >= 0) & (a.dst < d)).all()
    np.testing.assert_array_equal(a.dst, b.dst)
    cost = kwargs["cost"] or CostModel("padded" if policy in PADDED_POLICIES else "packed")
    expected = [cost.batch_cost(np.asarray(lengths, dtype=np.int64)[a.dst == r]) for r in range(d)]
    np.testing.assert_allclose(a.loads, expected, rtol=1e-12, atol=1e-12)
    if "max_items_per_rank" in kwargs:
        assert np.bincount(a.dst, minlength=d).max() <= kwargs["max_items_per_rank"]
    assert a.stats["tokens_moved"] + a.stats["tokens_kept"] == sum(lengths)
    assert a.stats["imbalance_after"] >= 1.0 - 1e-12
    assert a.stats["gap_to_lb"] >= 1.0 - 1e-12


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(0, 5000) | st.just(0), min_size=1, max_size=40),
    d=st.integers(1, 9),
    policy=st.sampled_from([p for p in (*OWN, "greedy_stay") if p != "identity"]),
    seed=st.integers(0, 2**16),
    capped=st.booleans(),
)
def test_plan_is_never_worse_than_the_source_layout(lengths, d, policy, seed, capped):
    """Balancing never returns a plan whose busiest rank is heavier, under the policy's own
    cost, than the source layout's, where the source layout meets the caps (and, for
    ``kk_equal``, has equal counts); the source layout itself comes back as such."""
    src = _with_src(lengths, d, seed)
    cost = _cost_for(policy) or default_cost(policy)
    kwargs = {"src": src, "cost": cost}
    counts = np.bincount(src, minlength=d)
    if capped:
        kwargs["max_items_per_rank"] = int(counts.max())
    a = balance(lengths, d, policy, **kwargs)
    before = cost.loads(np.asarray(lengths), src, d).max()
    if policy != "kk_equal" or counts.max() - counts.min() <= 1:
        assert a.loads.max() <= before
    if a.stats["kept_source"]:
        np.testing.assert_array_equal(a.dst, src)
        assert a.stats["tokens_moved"] == 0


def test_conv_keeps_a_lighter_source_layout():
    """conv (Alg. 5) alone puts 4 and 1 together (padded cost 8); the source layout's busiest
    rank costs 6, so it comes back unchanged, flagged ``kept_source``."""
    lengths, src = [4, 2, 2, 1], np.array([1, 0, 0, 0])
    alone = balance(lengths, 2, "conv")
    a = balance(lengths, 2, "conv", src=src)
    assert alone.loads.max() == 8.0
    assert a.dst.tolist() == src.tolist() and a.loads.max() == 6.0
    assert a.stats["kept_source"] == 1.0 and a.stats["tokens_moved"] == 0


@pytest.mark.parametrize("dist", DISTRIBUTIONS)
def test_cpp_matches_reference_on_workloads(dist):
    lengths = sample_lengths(dist, 24 * 16, rng=7)
    for policy in OWN:
        kwargs = {"cost": _cost_for(policy), "src": np.repeat(np.arange(24), 16)}
        a = balance(lengths, 24, policy, **kwargs).dst
        np.testing.assert_array_equal(
            a, balance(lengths, 24, policy, backend="python", **kwargs).dst
        )


def test_portfolio_multifit_with_zero_lengths_first_matches_reference():
    """Without a binding cap the portfolio plans only the non-zero items, whose indices here
    all lie past their count (65 zeros first). MULTIFIT once wrote its trial plans by item index
    into scratch sized by that count: a heap overflow that aborted the process (SIGABRT), at
    once or in a later call. On a fresh thread its scratch starts empty, so the overflow could
    not land in room left by earlier calls; MULTIFIT's plan wins on this draw."""
    rng = np.random.default_rng(115)
    lengths = np.concatenate([np.zeros(65, dtype=np.int64), rng.integers(1, 5000, size=65)])
    with ThreadPoolExecutor(1) as pool:
        a = pool.submit(balance, lengths, 5, "greedy_cost", cost=QUAD).result()
    b = balance(lengths, 5, "greedy_cost", cost=QUAD, backend="python")
    np.testing.assert_array_equal(a.dst, b.dst)
    assert a.loads.max() == b.loads.max()


@pytest.mark.parametrize("tolerance", [0.0, 0.01, 0.3])
def test_greedy_tolerance_tree_matches_reference_with_wide_windows(tolerance):
    # Short lengths on many ranks: most ranks sit inside the window, sums tie often.
    lengths = np.random.default_rng(9).integers(1, 20, size=96 * 12)
    kwargs = {"tolerance": tolerance, "max_items_per_rank": 13}
    a = balance(lengths, 96, "greedy_tolerance", **kwargs).dst
    np.testing.assert_array_equal(
        a, balance(lengths, 96, "greedy_tolerance", backend="python", **kwargs).dst
    )


def test_deterministic_and_thread_safe():
    lengths = sample_lengths("text", 64 * 60, rng=3)
    serial = [balance(lengths, 64, p, cost=_cost_for(p)).dst for p in OWN if p != "identity"]
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(balance, lengths, 64, p, cost=_cost_for(p)) for p in OWN[1:]]
        parallel = [f.result().dst for f in futures]
    for s, p in zip(serial, parallel, strict=True):
        np.testing.assert_array_equal(s, p)


def test_ties_break_by_index():
    a = balance([5, 5, 5, 5], 2, "greedy")
    assert a.dst.tolist() == [0, 1, 0, 1]


@pytest.mark.parametrize("dist", ["librispeech", "spoken_qa", "uniform"])
def test_default_greedy_is_never_worse_than_a_peer_at_512_ranks(dist):
    """At 512 ranks x 16 items per rank (8,192 items: past full KK's work limit) the
    portfolio's equal-counts KK, MULTIFIT and wide refinement keep greedy at or below LPT, KK
    (both variants: verl's is the equal-counts one) and MULTIFIT, on the benchmark's draws
    (seed 512,016) where greedy was behind by 1 to 17 tokens (the Python MULTIFIT takes about
    2 s per instance, hence three)."""
    d = 512
    lengths = sample_lengths(dist, d * 16, rng=np.random.default_rng(512_016))
    w = lengths.astype(np.float64)
    n = lengths.size
    ours = _max_load(lengths, balance(lengths, d).dst, d)
    order = sorted(range(n), key=lambda i: (-w[i], i))
    assert ours <= _max_load(lengths, ref_lpt(w, d, n), d)
    assert ours <= _max_load(lengths, ref_multifit(w.tolist(), order, d, n), d)
    for equal in (False, True):  # the core's KK: the reference's plan, checked above
        assert ours <= _max_load(lengths, orchmllm._core.karmarkar_karp(w, d, equal), d)


# ---------------------------------------------------------------------------------------------
# quality against the exact optimum (brute force over all d^n assignments)


def test_greedy_within_lpt_bound_of_optimum():
    rng = np.random.default_rng(0)
    packed = CostModel("packed")
    for trial in range(40):
        d = 2 + trial % 2
        lengths = rng.integers(1, 100, size=rng.integers(d + 1, 9 if d == 2 else 8))
        opt = brute_force_min_load(lengths, d, packed, lengths.size)
        for refine in (False, True):  # Alg. 1 alone, and with the local search after it
            got = balance(lengths, d, "greedy", refine=refine).loads.max()
            assert got <= (4 / 3 - 1 / (3 * d)) * opt + 1e-9


@settings(max_examples=80, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 3000), min_size=1, max_size=60),
    d=st.integers(1, 8),
    policy=st.sampled_from(("greedy", "greedy_cost")),
    capped=st.booleans(),
)
def test_refine_never_raises_max_load(lengths, d, policy, capped):
    kwargs = {"cost": _cost_for(policy)}
    if capped:
        kwargs["max_items_per_rank"] = -(-len(lengths) // d)
    plain = balance(lengths, d, policy, refine=False, **kwargs)
    refined = balance(lengths, d, policy, **kwargs)
    assert refined.loads.max() <= plain.loads.max() * (1 + 1e-12)
    assert refined.dst.shape == (len(lengths),) and ((refined.dst >= 0) & (refined.dst < d)).all()
    assert refined.loads.sum() == pytest.approx(plain.loads.sum(), rel=1e-12)
    if capped:
        assert np.bincount(refined.dst, minlength=d).max() <= kwargs["max_items_per_rank"]


def _max_load(lengths: list[int], dst, d: int) -> int:
    return int(np.bincount(np.asarray(dst, dtype=np.int64), weights=lengths, minlength=d).max())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(1, 5000), min_size=2, max_size=48)
    | st.lists(st.integers(1, 60), min_size=2, max_size=48),
    d=st.integers(2, 9),
)
def test_default_greedy_is_never_worse_than_lpt_kk_or_multifit(lengths, d):
    """The default packed policy is a portfolio: on every instance its max load is at most
    that of the plain-Python LPT, Karmarkar-Karp and MULTIFIT references (the issue measured
    verl's KK and prtpy's MULTIFIT beating the old refined LPT by up to 2%)."""
    w = np.asarray(lengths, dtype=np.float64)
    ours = _max_load(lengths, balance(lengths, d).dst, d)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    n = len(lengths)
    assert ours <= _max_load(lengths, ref_lpt(w, d, n), d)
    assert ours <= _max_load(lengths, ref_karmarkar_karp(w, d, False), d)
    assert ours <= _max_load(lengths, ref_multifit(w.tolist(), order, d, n), d)


def test_portfolio_takes_kk_where_refined_lpt_loses():
    """On this instance the old default (refined LPT alone) reached 2217 and KK 2216: the
    portfolio takes KK's plan, and the C++ core agrees with the reference."""
    lengths = [869, 293, 938, 2, 77, 973, 943, 299, 140, 314, 44, 891, 663, 585, 245]
    lengths += [471, 191, 773, 475, 31, 255, 707, 520, 374, 254, 91, 608, 660, 520]
    a = balance(lengths, 6)
    assert _max_load(lengths, a.dst, 6) <= 2216
    np.testing.assert_array_equal(a.dst, balance(lengths, 6, backend="python").dst)


def test_refine_closes_most_of_the_gap_at_16_items_per_rank():
    # Alg. 1 alone ends about 1.1% above the bound on LLaVA image patches at 512 x 16.
    lengths = sample_lengths("llava_image", 512 * 16, rng=512 + 16)
    plain = balance(lengths, 512, "greedy", refine=False).stats["gap_to_lb"]
    refined = balance(lengths, 512, "greedy").stats["gap_to_lb"]
    assert plain > 1.01 and refined < 1.005


def test_padded_searches_are_exact_on_their_objective():
    # Optimal padded batches are contiguous in length order, so the bound search is exact.
    rng = np.random.default_rng(1)
    for trial in range(30):
        d = 2 + trial % 2
        lengths = rng.integers(1, 60, size=rng.integers(d + 1, 8))
        proxy = brute_force_min_load(lengths, d, CostModel("padded"), lengths.size)
        assert balance(lengths, d, "binary_search").loads.max() == proxy
        full = brute_force_min_load(lengths, d, AUDIO, lengths.size)
        got = balance(lengths, d, "padded_cost", cost=AUDIO).loads.max()
        assert got == pytest.approx(full, rel=1e-12)


def test_binary_search_never_worse_than_unbalanced():
    rng = np.random.default_rng(2)
    for _ in range(50):
        d = int(rng.integers(1, 17))
        lengths = rng.integers(1, 3000, size=int(rng.integers(1, 200)))
        src = rng.integers(0, d, size=lengths.size)
        a = balance(lengths, d, "binary_search", src=src)
        assert a.loads.max() <= CostModel("padded").loads(lengths, src, d).max()
        assert len(a.loads) == d


def test_greedy_cost_beats_greedy_tolerance_on_quadratic_objective():
    rng = np.random.default_rng(3)
    diffs = []
    for _ in range(200):
        d = int(rng.integers(2, 17))
        lengths = sample_lengths("pareto", d * int(rng.integers(2, 9)), rng=rng) * 4
        gc = QUAD.loads(lengths, balance(lengths, d, "greedy_cost", cost=QUAD).dst, d).max()
        gt = QUAD.loads(lengths, balance(lengths, d, "greedy_tolerance").dst, d).max()
        diffs.append(gt / gc - 1)
    assert np.mean(diffs) >= 0


def test_padded_cost_closes_binary_search_gap_on_audio():
    # Alg. 2 balances count*max; under the measured audio cost the slowest batch stays slower.
    rng = np.random.default_rng(4)
    ratios = []
    for _ in range(5):
        lengths = sample_lengths("spoken_qa", 64 * 16, rng=rng) // 2
        bs = balance(lengths, 64, "binary_search", cost=AUDIO)
        pc = balance(lengths, 64, "padded_cost", cost=AUDIO)
        ratios.append(pc.loads.max() / bs.loads.max())
        assert pc.stats["imbalance_after"] < bs.stats["imbalance_after"]
    assert max(ratios) <= 1.0


def test_packed_policies_near_lower_bound_with_many_items():
    for dist in DISTRIBUTIONS:
        lengths = sample_lengths(dist, 512 * 16, rng=5)
        # kk_equal is left out: equal counts can force a long item onto a full rank.
        for policy in ("greedy", "greedy_cost", "kk"):
            assert balance(lengths, 512, policy).stats["gap_to_lb"] < 1.01, (dist, policy)


# ---------------------------------------------------------------------------------------------
# constraints


def test_item_caps_are_enforced():
    lengths = sample_lengths("pareto", 8 * 10 + 3, rng=6)
    for policy in (*CAPPED, "kk_equal"):
        a = balance(lengths, 8, policy, max_items_per_rank=11, cost=_cost_for(policy))
        assert np.bincount(a.dst, minlength=8).max() <= 11, policy
    counts = np.bincount(balance(lengths, 8, "kk_equal").dst, minlength=8)
    assert counts.max() - counts.min() <= 1


def test_impossible_caps_name_the_smallest_value():
    lengths = [10] * 9
    with pytest.raises(ValueError, match=r"max_items_per_rank=2 .* smallest value that works is 3"):
        balance(lengths, 4, "greedy", max_items_per_rank=2)
    with pytest.raises(ValueError, match=r"max_items_per_rank=3 .* smallest value .* is 9"):
        balance(lengths, 4, "identity", src=[0] * 9, max_items_per_rank=3)
    with pytest.raises(ValueError, match=r"max_load_per_rank=20 .* smallest value .* is 30"):
        balance(lengths, 4, "greedy", max_load_per_rank=20)
    assert balance(lengths, 4, "greedy", max_load_per_rank=30).loads.max() == 30


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from([p for p in POLICIES if p != "identity"]),
    d=st.integers(2, 3),
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=7),
    slack=st.integers(0, 7),
    items_cap=st.booleans(),
    load_factor=st.sampled_from([None, 0.8, 0.99, 1.0, 1.02]),
    seed=st.integers(0, 99),
)
def test_caps_are_met_whenever_a_plan_exists(
    policy, d, lengths, slack, items_cap, load_factor, seed
):
    """Against every plan of the instance: a cap some plan meets is met, whatever the policy
    would plan alone; one no plan meets raises, naming the exact smallest value."""
    n, cost = len(lengths), _cost_for(policy) or default_cost(policy)
    cap = min(n, -(-n // d) + slack) if items_cap else n
    least = brute_force_min_load(lengths, d, cost, cap)
    kwargs = {"src": _with_src(lengths, d, seed), "cost": cost}
    if items_cap:
        kwargs["max_items_per_rank"] = cap
    if load_factor is not None:
        kwargs["max_load_per_rank"] = least * load_factor if least > 0 else 1.0
    if load_factor is None or least <= kwargs["max_load_per_rank"]:
        a = balance(lengths, d, policy, **kwargs)
        assert np.bincount(a.dst, minlength=d).max() <= cap
        assert a.loads.max() <= kwargs.get("max_load_per_rank", np.inf)
    else:
        with pytest.raises(InfeasibleCapError, match="max_load_per_rank=") as raised:
            balance(lengths, d, policy, **kwargs)
        assert raised.value.proven
        assert raised.value.smallest == pytest.approx(least, rel=1e-9)


def test_caps_unmet_on_a_large_instance_say_what_was_found():
    lengths = sample_lengths("pareto", 64 * 16, rng=3)
    below = float(lengths.sum()) / 64 * 0.99  # under the mean: no plan exists
    with pytest.raises(InfeasibleCapError, match="no plan was found under it") as raised:
        balance(lengths, 64, "greedy", max_load_per_rank=below)
    e = raised.value
    assert not e.proven and e.argument == "max_load_per_rank" and e.value == below
    assert below < e.lower_bound <= e.smallest


def test_steered_caps_keep_greedy_stay_moving_little():
    """Under an item cap greedy_stay's own plan breaks, the capped fallback is placed whole on
    the ranks holding most of its tokens: it keeps more tokens home than the fallback as is."""
    lengths = sample_lengths("pareto", 8 * 12, rng=4)
    src = np.repeat(np.arange(8), 12)
    cap = 12
    stay = balance(lengths, 8, "greedy_stay", src=src, max_items_per_rank=cap)
    plain = balance(lengths, 8, "greedy_cost", src=src, max_items_per_rank=cap)
    assert np.bincount(stay.dst, minlength=8).max() <= cap
    assert stay.stats["tokens_kept"] >= plain.stats["tokens_kept"]
    assert stay.loads.max() == plain.loads.max()


# ---------------------------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"lengths": [1, -2]}, "lengths"),
        ({"lengths": [1.5, 2]}, "lengths"),
        ({"lengths": [[1, 2]]}, "lengths"),
        ({"lengths": ["a"]}, "lengths"),
        ({"num_ranks": 0}, "num_ranks"),
        ({"num_ranks": 2.5}, "num_ranks"),
        ({"num_ranks": True}, "num_ranks"),
        ({"src": [0]}, "src"),
        ({"src": [0, 4]}, "src"),
        ({"src": [0, -1]}, "src"),
        ({"policy": "magic"}, "policy"),
        ({"placement": "magic"}, "placement"),
        ({"placement": "auto"}, "placement"),
        ({"cost": CostModel("padded")}, "cost"),
        ({"cost": "packed"}, "cost"),
        ({"policy": "identity"}, "src"),
        ({"max_items_per_rank": 0}, "max_items_per_rank"),
        ({"max_load_per_rank": -1.0}, "max_load_per_rank"),
        ({"ranks_per_node": 0}, "ranks_per_node"),
        ({"tolerance": -0.1}, "tolerance"),
        ({"refine": "yes"}, "refine"),
        ({"backend": "gpu"}, "backend"),
    ],
)
def test_bad_input_names_argument(kwargs, name):
    call = {"lengths": [3, 4], "num_ranks": 4, "policy": "greedy", **kwargs}
    with pytest.raises(ValueError, match=name):
        balance(call.pop("lengths"), call.pop("num_ranks"), call.pop("policy"), **call)


def test_padded_policy_rejects_packed_cost():
    with pytest.raises(ValueError, match="cost"):
        balance([1, 2], 2, "binary_search", cost=CostModel("packed"))


def test_public_names():
    assert orchmllm.POLICIES == POLICIES
    assert orchmllm.balance is balance
    a = orchmllm.balance([], 3)
    assert a.dst.shape == (0,) and a.loads.tolist() == [0.0, 0.0, 0.0]


def test_stats_with_src():
    lengths = np.array([8, 1, 1, 1, 1])
    a = balance(lengths, 2, "greedy", src=[0, 0, 0, 1, 1])
    assert a.stats["imbalance_before"] == pytest.approx(10 / 6)
    assert a.stats["imbalance_after"] == pytest.approx(8 / 6)
    assert a.stats["gap_to_lb"] == pytest.approx(1.0)  # the single item of 8 is the bound
    assert a.stats["tokens_moved"] + a.stats["tokens_kept"] == 12


def test_greedy_stay_and_placement_dispatch():
    pytest.importorskip("orchmllm.planner.placement")
    lengths = sample_lengths("text", 8 * 8, rng=8)
    src = np.repeat(np.arange(8), 8)
    stay = balance(lengths, 8, "greedy_stay", src=src)
    greedy = balance(lengths, 8, "greedy", src=src)
    assert stay.stats["tokens_moved"] <= greedy.stats["tokens_moved"]
    placed = balance(lengths, 8, "greedy", src=src, ranks_per_node=4, placement="assign")
    assert sorted(placed.loads.tolist()) == pytest.approx(sorted(greedy.loads.tolist()))
    for r in range(8):
        assert placed.loads[r] == pytest.approx(lengths[placed.dst == r].sum())
    assert "inter_node_tokens_total_after" in placed.stats
    after = placed.stats["inter_node_tokens_total_after"]
    assert after <= placed.stats["inter_node_tokens_total_before"]


def test_greedy_stay_passes_ranks_per_node_and_reports_the_movement_bound():
    from orchmllm.planner.placement import movement_aware_dst, movement_lower_bound, traffic

    d, c = 64, 8
    rng = np.random.default_rng(5)
    lengths = sample_lengths("text", d * 30, rng=rng)
    src = np.repeat(np.arange(d), 30)
    plain = balance(lengths, d, "greedy_stay", src=src)
    nodes = balance(lengths, d, "greedy_stay", src=src, ranks_per_node=c)
    w = lengths.astype(np.float64)
    np.testing.assert_array_equal(nodes.dst, movement_aware_dst(w, src, d, ranks_per_node=c))
    np.testing.assert_array_equal(plain.dst, movement_aware_dst(w, src, d))
    inter = [
        traffic(lengths, src, a.dst, num_ranks=d, ranks_per_node=c).inter_total
        for a in (plain, nodes)
    ]
    assert inter[1] < 0.5 * inter[0]

    for a in (plain, nodes):
        bound = a.stats["tokens_moved_lower_bound"]
        assert bound == movement_lower_bound(w, src, d, a.loads.max(), sizes=lengths)
        assert 0 < bound <= a.stats["tokens_moved"] <= 1.5 * bound
    # Costs other than tokens: the bound is in tokens, for the makespan in cost units.
    quad = balance(lengths, d, "greedy_stay", src=src, cost=QUAD)
    assert quad.stats["tokens_moved_lower_bound"] <= quad.stats["tokens_moved"]
    assert "tokens_moved_lower_bound" not in balance(lengths, d, "greedy", src=src).stats
    with pytest.raises(ValueError, match="ranks_per_node"):
        balance(lengths, d, "greedy_stay", src=src, ranks_per_node=6)


# ---------------------------------------------------------------------------------------------
# the planner floor's imports


def test_planner_floor_imports_at_module_top_and_placement_sits_below_balance():
    """No ``orchmllm`` import inside a function (the old balance <-> placement circle hid
    there), and placement.py never imports balance.py or the policies."""
    root = Path(orchmllm.__file__).parent / "planner"
    for name in (
        "balance.py",
        "policies.py",
        "reference.py",
        "stats.py",
        "validate.py",
        "placement.py",
    ):
        tree = ast.parse((root / name).read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom | ast.Import):
                    mods = [node.module] if isinstance(node, ast.ImportFrom) else []
                    mods += [a.name for a in node.names] if isinstance(node, ast.Import) else []
                    assert not any(m and m.startswith("orchmllm") for m in mods), (name, fn.name)
    placement = ast.parse((root / "placement.py").read_text())
    imported = {n.module for n in ast.walk(placement) if isinstance(n, ast.ImportFrom)}
    assert not imported & {"orchmllm.planner.balance", "orchmllm.planner.policies"}


# ---------------------------------------------------------------------------------------------
# edges: huge lengths, huge num_ranks, all-zero lengths


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(0, 2**63 - 1), min_size=1, max_size=12),
    d=st.integers(1, 5),
    policy=st.sampled_from(POLICIES),
    seed=st.integers(0, 2**16),
)
def test_lengths_near_int64_max_match_the_reference(lengths, d, policy, seed):
    """Every policy's C++ core equals the exact Python reference on lengths up to 2**63 - 1,
    keeps every item on a real rank, and counts tokens without int64 overflow."""
    src = _with_src(lengths, d, seed)
    a = balance(lengths, d, policy, src=src)
    b = balance(lengths, d, policy, src=src, backend="python")
    np.testing.assert_array_equal(a.dst, b.dst)
    assert ((a.dst >= 0) & (a.dst < d)).all()
    assert a.stats["tokens_moved"] + a.stats["tokens_kept"] == pytest.approx(float(sum(lengths)))
    assert a.stats["tokens_moved"] >= 0 and a.stats["tokens_kept"] >= 0


@pytest.mark.parametrize("d", [3, 4097])
@pytest.mark.parametrize("above", [False, True])
def test_least_loaded_tree_keys_agree_at_their_limit(d, above):
    """The LPT tree packs (load, rank) into 64 bits while the total stays below
    min(2**53, 2**(64 - rank bits) - 1), and takes 128-bit keys above: plans on both sides of
    that limit equal the Python reference, ties among equal loads included (above it, every rank
    ends past the limit, where a packed load would wrap)."""
    limit = min(2**53, 2 ** (64 - (d - 1).bit_length()) - 1)
    n = 3 * d
    if above:
        lengths = [limit // 2 + 1 + i % 5 for i in range(n)]
    else:
        lengths = [(limit - 1) // n - i % 5 for i in range(n)]
    assert (sum(lengths) < limit) != above
    a = balance(lengths, d, refine=False)
    np.testing.assert_array_equal(a.dst, balance(lengths, d, refine=False, backend="python").dst)


def test_binary_search_on_huge_lengths():
    """128-bit count x length: the old int64 product wrapped around, putting every item on
    rank 0, or opening a fourth batch on three ranks (IndexError)."""
    np.testing.assert_array_equal(balance([2**62] * 4, 4, "binary_search").dst, [0, 1, 2, 3])
    a = balance([10**18] * 40, 3, "binary_search")
    assert np.bincount(a.dst, minlength=3).tolist() == [14, 14, 12]
    assert a.loads.tolist() == [14e18, 14e18, 12e18]
    # greedy_tolerance's window is a fraction of the exact sum (2**63 + 7 here: the int64 sum
    # went negative and crashed the core)
    lengths = [2**62, 2**62 - 1, 5, 3]
    a = balance(lengths, 2, "greedy_tolerance")
    np.testing.assert_array_equal(
        a.dst, balance(lengths, 2, "greedy_tolerance", backend="python").dst
    )
    assert a.dst[0] != a.dst[1]  # one of the two huge items on each rank


def test_cost_that_overflows_float64_is_refused():
    huge = CostModel("packed", alpha=1e300)
    with pytest.raises(ValueError, match="cost overflows float64"):
        balance([10**18, 5], 2, "greedy_cost", cost=huge)
    assert balance([10, 5], 2, "greedy_cost", cost=huge).loads.max() == 1e301


@pytest.mark.parametrize(
    "lengths,shown",
    [
        ([2**63], "9223372036854775808"),
        (np.array([1, 2**63 + 1], dtype=np.uint64), "9223372036854775809"),
        ([3, 2**63 + 5], "9223372036854775813"),  # numpy reads this list as float64
        ([2**64], "18446744073709551616"),
        ([1e19], "1e+19"),
    ],
)
def test_lengths_beyond_int64_name_the_real_value(lengths, shown):
    with pytest.raises(ValueError, match=rf"lengths must be int64 .* got {re.escape(shown)} at"):
        balance(lengths, 2)


def test_num_ranks_has_an_upper_bound():
    start = time.perf_counter()
    with pytest.raises(ValueError, match=rf"num_ranks must be at most MAX_RANKS={MAX_RANKS}"):
        balance([1, 2, 3], 10**9)
    assert time.perf_counter() - start < 1.0
    a = balance([5, 1, 2], MAX_RANKS, "greedy")
    assert sorted(a.dst.tolist()) == [0, 1, 2] and a.loads.size == MAX_RANKS


@pytest.mark.parametrize("policy", POLICIES)
def test_all_zero_lengths_are_dealt_out_by_count(policy):
    """Nothing to balance: the policies that plan from scratch deal items out in index order
    (they used to pile everything on rank 0); identity and greedy_stay keep them in place."""
    src = np.zeros(10, dtype=np.int64)
    stays = REGISTRY[policy].needs_src
    cap = {} if stays else {"max_items_per_rank": 4}  # the deal meets the tightest cap
    a = balance(np.zeros(10, dtype=np.int64), 3, policy, src=src, **cap)
    b = balance(np.zeros(10, dtype=np.int64), 3, policy, src=src, backend="python")
    expected = src if stays else np.arange(10) % 3
    np.testing.assert_array_equal(a.dst, expected)
    np.testing.assert_array_equal(b.dst, expected)


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(0, 5000), min_size=0, max_size=40), d=st.integers(1, 9))
def test_fast_default_call_matches_the_validating_path(lengths, d):
    """balance(int64 array, d) takes the core's one-call path; a list takes the validating
    path: same plan, loads and statistics (computed lazily on first read)."""
    fast = balance(np.asarray(lengths, dtype=np.int64), d)
    slow = balance(lengths, d)
    np.testing.assert_array_equal(fast.dst, slow.dst)
    np.testing.assert_array_equal(fast.loads, slow.loads)
    assert dict(fast.stats) == dict(slow.stats)


def test_fast_default_call_keeps_every_check():
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        balance(np.array([3, -1, 2], dtype=np.int64), 2)
    with pytest.raises(ValueError, match="num_ranks"):
        balance(np.array([3, 1], dtype=np.int64), 0)
    with pytest.raises(ValueError, match="lengths must be 1-D"):
        balance(np.ones((2, 2), dtype=np.int64), 2)
    np.testing.assert_array_equal(balance(np.zeros(5, dtype=np.int64), 2).dst, [0, 1, 0, 1, 0])
