"""Attention over sequences split across ranks (context parallelism): causal in the LLM
phase, bidirectional in an encoder's.

A sequence longer than a rank's budget is split into pieces on the k ranks of a
context-parallel group (issue 40); each of those ranks also holds other, whole sequences, all
packed in one batch. :class:`PackedPieces` computes causal attention over such a batch as if
every sequence were whole:

- queries stay local; a piece's keys and values are all-gathered inside its group (the
  smallest context-parallel block holding its ranks, :meth:`Topology.context_parallel_block`;
  a rank of that block holding no piece joins with no rows), so each rank attends its
  queries over the sequence's whole prefix. The gather's backward is a
  reduce-scatter: each rank receives the sum of every member's gradients for its own keys and
  values, so the parameter gradients summed over the data-parallel group (what FSDP's
  reduction does) equal the unsplit ones;
- the causal mask and the RoPE positions (:attr:`PackedPieces.positions`) use each token's
  global position in its sequence, continuous across pieces;
- load-balanced chunking (:func:`chunk_ranges`): the sequence is cut in 2k chunks and member i
  holds chunks i and 2k-1-i, one early and one late, so every member attends the same number
  of (query, key) pairs (exactly, when 2k divides the length), where contiguous pieces would
  leave the last member k times the first one's causal work;
- each target belongs to exactly one piece (:func:`piece_targets`), so the per-rank losses,
  divided by the global target count, sum to the unsplit loss.

A piece is described by a :class:`SplitSequence` record that every rank of its block holds
alike (the plan's item, its ranks, each member's token ranges). Its group is one the
:class:`~orchmllm.dist.topology.Topology` opened at set-up (``build(context_parallel=N)``:
aligned blocks of consecutive ranks), never one per step. Every collective waits at most the
topology's timeout. The ranks of a block issue their gathers in the same order (the records'
``key``), so ranks in overlapping groups (a piece on ranks 0-1, another on ranks 0-3) never
wait on each other in a circle.

Bidirectional (``causal=False``, an encoder's packed items: images, video): every query of a
piece attends over the whole item's keys, gathered the same way; the chunking only evens the
rows, the work is even anyway.

Not here yet: the fused varlen kernel (a chunk is attended with SDPA and torch's lower-right
causal bias: without a [chunk, prefix] mask on CUDA, with one on CPU), overlapping the gather
with compute (ring attention).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.attention.bias import CausalBias, causal_lower_right

from orchmllm import compat
from orchmllm.dist.comm import MismatchError, all_gather_fixed, fingerprint
from orchmllm.dist.topology import Topology

__all__ = [
    "PackedPieces",
    "SplitSequence",
    "chunk_ranges",
    "packed_positions",
    "piece_targets",
    "split_sequence",
]

Range = tuple[int, int]


# -- pure helpers ------------------------------------------------------------------------------


def chunk_ranges(length: int, size: int, *, balanced: bool = True) -> tuple[tuple[Range, ...], ...]:
    """Each member's token ranges [start, end) when a sequence of ``length`` tokens is split
    over ``size`` ranks: balanced, the sequence is cut in ``2 * size`` near-equal chunks and
    member i holds chunks i and ``2 * size - 1 - i`` (even causal work); else one contiguous
    range each. Empty chunks (a sequence shorter than ``2 * size``) are left out.

    Raises:
        ValueError: ``size`` < 1, or ``length`` < ``size`` (a member would hold no token).
    """
    if size < 1 or length < size:
        raise ValueError(
            f"cannot split {length} tokens over {size} ranks: need 1 <= size <= length"
        )
    parts = 2 * size if balanced else size
    base, extra = divmod(length, parts)  # the first ``extra`` chunks take one token more
    bounds = [j * base + min(j, extra) for j in range(parts + 1)]
    chunks = [(bounds[j], bounds[j + 1]) for j in range(parts)]
    mine = [(chunks[i], chunks[parts - 1 - i]) if balanced else (chunks[i],) for i in range(size)]
    return tuple(tuple(r for r in ranges if r[1] > r[0]) for ranges in mine)


@dataclass(frozen=True)
class SplitSequence:
    """A sequence split over a context-parallel group: who holds which of its tokens.

    Every member holds the same record (:class:`PackedPieces` checks it).

    Attributes:
        key: the sequence's id, the same on every rank (the plan's item index); orders the
            gathers of a rank holding several pieces.
        ranks: the data-parallel ranks holding its pieces, ascending (member i is
            ``ranks[i]``), two or more.
        chunks: per member, its token ranges [start, end), in the order its tokens are packed;
            together they cover [0, length) exactly once.
    """

    key: int
    ranks: tuple[int, ...]
    chunks: tuple[tuple[Range, ...], ...]

    def __post_init__(self) -> None:
        # Plain ints (a plan's numpy integers print differently, and the records' check
        # compares their printed form across ranks).
        object.__setattr__(self, "key", int(self.key))
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))
        chunks = tuple(tuple((int(s), int(e)) for s, e in ranges) for ranges in self.chunks)
        object.__setattr__(self, "chunks", chunks)
        ranks = list(self.ranks)
        if len(ranks) < 2 or ranks != sorted(set(ranks)) or ranks[0] < 0:
            raise ValueError(f"ranks must be >= 2 distinct ranks, ascending, got {self.ranks!r}")
        if len(self.chunks) != len(ranks) or not all(self.chunks):
            raise ValueError(
                f"chunks must give each of the {len(ranks)} ranks {self.ranks} at least one "
                f"range, got {self.chunks!r}"
            )
        covered = sorted(r for ranges in self.chunks for r in ranges)
        ends = [0] + [e for _, e in covered]
        if any(s != prev or e <= s for (s, e), prev in zip(covered, ends, strict=False)):
            raise ValueError(
                f"chunks of sequence {self.key} must cover [0, length) exactly once with "
                f"non-empty ranges, got {self.chunks!r}"
            )

    @property
    def length(self) -> int:
        """The whole sequence's token count."""
        return max(e for ranges in self.chunks for _, e in ranges)

    def member(self, rank: int) -> int:
        """The member index of data-parallel ``rank``; ValueError if it holds no piece."""
        if rank not in self.ranks:
            raise ValueError(f"rank {rank} holds no piece of sequence {self.key} ({self.ranks})")
        return self.ranks.index(rank)

    def positions(self, rank: int) -> Tensor:
        """The global positions (int64) of ``rank``'s tokens, in packed order: its RoPE
        positions and the causal mask's."""
        return torch.cat([torch.arange(s, e) for s, e in self.chunks[self.member(rank)]])

    def tokens(self, rank: int) -> int:
        """How many of the sequence's tokens ``rank`` holds."""
        return sum(e - s for s, e in self.chunks[self.member(rank)])


