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
    return piece_layout(plan.llm, plan.seq_len, plan.llm_pieces)


def piece_layout(to_home: Rearrangement, lengths: np.ndarray, pieces: Pieces) -> PieceLayout | None:
    """The move of split items to their pieces; None when nothing is split. Vectorised over
    the items (every rank computes it on the step's critical path).

    Args:
        to_home: the phase's move that delivers every item whole to its home (its
            destination ranks and slots are the home layout).
        lengths: rows per item.
        pieces: the plan's pieces of the split items, in rows.
    """
    splits = splits_of(pieces)
    if not splits:
        return None
    d = to_home.num_ranks
    item = np.lexsort((to_home.dst_slot, to_home.dst_rank))  # by home, in home order
    home = to_home.dst_rank[item]
    position = np.empty(int(lengths.size), np.int64)  # each item's place in its home's order
    position[item] = to_home.dst_slot[item]
    split = np.zeros(int(lengths.size), bool)
    split[[s.example for s in splits]] = True
    whole = ~split[item]
    # The pieces' ranges, ordered by item then start (those of items held on one rank only
    # are that item's whole rows: it is not split).
    rows = np.isin(pieces.item, [s.example for s in splits])
    p_item, p_rank = pieces.item[rows], pieces.rank[rows]
    p_start, p_end = pieces.start[rows], pieces.end[rows]
    order = np.lexsort((p_start, p_item))
    p_item, p_rank, p_start, p_end = (a[order] for a in (p_item, p_rank, p_start, p_end))
    w_item = item[whole]
    home_of = np.empty(int(lengths.size), np.int64)
    home_of[item] = home
    src = np.concatenate([home[whole], home_of[p_item]])
    dst = np.concatenate([home[whole], p_rank])
    sizes = np.concatenate([lengths[w_item], p_end - p_start]).astype(np.int64)
    at_home = np.concatenate([position[w_item], position[p_item]])
    start = np.concatenate([np.zeros(w_item.size, np.int64), p_start])
    is_piece = np.concatenate([np.zeros(w_item.size, np.int64), np.ones(p_item.size, np.int64)])
    key_item = np.concatenate([position[w_item], p_item])
    # Source: home order (a split item's ranges by start, where the item is); destination:
    # whole items in home order, then the pieces by item and start.
    src_slot = _local_slots(src, (start, at_home, src), d)
    dst_slot = _local_slots(dst, (start, key_item, is_piece, dst), d)
    move = Rearrangement(d, src, src_slot, dst, dst_slot)
    whole_count = np.bincount(home[whole], minlength=d)
    whole_lengths = np.split(lengths[item[whole]].astype(np.int64), np.cumsum(whole_count)[:-1])
    held: list[list[tuple[int, int]]] = [[] for _ in range(d)]  # (item, tokens), by item
    for sp in splits:
        for r, ranges in zip(sp.ranks, sp.chunks, strict=True):
            held[r].append((sp.example, sum(t - a for a, t in ranges)))
    out_lengths = tuple(
        np.concatenate([whole_lengths[r], np.asarray([t for _, t in held[r]], np.int64)])
        for r in range(d)
    )
    segments = tuple(
        {e: int(whole_count[r]) + i for i, (e, _) in enumerate(held[r])} for r in range(d)
    )
    return PieceLayout(move, sizes, out_lengths, splits, segments)


def _local_slots(rank: np.ndarray, keys: tuple[np.ndarray, ...], d: int) -> np.ndarray:
    """Each block's slot on its rank: its place among the rank's blocks ordered by ``keys``
    (``np.lexsort`` order: the last key first, which is the rank)."""
    order = np.lexsort(keys)
    counts = np.bincount(rank, minlength=d)
    slots = np.empty(rank.size, np.int64)
    slots[order] = np.arange(rank.size) - np.repeat(np.cumsum(counts) - counts, counts)
    return slots
