"""The move of split examples' rows to their pieces (orchmllm.planner.piece_layout): every
position of every sequence lands exactly once, whole sequences stay, each piece's rows are its
ranges in position order, and nothing moves when nothing is split."""

import numpy as np
import pytest

from orchmllm.planner.assembly import assembly
from orchmllm.planner.piece_layout import llm_piece_layout
from orchmllm.planner.plan import Rearrangement
from orchmllm.planner.step_options import StepOptions
from orchmllm.planner.step_plan import plan_step
from orchmllm.schema import TEXT
from tests.payloads import PHASES, gathered, payload_example


def _step(world: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Each rank samples 2-4 examples of text and images; a few are long documents."""
    rng = np.random.default_rng(seed)
    batches, eid = [], 0
    for _ in range(world):
        batch = []
        for _ in range(int(rng.integers(2, 5))):
            long = rng.random() < 0.2
            segs = [[TEXT, int(rng.integers(300, 600) if long else rng.integers(5, 60))]]
            if rng.random() < 0.5:
                segs += [[1, 4 * int(rng.integers(1, 6))], [TEXT, int(rng.integers(2, 9))]]
            batch.append(payload_example(eid, segs))
            eid += 1
        batches.append(batch)
    return gathered(batches)


def _apply(move: Rearrangement, sizes: np.ndarray, rows: list[np.ndarray]) -> list[np.ndarray]:
    """``move`` run on host arrays: each rank's rows in source-slot order, out in
    destination-slot order (what comm.move does over the ranks)."""
    out = []
    starts = {}
    for r in range(move.num_ranks):
        at = np.flatnonzero(move.src_rank == r)
        at = at[np.argsort(move.src_slot[at])]
        offsets = np.concatenate([[0], np.cumsum(sizes[at])])
        starts.update({int(i): int(o) for i, o in zip(at, offsets[:-1], strict=True)})
    for r in range(move.num_ranks):
        at = np.flatnonzero(move.dst_rank == r)
        at = at[np.argsort(move.dst_slot[at])]
        parts = [rows[move.src_rank[i]][starts[i] : starts[i] + sizes[i]] for i in at]
        out.append(np.concatenate(parts) if parts else np.zeros((0, 2), np.int64))
    return out


@pytest.mark.parametrize(("world", "cp", "budget"), [(4, 2, 700), (4, 4, 500), (8, 4, 600)])
@pytest.mark.parametrize("seed", range(4))
def test_every_position_lands_once_whole_sequences_stay_pieces_in_order(world, cp, budget, seed):
    rows, src = _step(world, seed)
    options = StepOptions(PHASES, mode="llm", context_parallel=cp, llm_max_load=budget)
    plan = plan_step(rows, src, options, num_ranks=world)
    layout = llm_piece_layout(plan)
    if layout is None:
        assert plan.llm_pieces.items.size == 0 or all(
            np.unique(plan.llm_pieces.of(e).rank).size == 1 for e in plan.llm_pieces.items
        )
        return
    again = llm_piece_layout(plan)  # pure: every rank computes the same
    assert again.move == layout.move and np.array_equal(again.sizes, layout.sizes)
    assert again.splits == layout.splits and again.segments == layout.segments
    # Label each home row (example, position) and move the labels.
    home = []
    for r in range(world):
        a = assembly(plan, r)
        home.append(
            np.array(
                [(e, p) for e, n in zip(a.examples, a.lengths, strict=True) for p in range(n)]
            ).reshape(-1, 2)
        )
    moved = _apply(layout.move, layout.sizes, home)
    split = {s.example: s for s in layout.splits}
    seen = np.concatenate(moved)
    assert len({tuple(x) for x in seen.tolist()}) == len(seen) == plan.seq_len.sum()
    for r in range(world):
        lengths = layout.lengths[r]
        assert lengths.sum() == len(moved[r]) and (lengths > 0).all()
        segments = np.split(moved[r], np.cumsum(lengths)[:-1])
        whole = [e for e in plan.llm.items_at(r).tolist() if e not in split]
        assert len(segments) == len(whole) + len(layout.segments[r])
        for e, seg in zip(whole, segments, strict=False):  # whole first, in the LLM order
            assert (seg[:, 0] == e).all() and seg[:, 1].tolist() == list(range(plan.seq_len[e]))
        for e, i in layout.segments[r].items():
            s = split[e]
            want = [p for a, b in s.chunks[s.ranks.index(r)] for p in range(a, b)]
            assert (segments[i][:, 0] == e).all() and segments[i][:, 1].tolist() == want
    # The pieces are the planner's, and its per-rank loads are the piece layout's tokens.
    assert [len(m) for m in moved] == [int(x) for x in plan.llm_stats["loads_after"]]


def test_nothing_split_gives_no_layout():
    rows, src = _step(4, 0)
    plan = plan_step(rows, src, StepOptions(PHASES, mode="llm"), num_ranks=4)
    assert plan.llm_pieces.item.size == 0 and llm_piece_layout(plan) is None