def split_sequence(
    key: int, length: int, ranks: Sequence[int], *, balanced: bool = True
) -> SplitSequence:
    """The record of a ``length``-token sequence split over ``ranks`` (:func:`chunk_ranges`)."""
    return SplitSequence(key, tuple(ranks), chunk_ranges(length, len(ranks), balanced=balanced))


def piece_targets(targets: Tensor, split: SplitSequence, rank: int) -> Tensor:
    """``rank``'s targets, from the whole sequence's per-position targets (the next token at
    each position, ``IGNORE_INDEX`` where none): each target lands on exactly one member, so
    the members' summed losses count it once. A chunk's last target is the next chunk's first
    token, which is why the whole sequence's targets are the input."""
    if targets.shape[:1] != (split.length,):
        raise ValueError(
            f"targets must have the sequence's {split.length} positions, got {tuple(targets.shape)}"
        )
    return targets[split.positions(rank).to(targets.device)]


def packed_positions(
    lengths: Sequence[int], pieces: Mapping[int, SplitSequence], rank: int
) -> Tensor:
    """The RoPE positions of a packed batch: from 0 in a whole sequence, global in a piece
    (``pieces``: segment index -> its record)."""
    return torch.cat(
        [
            pieces[i].positions(rank) if i in pieces else torch.arange(n)
            for i, n in enumerate(lengths)
        ]
        or [torch.zeros(0, dtype=torch.int64)]
    )


def _attend_chunk(q: Tensor, k: Tensor, v: Tensor, start: int) -> Tensor:
    """Causal attention of the queries at positions ``start``.. over the keys at positions
    0.. up to the last query's: q [n, Hq, D], k and v [start + n, Hkv, D] -> [n, Hq, D]. The
    queries are the keys' last n, so the mask is causal aligned to the lower right, which
    torch's ``causal_lower_right`` gives the fused kernels without a [n, keys] mask (CUDA's
    flash and memory-efficient kernels; CPU's SDPA still builds one)."""
    n, m = q.shape[0], k.shape[0]
    if start + n != m:
        raise ValueError(f"a chunk at {start} of {n} queries needs {start + n} keys, got {m}")
    return _attend(q, k, v, attn_mask=causal_lower_right(n, m) if start else None, causal=True)


