"""Rearrangement: bookkeeping, algebra and a numpy simulation of the all-to-all it drives."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchmllm.planner.plan import Rearrangement, expand_rows


@st.composite
def assignments(draw, max_ranks: int = 6, max_items: int = 30):
    """(src, dst, num_ranks, sizes) with src in gather order (non-decreasing)."""
    d = draw(st.integers(1, max_ranks))
    per_rank = draw(st.lists(st.integers(0, max_items // d + 1), min_size=d, max_size=d))
    src = np.repeat(np.arange(d), per_rank)
    n = src.size
    dst = np.array(draw(st.lists(st.integers(0, d - 1), min_size=n, max_size=n)), dtype=np.int64)
    sizes = np.array(draw(st.lists(st.integers(0, 5), min_size=n, max_size=n)), dtype=np.int64)
    return src, dst, d, sizes


def _simulate_move(plan: Rearrangement, sizes: np.ndarray, buffers: list) -> list:
    """Run the plan's schedules as an all-to-all would, on per-rank numpy row buffers."""
    d = plan.num_ranks
    scheds = [plan.schedule(r, sizes=sizes) for r in range(d)]
    chunks = []
    for r, s in enumerate(scheds):
        x = buffers[r] if s.send_index is None else buffers[r][s.send_index]
        assert x.shape[0] == s.num_send_rows
        chunks.append(np.split(x, np.cumsum(s.send_splits)[:-1]))
    out = []
    for r, s in enumerate(scheds):
        recv = np.concatenate([chunks[p][r] for p in range(d)])
        for p in range(d):
            assert chunks[p][r].shape[0] == s.recv_splits[p]
        out.append(recv if s.recv_index is None else recv[s.recv_index])
    return out


