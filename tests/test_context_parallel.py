import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import orchmllm
from orchmllm.planner.balance import InfeasibleCapError, balance
from orchmllm.planner.context_parallel import Pieces, largest_pieces
from orchmllm.planner.cost import CostModel
from orchmllm.planner.step_options import StepOptions
from orchmllm.planner.step_plan import plan_step
from orchmllm.schema import IMAGE, TEXT
from tests.payloads import PHASES, gathered, payload_example

QUAD = CostModel("packed", alpha=3.5e-4, beta=3.0e-8, const=0.6)  # H100 hidden-1280 block fit
TOKENS = CostModel("packed")


def _check_plan(lengths, d, n, cost, a, rpn=None):
    """Every property the record promises: each token placed once, pieces contiguous with
    load-balanced chunking inside one group, the loads those of the cost model."""
    lengths = np.asarray(lengths, dtype=np.int64)
    p = a.pieces
    split = set(p.item.tolist())
    assert split == {i for i in range(lengths.size) if a.dst[i] == -1}
    whole = a.dst >= 0
    assert (a.dst[whole] < d).all()
    assert (np.diff(p.item) >= 0).all()
    expected = np.zeros(d)
    busy = np.zeros(d, dtype=bool)
    np.add.at(expected, a.dst[whole], cost.item_costs(lengths[whole]))
    busy[a.dst[whole]] = True
    placed = int(lengths[whole].sum())
    for i in split:
        rows = p.of(i)
        order = np.argsort(rows.start, kind="stable")
        starts, ends, ranks = rows.start[order], rows.end[order], rows.rank[order]
        assert (starts == np.sort(rows.start)).all() and starts[0] == 0 and ends[-1] == lengths[i]
        np.testing.assert_array_equal(starts[1:], ends[:-1])  # contiguous, no overlap
        assert (ends > starts).all()
        owners = np.unique(ranks)
        k = owners.size
        assert 2 <= k <= n and len(set((owners // n).tolist())) == 1  # one group
        if rpn is not None and k <= rpn:
            assert len(set((owners // rpn).tolist())) == 1  # one node when it holds them
        tokens = np.array([int((ends - starts)[ranks == r].sum()) for r in owners])
        assert tokens.min() >= 1 and tokens.max() - tokens.min() <= 1
        # chunk j and chunk 2k-1-j: ranks ascending from the start, then descending to the end
        top = int(np.argmax(ranks))
        assert (np.diff(ranks[: top + 1]) > 0).all() and (np.diff(ranks[top:]) < 0).all()
        assert all(np.count_nonzero(ranks == r) <= 2 for r in owners)
        np.add.at(expected, owners, cost.piece_costs(lengths[i], tokens, k))
        busy[owners] = True
        placed += int(tokens.sum())
    assert placed == int(lengths.sum())  # every token exactly once
    expected += cost.multiplier * cost.const * busy
    np.testing.assert_allclose(a.loads, expected, rtol=1e-12, atol=1e-12)


def test_exact_small_case_by_hand():
    """8 tokens over a budget of 7 on 2 ranks: the item is cut in two pieces of 4, each two
    chunks of 2 (chunk 0 and 3 on rank 0, chunks 1 and 2, adjacent, on rank 1), and the two
    short items fill the ranks to 6 each."""
    a = balance([8, 2, 2], 2, max_load_per_rank=7, context_parallel=2)
    np.testing.assert_array_equal(a.dst, [-1, 0, 1])
    np.testing.assert_array_equal(a.loads, [6.0, 6.0])
    np.testing.assert_array_equal(a.pieces.item, [0, 0, 0])
    np.testing.assert_array_equal(a.pieces.rank, [0, 1, 0])
    np.testing.assert_array_equal(a.pieces.start, [0, 2, 6])
    np.testing.assert_array_equal(a.pieces.end, [2, 6, 8])
    assert a.stats["items_split"] == 1.0 and a.stats["pieces"] == 2.0
    with pytest.raises(InfeasibleCapError, match="max_load_per_rank=7"):
        balance([8, 2, 2], 2, max_load_per_rank=7)  # without splitting it cannot fit


def test_split_lowers_the_slowest_rank_without_any_item_over_the_budget():
    """The long item in 4 pieces (the threshold t = the mean) leaves the busiest rank at 35;
    the finer thresholds also cut the short items and reach 34 (the bound is 33)."""
    lengths = [100, 10, 10, 10]
    whole = balance(lengths, 4, max_load_per_rank=1000)
    a = balance(lengths, 4, max_load_per_rank=1000, context_parallel=4)
    assert whole.loads.max() == 100.0
    np.testing.assert_array_equal(a.loads, [33.0, 34.0, 31.0, 32.0])
    assert a.stats["items_split"] == 4.0 and a.stats["gap_to_lb"] == pytest.approx(34 / 32.5)
    # 100 tokens in 8 chunks on 4 ranks: 12/13 from the front, 13/12 from the back
    first = a.pieces.of(0)
    np.testing.assert_array_equal(first.rank, [0, 1, 2, 3, 2, 1, 0])
    np.testing.assert_array_equal(first.start, [0, 12, 24, 36, 61, 74, 87])
    np.testing.assert_array_equal(first.end, [12, 24, 36, 61, 74, 87, 100])
    _check_plan(lengths, 4, 4, TOKENS, a)


def test_finer_thresholds_balance_items_just_below_the_mean():
    """Items a little under the mean load stay whole at the first threshold, and LPT over
    them leaves ranks far apart; a finer threshold cuts them and evens the ranks."""
    lengths = [90] * 5 + [10] * 5
    whole = balance(lengths, 4)
    a = balance(lengths, 4, context_parallel=4)
    assert whole.loads.max() == 180.0  # two of the five long items on one rank
    assert a.loads.max() <= 130.0  # the mean, 125, plus a piece
    _check_plan(lengths, 4, 4, TOKENS, a)


def test_no_split_when_it_does_not_help():
    """Items already even stay whole: the plan is the whole-item portfolio's."""
    lengths = [7, 5, 5, 3, 2, 2]
    a = balance(lengths, 2, context_parallel=2)
    b = balance(lengths, 2)
    assert a.pieces.item.size == 0
    np.testing.assert_array_equal(a.dst, b.dst)
    np.testing.assert_array_equal(a.loads, b.loads)


def test_quadratic_piece_costs_are_equal_and_sum_to_the_item():
    """Load-balanced chunking evens out the quadratic term: every piece of a split item costs
    the same up to its one extra token, and the pieces sum to the item."""
    l, k = 100_000, 4
    tokens = np.array([25_000] * k)
    pieces = QUAD.piece_costs(l, tokens, k)
    assert np.ptp(pieces) == 0.0
    assert pieces.sum() == pytest.approx(float(QUAD.item_costs([l])[0]), rel=1e-12)
    a = balance([l, 10, 10], 8, "greedy_cost", cost=QUAD, context_parallel=4)
    assert a.pieces.items.tolist() == [0]
    _check_plan([l, 10, 10], 8, 4, QUAD, a)
    with pytest.raises(ValueError, match="padded"):
        CostModel("padded").piece_costs(l, tokens, k)


@st.composite
def _instances(draw):
    n = draw(st.sampled_from([1, 2, 4]))
    d = n * draw(st.integers(1, 4))
    lengths = draw(st.lists(st.integers(0, 3000) | st.integers(0, 40), min_size=0, max_size=30))
    cost = draw(st.sampled_from([TOKENS, QUAD]))
    rpn = draw(st.sampled_from([None, n, d, max(1, n // 2)]))
    return lengths, d, n, cost, rpn


def _guarantee(lengths, d, n, cost):
    """The budget the last candidate always meets (``balance``'s docstring), with float slack."""
    l = np.asarray(lengths, dtype=np.int64)
    w = cost.item_costs(l)
    heavy = largest_pieces(l[l >= n], n, cost).max(initial=0.0) + cost.multiplier * cost.alpha
    short = w[l < n].max(initial=0.0)
    bound = w.sum() / d + max(heavy, short) + cost.multiplier * cost.const
    return bound * (1 + 1e-9) + 1e-9


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_instances(), fraction=st.floats(0.0, 1.5), seed=st.integers(0, 2**16))
def test_plan_properties(case, fraction, seed):
    """Tokens conserved, budget held on every rank, pieces contiguous and inside one group,
    never heavier than without ``src`` (the source layout only replaces a heavier plan),
    deterministic (twice the same; a shuffled input the same loads and the same split items'
    lengths and pieces' token counts); raises only below the guaranteed bound."""
    lengths, d, n, cost, rpn = case
    policy = "greedy_cost" if cost is QUAD else "greedy"
    guarantee = _guarantee(lengths, d, n, cost) if lengths else 1.0
    budget = None if fraction > 1.4 else guarantee * (0.3 + fraction)
    src = np.random.default_rng(seed).integers(0, d, size=len(lengths))
    kw = {"cost": cost, "ranks_per_node": rpn, "max_load_per_rank": budget, "context_parallel": n}
    try:
        a = balance(lengths, d, policy, src=src, **kw)
    except InfeasibleCapError as e:
        assert budget is not None and budget < guarantee
        assert e.argument == "max_load_per_rank" and e.smallest > budget
        return
    _check_plan(lengths, d, n, cost, a, rpn)
    if budget is not None:
        assert a.loads.max(initial=0.0) <= budget
    assert a.stats["gap_to_lb"] >= 1.0 - 1e-12
    assert a.stats["tokens_moved"] + a.stats["tokens_kept"] == sum(lengths)
    if a.stats["kept_source"]:  # the source layout was lighter: nothing moves
        np.testing.assert_array_equal(a.dst, src)
    assert a.loads.max(initial=0.0) <= balance(lengths, d, policy, **kw).loads.max(initial=0.0)
    again = balance(lengths, d, policy, src=src, **kw)
    np.testing.assert_array_equal(a.dst, again.dst)
    np.testing.assert_array_equal(a.loads, again.loads)
    for x, y in zip(
        (a.pieces.item, a.pieces.rank, a.pieces.start, a.pieces.end),
        (again.pieces.item, again.pieces.rank, again.pieces.start, again.pieces.end),
        strict=True,
    ):
        np.testing.assert_array_equal(x, y)
    perm = np.random.default_rng(seed).permutation(len(lengths))
    shuffled = balance(np.asarray(lengths, dtype=np.int64)[perm], d, policy, src=src[perm], **kw)
    if n > 1:  # the split core's loads are the same rank for rank
        np.testing.assert_array_equal(shuffled.loads, a.loads)
    else:  # context_parallel=1 is the plain balance: ties between ranks break by item index
        np.testing.assert_array_equal(np.sort(shuffled.loads), np.sort(a.loads))
    assert _split_shapes(lengths, a.pieces) == _split_shapes(
        np.asarray(lengths)[perm], shuffled.pieces
    )


def _split_shapes(lengths, pieces):
    """Each split item's length and its pieces' token counts, sorted: what a shuffle keeps."""
    shapes = []
    for i in pieces.items.tolist():
        rows = pieces.of(i)
        tokens = np.bincount(rows.rank, weights=rows.end - rows.start)
        shapes.append((int(lengths[i]), sorted(tokens[tokens > 0].astype(int).tolist())))
    return sorted(shapes)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_instances())
def test_never_raises_when_n_pieces_fit(case):
    lengths, d, n, cost, rpn = case
    if not lengths:
        return
    budget = _guarantee(lengths, d, n, cost)
    kw = {"cost": cost, "ranks_per_node": rpn, "max_load_per_rank": budget}
    a = balance(lengths, d, "greedy_cost", context_parallel=n, **kw)
    assert a.loads.max() <= budget
    _check_plan(lengths, d, n, cost, a, rpn)


def test_over_budget_items_are_split_at_scale():
    """Items over the budget are cut, the rest balanced around them, every rank within it."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(100, 4000, size=2000)
    lengths[rng.choice(lengths.size, 20, replace=False)] = rng.integers(20_000, 60_000, size=20)
    d, n = 256, 8
    budget = lengths.sum() / d * 1.1  # below most long items
    with pytest.raises(InfeasibleCapError):
        balance(lengths, d, max_load_per_rank=budget)
    a = balance(lengths, d, max_load_per_rank=budget, context_parallel=n, ranks_per_node=8)
    assert a.loads.max() <= budget
    assert set(a.pieces.items.tolist()) >= set(np.flatnonzero(lengths > budget).tolist())
    _check_plan(lengths, d, n, TOKENS, a)


def test_context_parallel_one_is_the_plan_without_it():
    rng = np.random.default_rng(3)
    lengths = rng.integers(0, 5000, size=300)
    src = rng.integers(0, 16, size=300)
    for kw in (
        {},
        {"src": src, "max_items_per_rank": 30},
        {"cost": QUAD, "max_load_per_rank": 1e9},
    ):
        policy = "greedy_cost" if "cost" in kw else "greedy"
        a = balance(lengths, 16, policy, **kw)
        b = balance(lengths, 16, policy, context_parallel=1, **kw)
        np.testing.assert_array_equal(a.dst, b.dst)
        np.testing.assert_array_equal(a.loads, b.loads)
        assert dict(a.stats) == dict(b.stats) and b.pieces.item.size == 0
    assert isinstance(orchmllm.balance([1, 2], 2).pieces, Pieces)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"context_parallel": 0}, "context_parallel must be an integer >= 1, got 0"),
        ({"context_parallel": 2.0}, "context_parallel must be an integer >= 1, got 2.0"),
        ({"context_parallel": True}, "context_parallel must be an integer >= 1, got True"),
        ({"context_parallel": 3}, "context_parallel=3 must divide num_ranks=8"),
        ({"context_parallel": 16}, "context_parallel=16 must divide num_ranks=8"),
        (
            {"context_parallel": 4, "ranks_per_node": 2},
            "",  # a multiple of ranks_per_node: accepted
        ),
        (
            {"context_parallel": 2, "ranks_per_node": 1},
            "",
        ),
        ({"context_parallel": 2, "policy": "padded_cost"}, "policy='padded_cost'.*padded"),
        ({"context_parallel": 2, "policy": "kk"}, "policy must be one of .* got 'kk'"),
        ({"context_parallel": 2, "max_items_per_rank": 4}, "max_items_per_rank"),
        ({"context_parallel": 2, "backend": "python"}, "backend='cpp', got 'python'"),
        (
            {"context_parallel": 2, "placement": "assign", "src": [0] * 6, "ranks_per_node": 2},
            "placement='none', got 'assign'",
        ),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    kwargs = dict(kwargs)
    policy = kwargs.pop("policy", "greedy")
    if not match:
        assert balance([9, 1, 1, 1, 1, 1], 8, policy, **kwargs).loads.sum() == 14
        return
    with pytest.raises(ValueError, match=match):
        balance([9, 1, 1, 1, 1, 1], 8, policy, **kwargs)


def test_ranks_per_node_must_hold_whole_groups():
    with pytest.raises(ValueError, match="context_parallel=4 must divide ranks_per_node=6"):
        balance([1, 2, 3], 12, context_parallel=4, ranks_per_node=6)


def test_item_too_costly_even_in_n_pieces_names_it():
    with pytest.raises(InfeasibleCapError, match=r"item 1 \(100 tokens\) costs 25") as e:
        balance([3, 100, 2], 8, max_load_per_rank=20, context_parallel=4)
    assert e.value.lower_bound >= 25 and e.value.smallest >= e.value.lower_bound


def _long_step(world):
    """Rank 0 samples one long text example (400 tokens) beside short mixed ones."""
    batches = [[payload_example(0, [[TEXT, 400]]), payload_example(1, [[TEXT, 5], [IMAGE, 8]])]]
    eid = 2
    for _ in range(1, world):
        batches.append([payload_example(eid, [[TEXT, 20]]), payload_example(eid + 1, [[TEXT, 9]])])
        eid += 2
    return gathered(batches)


def test_plan_step_records_the_llm_pieces():
    world = 4
    rows, src = _long_step(world)
    options = StepOptions(PHASES, mode="llm", context_parallel=2, llm_max_load=250)
    plan = plan_step(rows, src, options, num_ranks=world)
    again = plan_step(rows.copy(), src.copy(), options, num_ranks=world)
    assert plan.same_as(again)
    p = plan.llm_pieces
    assert p.items.tolist() == [0]  # the 400-token example, over the budget, is split
    assert plan.llm_stats["items_split"] == 1 and plan.llm_stats["pieces"] == 2
    assert max(plan.llm_stats["loads_after"]) <= 250
    assert sum(plan.llm_stats["loads_after"]) == plan.seq_len.sum()
    assert int((p.end - p.start).sum()) == plan.seq_len[0] and len(set((p.rank // 2).tolist())) == 1
    # the move still takes the split example whole, to its first token's rank
    assert plan.llm.dst_rank[0] == p.rank[p.start == 0][0]
    assert not plan.same_as(plan_step(rows, src, StepOptions(PHASES, mode="llm"), num_ranks=world))
    whole = plan_step(rows, src, StepOptions(PHASES, mode="llm"), num_ranks=world)
    assert whole.llm_pieces.item.size == 0 and "items_split" not in whole.llm_stats


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"context_parallel": 0}, "context_parallel must be an integer >= 1, got 0"),
        ({"llm_max_load": 10.0}, "llm_max_load=10.0 needs context_parallel > 1"),
        ({"context_parallel": 2, "llm_max_load": -1}, "llm_max_load must be a number > 0"),
        ({"context_parallel": 2, "llm_policy": "kk"}, "llm_policy in .* got 'kk'"),
        ({"context_parallel": 2, "llm_cost": CostModel("padded")}, "packed llm_cost"),
        (
            {"context_parallel": 2, "placement": "assign", "ranks_per_node": 2},
            "placement='none', got 'assign'",
        ),
    ],
)
def test_step_options_refuse_what_does_not_split(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StepOptions(PHASES, **kwargs)


def test_plan_step_names_a_group_size_that_does_not_divide_the_ranks():
    rows, src = _long_step(4)
    with pytest.raises(ValueError, match="context_parallel=3 must divide num_ranks=4"):
        plan_step(rows, src, StepOptions(PHASES, context_parallel=3), num_ranks=4)


def test_a_splitting_encoder_phase_keeps_its_cost_model_whole():
    """The vision phase plans in LLM tokens (2 patches each here) with its cost rescaled to
    them: its loads are its own cost model's, multiplier included, and its pieces are whole
    tokens."""
    cost = CostModel("packed", alpha=2.0, beta=0.01, multiplier=3.0)
    phases = (dataclasses.replace(PHASES[0], cost=cost), *PHASES[1:])
    batches = [[payload_example(0, [[TEXT, 3], [IMAGE, 400]], phases)]]
    batches += [[payload_example(1 + r, [[TEXT, 3], [IMAGE, 8]], phases)] for r in range(3)]
    rows, src = gathered(batches)
    options = StepOptions(phases, mode="full", context_parallel=4)
    pp = plan_step(rows, src, options, num_ranks=4).phases["vision"]
    assert pp.pieces.items.tolist() == [0]
    assert np.all(pp.pieces.start % 2 == 0) and np.all(pp.pieces.end % 2 == 0)
    whole = cost.loads(pp.raw, pp.encoder.src_rank, 4)
    # load-balanced pieces cost their item's total: the loads only move
    assert sum(pp.stats["loads_after"]) == pytest.approx(whole.sum(), rel=1e-12)
    assert max(pp.stats["loads_after"]) < whole.max()