def _attend(
    q: Tensor, k: Tensor, v: Tensor, *, attn_mask: CausalBias | None = None, causal: bool
) -> Tensor:
    """SDPA on [tokens, heads, dim] rows: causal from the upper left (``causal`` without a
    mask), the given ``attn_mask``, or bidirectional."""
    out = compat.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=attn_mask,
        is_causal=causal and attn_mask is None,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1)


# -- the collective glue -----------------------------------------------------------------------


@contextlib.contextmanager
def _named(what: str, timeout: float) -> Iterator[None]:
    """Re-raise a failed collective's error naming what was moved, where, and the timeout."""
    try:
        yield
    except RuntimeError as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise RuntimeError(f"{what} failed (timeout {timeout:g} s): {first}") from exc


class _GatherPieces(torch.autograd.Function):
    """All-gather one tensor per member ([rows, ...], equal shapes) -> [members, rows, ...];
    the backward reduce-scatters: member j gets the sum over members of their row j."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup, timeout: float, what: str) -> Tensor:  # noqa: ANN001
        ctx.group, ctx.timeout, ctx.what = group, timeout, what
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        with _named(f"the key/value gather of {what}", timeout):
            compat.collective(
                lambda: dist.all_gather(parts, x, group=group, async_op=True),
                tensors=[*parts, x],
                timeout=timeout,
            )
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # noqa: ANN001
        parts = list(grad.contiguous().unbind(0))
        mine = torch.empty_like(parts[0])
        with _named(f"the key/value gradient of {ctx.what}", ctx.timeout):
            compat.collective(
                lambda: dist.reduce_scatter(mine, parts, group=ctx.group, async_op=True),
                tensors=[mine, *parts],
                timeout=ctx.timeout,
            )
        return mine, None, None, None


class PackedPieces:
    """One rank's packed batch in which some sequences are pieces of split sequences: its
    RoPE positions and its causal attention.

    Build it once per step (on every rank, with the step's records): it checks that the ranks
    of each block hold the same records (one small gather per block); then every attention
    layer calls :meth:`attend`, which gathers each sequence's keys and values in its block
    (one gather per sequence and layer; a rank of the block without a piece of it joins with
    no rows).

    Args:
        lengths: the packed segments' token counts (a piece's is this rank's share).
        pieces: segment index -> the record of the sequence that segment is a piece of.
        topology: owns the groups (:meth:`Topology.context_parallel_group`) and the timeout.
        others: the step's other split sequences, any of them: those whose block holds this
            rank are joined with no rows, the rest ignored (every rank may pass all of them).
        causal: causal attention (a decoder's); False: bidirectional (an encoder's).

    Raises:
        ValueError: a segment length that is not positive, a piece index out of range, a
            record this rank holds no piece of, two pieces of one sequence, a segment whose
            length is not this rank's share of its record, or ranks no block holds.
        MismatchError: the ranks of a block hold different records (on each of them, naming
            the ranks that differ from it).
        RuntimeError: a member did not take part within the topology's timeout.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        pieces: Mapping[int, SplitSequence],
        *,
        topology: Topology,
        others: Sequence[SplitSequence] = (),
        causal: bool = True,
    ) -> None:
        self.lengths = [int(n) for n in lengths]
        self.causal = causal
        self.rank, self.timeout = topology.rank, topology.timeout
        if any(n < 1 for n in self.lengths):
            raise ValueError(f"lengths must be positive, got {self.lengths}")
        for i, split in pieces.items():
            if not isinstance(split, SplitSequence):
                raise ValueError(f"pieces[{i}] must be a SplitSequence, got {split!r}")
            if not 0 <= i < len(self.lengths):
                raise ValueError(f"pieces names segment {i}, not one of {len(self.lengths)}")
            if split.tokens(self.rank) != self.lengths[i]:
                raise ValueError(
                    f"segment {i} has {self.lengths[i]} tokens but rank {self.rank}'s share of "
                    f"sequence {split.key} is {split.tokens(self.rank)}"
                )
        keys = [s.key for s in pieces.values()]
        if len(set(keys)) != len(keys):
            raise ValueError(f"pieces must be of distinct sequences, got keys {sorted(keys)}")
        self.pieces = dict(sorted(pieces.items(), key=lambda item: item[1].key))
        blocks = {s.key: topology.context_parallel_block(s.ranks) for s in pieces.values()}
        joined = {}
        for s in others:
            block = topology.context_parallel_block(s.ranks)
            if s.key not in blocks and self.rank in block:
                joined[s.key], blocks[s.key] = s, block
        self.joined = dict(sorted(joined.items()))  # key -> a sequence joined with no rows
        self.blocks = blocks  # key -> the block its keys are gathered in
        self.groups = {b: topology.context_parallel_group(b) for b in set(blocks.values())}
        self.positions = packed_positions(self.lengths, self.pieces, self.rank)
        self._check_records()

    def _records(self) -> dict[int, SplitSequence]:
        """Every sequence this rank gathers for, by key: its pieces' and those it joins."""
        return {**{s.key: s for s in self.pieces.values()}, **self.joined}

    def _check_records(self) -> None:
        """Each block's ranks hold the same records, checked in the blocks' order."""
        records = self._records()
        for block, group in sorted(self.groups.items()):
            mine = sorted((s for k, s in records.items() if self.blocks[k] == block), key=repr)
            what = f"the piece records' check on ranks {block} (rank {self.rank})"
            with _named(what, self.timeout):
                prints = all_gather_fixed(
                    np.array([fingerprint(mine)]), group=group, timeout=self.timeout
                )[:, 0]
            me = int(prints[block.index(self.rank)])
            odd = [r for r, p in zip(block, prints, strict=True) if int(p) != me]
            if odd:
                raise MismatchError(
                    f"rank {self.rank}: ranks {odd} of the context-parallel block {block} hold "
                    f"other split sequences than this rank's {mine}"
                )

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Attention within each packed sequence (causal or not), a piece's queries over its
        whole sequence's keys. q: [T, Hq, D]; k, v: [T, Hkv, D]. Returns [T, Hq, D]."""
        total = sum(self.lengths)
        if q.shape[0] != total or k.shape[0] != total or v.shape[0] != total:
            raise ValueError(
                f"q, k, v must have the batch's {total} tokens, got "
                f"{q.shape[0]}, {k.shape[0]}, {v.shape[0]}"
            )
        qs, ks, vs = (t.split(self.lengths) for t in (q, k, v))
        segment = {s.key: i for i, s in self.pieces.items()}
        gathered, link = {}, q.new_zeros(())
        for key, split in sorted(self._records().items()):  # the same order on every rank
            i = segment.get(key)
            mine_k, mine_v = (k[:0], v[:0]) if i is None else (ks[i], vs[i])
            k_all, v_all = self._gather(split, mine_k, mine_v)
            if i is None:
                # Joined with no rows: tie the gather into the output (an exact 0) so that
                # this rank's backward takes part in its reduce-scatter too.
                link = link + k_all[:0].sum() + v_all[:0].sum()
            else:
                gathered[i] = k_all, v_all
        outs = []
        for i, q_seg in enumerate(qs):
            if not self.causal:
                k_all, v_all = gathered.get(i, (ks[i], vs[i]))
                outs.append(_attend(q_seg, k_all, v_all, causal=False))
                continue
            if i not in gathered:
                outs.append(_attend_chunk(q_seg, ks[i], vs[i], 0))
                continue
            k_all, v_all = gathered[i]
            ranges = self.pieces[i].chunks[self.pieces[i].member(self.rank)]
            q_chunks = q_seg.split([e - s for s, e in ranges])
            outs += [
                _attend_chunk(qc, k_all[:e], v_all[:e], s)
                for qc, (s, e) in zip(q_chunks, ranges, strict=True)
            ]
        out = torch.cat(outs) if outs else q.clone()
        return out + link if self.joined else out

    def _gather(self, split: SplitSequence, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """The whole sequence's keys and values, in position order, from every rank of its
        block (``k``, ``v``: this rank's rows, none where it holds no piece)."""
        block = self.blocks[split.key]
        counts = [split.tokens(r) if r in split.ranks else 0 for r in block]
        kv = torch.cat([k, v], dim=1)
        padded = torch.cat([kv, kv.new_zeros(max(counts) - kv.shape[0], *kv.shape[1:])])
        what = f"sequence {split.key} on ranks {split.ranks} (rank {self.rank})"
        parts = _GatherPieces.apply(padded, self.groups[block], self.timeout, what)
        rows = torch.cat([parts[j, :n] for j, n in enumerate(counts)])
        order = torch.cat([split.positions(r) for r in split.ranks]).argsort()
        full = rows[order.to(rows.device)]
        return full.split([k.shape[1], v.shape[1]], dim=1)