def _rows_for(ids: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Row payload (item id, row within item) for items ``ids`` in order."""
    if ids.size == 0:
        return np.zeros((0, 2), dtype=np.int64)
    return np.stack(
        [np.repeat(ids, sizes[ids]), np.concatenate([np.arange(sizes[i]) for i in ids])], axis=1
    )


def _source_buffers(plan: Rearrangement, sizes: np.ndarray) -> list:
    return [_rows_for(plan.source_items_at(r), sizes) for r in range(plan.num_ranks)]


@settings(max_examples=150, deadline=None)
@given(assignments())
def test_from_assignment_slots(case):
    src, dst, d, _ = case
    plan = Rearrangement.from_assignment(src, dst, num_ranks=d)
    assert np.array_equal(plan.src_rank, src) and np.array_equal(plan.dst_rank, dst)
    for r in range(d):
        # Source slots follow the gather order; destination slots follow (src rank, src slot).
        assert np.array_equal(plan.source_items_at(r), np.flatnonzero(src == r))
        assert np.array_equal(plan.items_at(r), np.flatnonzero(dst == r))
        assert sorted(plan.src_slot[src == r]) == list(range(int((src == r).sum())))


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 6), st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), max_size=40))
def test_from_assignment_slots_for_any_source_order(d, pairs):
    """Sources in any order (not only the gather's): slots are the stable sorts' positions,
    and the plan, built without ``__post_init__``'s checks, passes them."""
    src = np.array([s % d for s, _ in pairs], dtype=np.int64)
    dst = np.array([t % d for _, t in pairs], dtype=np.int64)
    plan = Rearrangement.from_assignment(src, dst, num_ranks=d)
    by_src = np.argsort(src, kind="stable")
    by_dst = by_src[np.argsort(dst[by_src], kind="stable")]
    for side, ranks, order in (("src", src, by_src), ("dst", dst, by_dst)):
        expect = np.empty(src.size, dtype=np.int64)
        for r in range(d):
            mine = order[ranks[order] == r]
            expect[mine] = np.arange(mine.size)
        assert np.array_equal(getattr(plan, f"{side}_slot"), expect)
    fields = (plan.src_rank, plan.src_slot, plan.dst_rank, plan.dst_slot)
    assert Rearrangement(d, *fields) == plan
    inv = plan.inverse()
    assert Rearrangement(d, inv.src_rank, inv.src_slot, inv.dst_rank, inv.dst_slot) == inv
    assert not plan.dst_slot.flags.writeable


@settings(max_examples=150, deadline=None)
@given(assignments())
def test_inverse_and_compose(case):
    src, dst, d, _ = case
    plan = Rearrangement.from_assignment(src, dst, num_ranks=d)
    inv = plan.inverse()
    assert inv.inverse() == plan
    round_trip = inv.compose(plan)
    assert np.array_equal(round_trip.dst_rank, plan.src_rank)
    assert np.array_equal(round_trip.dst_slot, plan.src_slot)
    back = plan.compose(inv)
    assert np.array_equal(back.src_rank, back.dst_rank) and np.array_equal(
        back.src_slot, back.dst_slot
    )
    # Composition is associative and equals applying the moves one after the other.
    rng = np.random.default_rng(len(src))
    third = Rearrangement.from_assignment(dst, rng.integers(0, d, size=dst.size), num_ranks=d)
    # third takes items from plan's destination only if slots agree: rebuild with plan's slots.
    third = Rearrangement(d, plan.dst_rank, plan.dst_slot, third.dst_rank, third.dst_slot)
    assert third.compose(plan.compose(inv)) == third.compose(plan).compose(inv)


@settings(max_examples=150, deadline=None)
@given(assignments())
def test_simulated_move_conserves_items(case):
    src, dst, d, sizes = case
    plan = Rearrangement.from_assignment(src, dst, num_ranks=d)
    moved = _simulate_move(plan, sizes, _source_buffers(plan, sizes))
    for r in range(d):
        assert np.array_equal(moved[r], _rows_for(plan.items_at(r), sizes))
    # The inverse plan (non-trivial receive reordering) restores the original buffers.
    back = _simulate_move(plan.inverse(), sizes, moved)
    for r, buf in enumerate(_source_buffers(plan, sizes)):
        assert np.array_equal(back[r], buf)


@settings(max_examples=100, deadline=None)
@given(assignments())
def test_composed_move_equals_two_moves(case):
    src, dst, d, sizes = case
    first = Rearrangement.from_assignment(src, dst, num_ranks=d)
    second_dst = (dst * 7 + 3) % d
    second = Rearrangement.from_assignment(dst, second_dst, num_ranks=d)
    second = Rearrangement(d, first.dst_rank, first.dst_slot, second.dst_rank, second.dst_slot)
    bufs = _source_buffers(first, sizes)
    two = _simulate_move(second, sizes, _simulate_move(first, sizes, bufs))
    one = _simulate_move(second.compose(first), sizes, bufs)
    for a, b in zip(one, two, strict=True):
        assert np.array_equal(a, b)


@settings(max_examples=100, deadline=None)
@given(assignments(), st.integers(1, 4))
def test_counts_and_traffic(case, ranks_per_node):
    src, dst, d, sizes = case
    plan = Rearrangement.from_assignment(src, dst, num_ranks=d)
    m = plan.count_matrix(sizes=sizes)
    for r in range(d):
        assert plan.send_counts(r).sum() == (src == r).sum()
        assert plan.recv_counts(r).sum() == (dst == r).sum()
        assert plan.send_counts(r, sizes=sizes).sum() == sizes[src == r].sum()
        assert np.array_equal(plan.recv_counts(r, sizes=sizes), m[:, r])
        sched = plan.schedule(r, sizes=sizes)
        assert np.array_equal(sched.send_splits, m[r]) and np.array_equal(
            sched.recv_splits, m[:, r]
        )
    t = plan.traffic(sizes=sizes, ranks_per_node=ranks_per_node)
    assert t["intra"] + t["inter"] + t["kept"] == sizes.sum()
    assert t["kept"] == sizes[src == dst].sum()
    assert plan.traffic(sizes=sizes)["inter"] == 0


def test_figure5_example():
    # Two ranks; rank 0 holds lengths [8, 1, 1], rank 1 holds [2, 2]; balanced: {8} vs {1,1,2,2}.
    src = np.array([0, 0, 0, 1, 1])
    dst = np.array([0, 1, 1, 1, 1])
    lengths = np.array([8, 1, 1, 2, 2])
    plan = Rearrangement.from_assignment(src, dst, num_ranks=2)
    assert plan.items_at(1).tolist() == [1, 2, 3, 4]
    assert plan.send_counts(0, sizes=lengths).tolist() == [8, 2]
    assert plan.recv_counts(1, sizes=lengths).tolist() == [2, 4]
    assert plan.traffic(sizes=lengths, ranks_per_node=1) == {
        "intra": 0,
        "inter": 2,
        "kept": 12,
        "max_sent_rank": 2,
        "max_recv_rank": 2,
    }


def test_empty_and_identity():
    plan = Rearrangement.from_assignment([], [], num_ranks=3)
    assert plan.num_items == 0 and plan.items_at(2).size == 0
    assert plan.schedule(1).num_recv_rows == 0
    ident = Rearrangement.identity([0, 0, 2], num_ranks=3)
    s = ident.schedule(0, sizes=[3, 1, 2])
    assert s.send_index is None and s.recv_index is None
    assert s.send_splits.tolist() == [4, 0, 0]


def test_fingerprint():
    a = Rearrangement.from_assignment([0, 0, 1, 1], [1, 0, 0, 1], num_ranks=2)
    b = Rearrangement.from_assignment([0, 0, 1, 1], [1, 0, 0, 1], num_ranks=2)
    c = Rearrangement.from_assignment([0, 0, 1, 1], [1, 1, 0, 1], num_ranks=2)
    assert a.fingerprint() == b.fingerprint() != c.fingerprint()
    assert 0 <= a.fingerprint() < 2**63


def test_expand_rows():
    assert expand_rows([5, 0, 9], [2, 0, 3]).tolist() == [5, 6, 9, 10, 11]
    assert expand_rows([], []).size == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(src=[0, 1], dst=[0], num_ranks=2), "dst"),
        (dict(src=[0, 2], dst=[0, 1], num_ranks=2), r"src\[1\] = 2"),
        (dict(src=[0, 1], dst=[0, -1], num_ranks=2), r"dst\[1\] = -1"),
        (dict(src=[0, 1], dst=[0, 1], num_ranks=0), "num_ranks"),
        (dict(src=[0.5], dst=[0], num_ranks=1), "src"),
        (dict(src=[[0]], dst=[0], num_ranks=1), "src"),
    ],
)
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Rearrangement.from_assignment(kwargs.pop("src"), kwargs.pop("dst"), **kwargs)


def test_bad_slots_and_compose():
    with pytest.raises(ValueError, match="src_slot"):
        Rearrangement(2, [0, 0], [0, 0], [0, 1], [0, 0])
    with pytest.raises(ValueError, match="dst_slot"):
        Rearrangement(2, [0, 0], [0, 1], [1, 1], [0, 2])
    a = Rearrangement.from_assignment([0, 0, 1], [1, 0, 0], num_ranks=2)
    with pytest.raises(ValueError, match="other puts item"):
        a.compose(a)
    with pytest.raises(ValueError, match="other has"):
        a.compose(Rearrangement.from_assignment([0], [0], num_ranks=2))
    with pytest.raises(ValueError, match="rank = 5"):
        a.items_at(5)
    with pytest.raises(ValueError, match="sizes"):
        a.schedule(0, sizes=[1, 2])
    with pytest.raises(ValueError, match="ranks_per_node"):
        a.traffic(ranks_per_node=0)
