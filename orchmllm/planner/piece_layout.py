"""Where a phase's rows go when some of its items are split over context-parallel ranks.

The orchestrator moves every item whole to one rank, its *home* (the rank of its first row,
:func:`orchmllm.planner.step_plan.plan_step`), as for any item; the rows of the pieces then
leave the home for the ranks that compute them. This module is that second move, pure and
from the plan alone, so every rank computes the same one:

- the *home layout* of a rank is its items' rows in the phase's order (the LLM phase: its
  assembled sequences, :func:`orchmllm.planner.assembly.assembly`; an encoder phase: its
  items' raw rows as its move delivers them);
- the *piece layout* of a rank is its whole items in the same order, then one segment per
  split item it holds a piece of, by item, each segment its row ranges in position order (a
  piece of load-balanced chunking is two ranges, one early and one late);
- the move is a :class:`~orchmllm.planner.plan.Rearrangement` of row blocks (a whole item
  stays on its rank; each range of a split one goes to its rank), with the rows per block.

Two moves rather than one straight to the pieces: in the LLM phase an image or a clip may
straddle two pieces, and the encoder outputs already go to one rank per example; the second
move carries the rows of split items only (a rank's own piece stays). An encoder phase moves
its outputs back home the same way (the layout of its tokens, :func:`scaled`, inverted).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from orchmllm.planner.context_parallel import Pieces
from orchmllm.planner.plan import Rearrangement
from orchmllm.planner.step_plan import StepPlan

__all__ = ["PieceLayout", "Split", "llm_piece_layout", "piece_layout", "scaled"]

Range = tuple[int, int]


@dataclass(frozen=True)
class Split:
    """One example split over ranks: ``ranks`` ascending (two or more), and per rank its token
    ranges ``[start, end)`` in position order; together they cover the sequence once."""

    example: int
    ranks: tuple[int, ...]
    chunks: tuple[tuple[Range, ...], ...]


@dataclass(frozen=True)
class PieceLayout:
    """The move from every rank's home layout to its piece layout (module docstring).

    Attributes:
        move: row blocks from home to piece layout (one per whole sequence, one per range).
        sizes: int64 rows per block of ``move``.
        lengths: per rank, int64 lengths of its piece layout's segments (whole sequences,
            then its pieces).
        splits: the split examples, by example.
        segments: per rank, split example -> the index of its piece among the rank's
            segments.
    """

    move: Rearrangement
    sizes: np.ndarray
    lengths: tuple[np.ndarray, ...]
    splits: tuple[Split, ...]
    segments: tuple[dict[int, int], ...]


def splits_of(pieces: Pieces) -> tuple[Split, ...]:
    """The planner's piece rows as one :class:`Split` per example held by two or more ranks
    (an example on one rank only is whole there)."""
    out = []
    for e in pieces.items.tolist():
        p = pieces.of(e)
        ranks = tuple(sorted(set(p.rank.tolist())))
        if len(ranks) < 2:
            continue
        order = np.argsort(p.start, kind="stable")
        on, starts, ends = (a[order].tolist() for a in (p.rank, p.start, p.end))
        rows = list(zip(on, starts, ends, strict=True))
        chunks = tuple(tuple((s, t) for r, s, t in rows if r == rank) for rank in ranks)
        out.append(Split(int(e), ranks, chunks))
    return tuple(out)


def scaled(pieces: Pieces, divisor: int) -> Pieces:
    """``pieces`` in units ``divisor`` times larger (raw rows -> the tokens they become)."""
    return Pieces(pieces.item, pieces.rank, pieces.start // divisor, pieces.end // divisor)


def llm_piece_layout(plan: StepPlan) -> PieceLayout | None:
    """The LLM phase's move of ``plan``'s split examples to their pieces (None: none)."""
    homes = [plan.llm.items_at(r) for r in range(plan.num_ranks)]
    return piece_layout(homes, plan.seq_len, plan.llm_pieces)


def piece_layout(
    homes: Sequence[np.ndarray], lengths: np.ndarray, pieces: Pieces
) -> PieceLayout | None:
    """The move of split items to their pieces; None when nothing is split.

    Args:
        homes: per rank, the items it holds whole before the move, in its order.
        lengths: rows per item.
        pieces: the plan's pieces of the split items, in rows.
    """
    splits = splits_of(pieces)
    if not splits:
        return None
    d = len(homes)
    by_example = {s.example: s for s in splits}
    src, dst, sizes, tags = [], [], [], []  # tag: (whole: 0, position) or (piece: 1, example)
    whole_lengths: list[list[int]] = [[] for _ in range(d)]
    for r in range(d):
        for e in homes[r].tolist():
            split = by_example.get(e)
            if split is None:
                src.append(r), dst.append(r), sizes.append(int(lengths[e]))
                tags.append((0, len(whole_lengths[r]), 0))
                whole_lengths[r].append(int(lengths[e]))
                continue
            ranges = sorted(
                (s, t, q) for q, rs in zip(split.ranks, split.chunks, strict=True) for s, t in rs
            )
            for s, t, q in ranges:
                src.append(r), dst.append(q), sizes.append(t - s), tags.append((1, e, s))
    src_a, dst_a = np.asarray(src, np.int64), np.asarray(dst, np.int64)
    src_slot = np.empty_like(src_a)
    dst_slot = np.empty_like(dst_a)
    for r in range(d):
        at = np.flatnonzero(src_a == r)
        src_slot[at] = np.arange(at.size)  # blocks in home order
        at = np.flatnonzero(dst_a == r)
        order = sorted(range(at.size), key=lambda j: tags[at[j]])  # whole first, then pieces
        dst_slot[at[order]] = np.arange(at.size)
    lengths, segments = [], []
    for r in range(d):
        mine = [s for s in splits if r in s.ranks]
        own = [sum(t - s for s, t in sp.chunks[sp.ranks.index(r)]) for sp in mine]
        lengths.append(np.asarray(whole_lengths[r] + own, dtype=np.int64))
        segments.append({sp.example: len(whole_lengths[r]) + i for i, sp in enumerate(mine)})
    move = Rearrangement(d, src_a, src_slot, dst_a, dst_slot)
    return PieceLayout(move, np.asarray(sizes, np.int64), tuple(lengths), splits, tuple(segments))
