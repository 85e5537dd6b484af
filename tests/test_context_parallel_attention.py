"""Context-parallel attention (orchmllm.dist.context_parallel): a sequence split over 2 and
over 4 gloo ranks (also on ranks that are no block), beside whole sequences, gives the unsplit
outputs, loss and gradients (float64, 1e-10), causal and bidirectional; the pure helpers
(chunks, positions, targets); bad records and absent ranks fail with a clear error
instead of hanging."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from orchmllm.dist.comm import MismatchError
from orchmllm.dist.context_parallel import (
    PackedPieces,
    SplitSequence,
    chunk_ranges,
    packed_positions,
    piece_targets,
    split_sequence,
)
from orchmllm.dist.loss import chunked_cross_entropy
from orchmllm.dist.topology import Topology, context_parallel_blocks
from orchmllm.models.attention import packed_attention, positions_from_lengths
from orchmllm.models.layers import Block
from orchmllm.schema import IGNORE_INDEX
from orchmllm.testing import assert_check_passed, run_checks

TOL = 1e-10
HIDDEN, VOCAB = 16, 23
# The global batch: sequences 0 and 1 are long, the others short.
LENGTHS = [37, 19, 5, 3, 6, 4, 2, 7]
# Per layout, each rank's packed segments: (sequence, ranks it is split over or None,
# balanced); a split sequence appears on each of its ranks.
LAYOUTS = {
    "split over 2": [
        [(2, None, True), (0, (0, 1), True)],
        [(0, (0, 1), True), (3, None, True), (4, None, True)],
        [(1, None, True), (5, None, True)],
        [(6, None, True), (7, None, True)],
    ],
    "split over 4": [
        [(0, (0, 1, 2, 3), True), (2, None, True)],
        [(3, None, True), (0, (0, 1, 2, 3), True), (1, None, True)],
        [(0, (0, 1, 2, 3), True), (4, None, True), (5, None, True)],
        [(6, None, True), (0, (0, 1, 2, 3), True), (7, None, True)],
    ],
    # Pieces on ranks that are no block (the planner's k least-loaded ranks of a group): they
    # gather in the block of all 4, whose other ranks join with no rows.
    "over 1 and 2, and over 0, 1 and 3": [
        [(2, None, True), (1, (0, 1, 3), True)],
        [(0, (1, 2), True), (1, (0, 1, 3), True)],
        [(3, None, True), (0, (1, 2), True), (4, None, True)],
        [(1, (0, 1, 3), True), (5, None, True), (6, None, True), (7, None, True)],
    ],
    # Two pieces on ranks 0 and 1, in overlapping groups, one of them contiguous.
    "over 4 and over 2": [
        [(1, (0, 1), False), (0, (0, 1, 2, 3), True), (2, None, True)],
        [(0, (0, 1, 2, 3), True), (1, (0, 1), False)],
        [(3, None, True), (0, (0, 1, 2, 3), True), (4, None, True)],
        [(0, (0, 1, 2, 3), True), (5, None, True), (6, None, True), (7, None, True)],
    ],
}


# -- pure helpers ------------------------------------------------------------------------------


def _causal_work(chunks) -> list[int]:  # noqa: ANN001
    """Per member, the (query, key) pairs it attends: p + 1 for the query at position p."""
    return [sum(p + 1 for s, e in ranges for p in range(s, e)) for ranges in chunks]


@pytest.mark.parametrize("length, size", [(37, 2), (40, 4), (5, 4), (8, 4), (2, 2)])
def test_balanced_chunks_partition_the_sequence_and_even_the_causal_work(length, size):
    chunks = chunk_ranges(length, size)
    split = SplitSequence(0, tuple(range(size)), chunks)
    positions = torch.cat([split.positions(r) for r in split.ranks])
    assert sorted(positions.tolist()) == list(range(length))
    work = _causal_work(chunks)
    if length % (2 * size) == 0:
        assert len(set(work)) == 1
    if length >= 2 * size:  # shorter, some members hold one chunk only
        contiguous = _causal_work(chunk_ranges(length, size, balanced=False))
        assert max(work) - min(work) < max(contiguous) - min(contiguous)


def test_contiguous_chunks_are_one_range_each():
    assert chunk_ranges(10, 3, balanced=False) == (((0, 4),), ((4, 7),), ((7, 10),))
    assert chunk_ranges(8, 2) == (((0, 2), (6, 8)), ((2, 4), (4, 6)))


def test_positions_are_continuous_across_pieces_and_restart_in_whole_sequences():
    split = split_sequence(7, 8, (2, 3))
    assert split.positions(2).tolist() == [0, 1, 6, 7]
    assert split.positions(3).tolist() == [2, 3, 4, 5]
    assert packed_positions([3, 4, 2], {1: split}, 3).tolist() == [0, 1, 2, 2, 3, 4, 5, 0, 1]
    assert split.length == 8 and split.tokens(2) == 4


def test_each_target_lands_on_exactly_one_member():
    targets = torch.tensor([5, 1, IGNORE_INDEX, 4, 9, 2, 7, 3, 8, IGNORE_INDEX, 6])
    split = split_sequence(0, targets.numel(), (0, 1, 2))
    per_rank = [piece_targets(targets, split, r) for r in split.ranks]
    assert sum(int((t != IGNORE_INDEX).sum()) for t in per_rank) == 9
    order = torch.cat([split.positions(r) for r in split.ranks]).argsort()
    assert torch.equal(torch.cat(per_rank)[order], targets)
    with pytest.raises(ValueError, match="sequence's 11 positions"):
        piece_targets(targets[:-1], split, 0)


@pytest.mark.parametrize(
    "ranks, chunks, match",
    [
        ((1, 0), (((0, 2),), ((2, 4),)), "ascending"),
        ((0,), (((0, 2),),), "ascending"),
        ((0, 1), (((0, 2),),), "at least one range"),
        ((0, 1), (((0, 2),), ((3, 4),)), "exactly once"),
        ((0, 1), (((0, 3),), ((2, 4),)), "exactly once"),
        ((0, 1), (((0, 2),), ((2, 2), (2, 4))), "exactly once"),
    ],
)
def test_a_bad_record_is_refused(ranks, chunks, match):
    with pytest.raises(ValueError, match=match):
        SplitSequence(0, ranks, chunks)


def test_chunk_ranges_refuses_more_ranks_than_tokens():
    with pytest.raises(ValueError, match="cannot split 3 tokens over 4 ranks"):
        chunk_ranges(3, 4)


@pytest.mark.parametrize(
    "lengths, pieces, match",
    [
        ([3, 0], {}, "lengths must be positive"),
        ([3], {1: split_sequence(0, 6, (0, 1))}, "pieces names segment 1, not one of 1"),
        ([3], {0: split_sequence(0, 6, (1, 2))}, "rank 0 holds no piece of sequence 0"),
        ([2], {0: split_sequence(0, 6, (0, 1))}, "segment 0 has 2 tokens but rank 0's share"),
        ([3, 3], {0: split_sequence(4, 6, (0, 1)), 1: split_sequence(4, 6, (0, 1))}, "distinct"),
        (
            [3],
            {0: split_sequence(0, 6, (0, 1))},
            r"no context-parallel block .* holds ranks \[0, 1\]",
        ),
    ],
)
def test_a_bad_packed_batch_is_refused(lengths, pieces, match):
    with pytest.raises(ValueError, match=match):
        PackedPieces(lengths, pieces, topology=Topology.build())


def test_whole_sequences_attend_as_the_models_packed_attention():
    torch.manual_seed(0)
    lengths = [5, 1, 7]
    q = torch.randn(13, 4, 8, dtype=torch.float64)
    k, v = torch.randn(2, 13, 2, 8, dtype=torch.float64)
    batch = PackedPieces(lengths, {}, topology=Topology.build())
    want = packed_attention(q, k, v, torch.tensor(lengths), causal=True)
    assert (batch.attend(q, k, v) - want).abs().max() < TOL
    assert batch.positions.tolist() == positions_from_lengths(torch.tensor(lengths)).tolist()
    with pytest.raises(ValueError, match="batch's 13 tokens, got 12"):
        batch.attend(q[:12], k, v)


def test_context_parallel_blocks_are_aligned_per_divisor():
    assert context_parallel_blocks(6, 4) == [(0, 1), (2, 3), (4, 5), (0, 1, 2, 3)]


@pytest.mark.parametrize("value", [0, True, 2.0, "2"])
def test_topology_refuses_a_bad_context_parallel(value):
    with pytest.raises(ValueError, match="context_parallel"):
        Topology.build(context_parallel=value)


# -- 4 gloo ranks ------------------------------------------------------------------------------


class _Decoder(nn.Module):
    """Two Qwen2-style blocks (grouped-query attention, RoPE) and an LM head."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            Block(HIDDEN, 32, 4, 2, style="qwen2", rope_theta=10000.0) for _ in range(2)
        )
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, x, attend, positions, targets, denom):  # noqa: ANN001
        for block in self.blocks:
            x = block(x, attend, positions)
        return x, chunked_cross_entropy(x, self.head.weight, targets, chunk=16, denom=denom)


def _global_batch() -> tuple[_Decoder, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = _Decoder().double()
    embeds = torch.randn(sum(LENGTHS), HIDDEN, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(VOCAB, (sum(LENGTHS),))
    targets[torch.rand(sum(LENGTHS)) < 0.2] = IGNORE_INDEX
    return model, embeds, targets


def _each_layout_equals_unsplit(rank: int, topology: Topology, *, causal: bool) -> None:
    model, embeds, targets = _global_batch()
    lengths = torch.tensor(LENGTHS)
    denom = float((targets != IGNORE_INDEX).sum())
    model.zero_grad()
    ref_out, ref_loss = model(
        embeds,
        lambda q, k, v: packed_attention(q, k, v, lengths, causal=causal),
        positions_from_lengths(lengths),
        targets,
        denom,
    )
    ref_loss.backward()
    ref_grads = [b.attn.qkv.weight.grad.clone() for b in model.blocks] + [embeds.grad.clone()]
    starts = [sum(LENGTHS[:i]) for i in range(len(LENGTHS))]
    for name, layout in LAYOUTS.items():
        rows, seg_targets, seg_lengths, pieces = [], [], [], {}
        for seq, ranks, balanced in layout[rank]:
            positions = torch.arange(LENGTHS[seq])
            seq_targets = targets[starts[seq] : starts[seq] + LENGTHS[seq]]
            if ranks is not None:
                split = split_sequence(seq, LENGTHS[seq], ranks, balanced=balanced)
                pieces[len(seg_lengths)] = split
                positions = split.positions(rank)
                seq_targets = piece_targets(seq_targets, split, rank)
            rows.append(starts[seq] + positions)
            seg_targets.append(seq_targets)
            seg_lengths.append(positions.numel())
        rows = torch.cat(rows)
        others = {
            seq: split_sequence(seq, LENGTHS[seq], ranks, balanced=balanced)
            for segments in layout
            for seq, ranks, balanced in segments
            if ranks is not None
        }
        batch = PackedPieces(
            seg_lengths, pieces, topology=topology, others=list(others.values()), causal=causal
        )
        model.zero_grad()
        embeds.grad = None
        out, loss = model(
            embeds[rows], batch.attend, batch.positions, torch.cat(seg_targets), denom
        )
        loss.backward()
        grads = [b.attn.qkv.weight.grad.clone() for b in model.blocks] + [embeds.grad.clone()]
        loss = loss.detach()
        for t in [loss, *grads]:  # what the data-parallel gradient reduction sums
            dist.all_reduce(t)
        name = f"{name}, causal={causal}"
        assert (out - ref_out[rows]).abs().max() < TOL, name
        assert abs(float(loss) - float(ref_loss)) < TOL, name
        for got, want in zip(grads, ref_grads, strict=True):
            assert (got - want).abs().max() < TOL, name


def _split_equals_unsplit(rank: int, world: int) -> None:
    with pytest.raises(ValueError, match="context_parallel must be <= the 4 ranks, got 8"):
        Topology.build(context_parallel=8)
    topology = Topology.build(context_parallel=4, timeout=30)
    assert topology.context_parallel_group((0, 1, 2, 3)) is topology.context_parallel_group(
        [0, 1, 2, 3]
    )
    with pytest.raises(ValueError, match=r"ranks \(1, 2\) are no context-parallel group"):
        topology.context_parallel_group((1, 2))
    assert topology.context_parallel_block((1, 2)) == (0, 1, 2, 3)
    assert topology.context_parallel_block((2, 3)) == (2, 3)
    for causal in (True, False):  # a decoder's attention, an encoder's
        _each_layout_equals_unsplit(rank, topology, causal=causal)
    topology.close()
    with pytest.raises(RuntimeError, match="closed"):
        topology.context_parallel_group((0, 1))


def _mismatched_records(rank: int, world: int) -> None:
    """Rank 1 believes sequence 0 has 12 tokens, rank 0 that it has 11."""
    with Topology.build(context_parallel=2, timeout=30) as topology:
        if rank > 1:
            return
        split = split_sequence(0, 11 + rank, (0, 1))
        with pytest.raises(MismatchError) as err:
            PackedPieces([split.tokens(rank)], {0: split}, topology=topology)
        other = 1 - rank
        assert f"rank {rank}: ranks [{other}] of the context-parallel block (0, 1)" in str(
            err.value
        )


def _absent_rank_times_out(rank: int, world: int) -> None:
    """Rank 0 holds a piece on ranks 0-1 that rank 1 does not know: rank 0's check times out."""
    with Topology.build(context_parallel=2, timeout=2) as topology:
        if rank == 0:
            split = split_sequence(0, 8, (0, 1))
            started = time.monotonic()
            with pytest.raises(RuntimeError) as err:
                PackedPieces([4], {0: split}, topology=topology)
            assert time.monotonic() - started < 10
            assert "check on ranks (0, 1) (rank 0) failed (timeout 2 s)" in str(err.value)
        else:
            PackedPieces([3], {}, topology=topology)  # no piece: no collective
            time.sleep(4)  # alive past rank 0's timeout: the timeout ends its wait
        dist.barrier()


@pytest.fixture(scope="module")
def results() -> list:
    checks = {
        "split": _split_equals_unsplit,
        "mismatch": _mismatched_records,
        "timeout": _absent_rank_times_out,
    }
    return run_checks(checks, 4, timeout=120)


@pytest.mark.integration
def test_split_sequences_give_the_unsplit_outputs_loss_and_gradients(results):
    assert_check_passed(results, "split")


@pytest.mark.integration
def test_mismatched_records_fail_on_every_member_naming_the_other_rank(results):
    assert_check_passed(results, "mismatch")


@pytest.mark.integration
def test_a_rank_missing_from_a_group_times_out_with_the_group_named(results):
    assert_check_passed(results, "timeout")
