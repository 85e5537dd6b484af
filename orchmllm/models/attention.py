"""Attention over packed variable-length sequences and over padded batches.

Packed layout: tokens of all sequences concatenated, ``cu_seqlens`` (int64, n+1) marks the
boundaries, exactly the flash-attention varlen convention. On CUDA with half precision the
fused varlen kernel of ``torch.nn.attention.varlen`` runs; everywhere else each sequence is
attended separately with SDPA, which never materialises a (T, T) mask and makes a sequence's
result independent of which other sequences share its batch (what rebalancing relies on).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from orchmllm import compat
from orchmllm.dist.context_parallel import PackedPieces

_FUSED_DTYPES = (torch.float16, torch.bfloat16)


def cu_seqlens_from_lengths(lengths: Tensor) -> Tensor:
    """Boundaries [0, l0, l0+l1, ...] (int64) of packed sequences."""
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths.to(torch.int64), 0, out=cu[1:])
    return cu


def positions_from_lengths(lengths: Tensor) -> Tensor:
    """Position of every packed token within its own sequence (restarts at 0 per sequence)."""
    lengths = lengths.to(torch.int64)
    total = int(lengths.sum())
    starts = cu_seqlens_from_lengths(lengths)[:-1]
    return torch.arange(total, device=lengths.device) - torch.repeat_interleave(starts, lengths)


def packed_attention(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor, *, causal: bool) -> Tensor:
    """Attention within each packed sequence.

    q: [T, Hq, D]; k, v: [T, Hkv, D] with Hq a multiple of Hkv (grouped-query attention);
    lengths: [n] positive sequence lengths summing to T. Returns [T, Hq, D].
    """
    total = int(lengths.sum()) if lengths.numel() else 0
    if q.shape[0] != total:
        raise ValueError(f"lengths sum to {total} but q has {q.shape[0]} tokens")
    gqa = q.shape[1] != k.shape[1]
    if total == 0:
        # Keep the output attached to q (and through a fused qkv projection to k and v) so
        # every parameter still receives a (zero) gradient on a rank with nothing to do.
        return q.clone()
    if q.is_cuda and q.dtype in _FUSED_DTYPES and compat.varlen_attention() is not None:
        cu = cu_seqlens_from_lengths(lengths).to(torch.int32)
        return compat.varlen_attention()(q, k, v, cu, int(lengths.max()), causal=causal)
    outs = []
    for qs, ks, vs in zip(*(t.split(lengths.tolist()) for t in (q, k, v)), strict=True):
        # [1, heads, tokens, head_dim]: with a batch dimension SDPA runs its flash kernel on
        # CPU too, which keeps what flash keeps (no [tokens, tokens] probabilities), so a CPU
        # step's memory is a GPU step's.
        o = compat.scaled_dot_product_attention(
            qs.transpose(0, 1)[None],
            ks.transpose(0, 1)[None],
            vs.transpose(0, 1)[None],
            is_causal=causal,
            enable_gqa=gqa,
        )
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


def padded_attention(q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor) -> Tensor:
    """Bidirectional attention over a padded batch.

    q: [B, T, Hq, D]; k, v: [B, T, Hkv, D]; key_mask: bool [B, T], True for real frames.
    Padded query rows produce values the caller must ignore. Returns [B, T, Hq, D].
    """
    if q.shape[0] == 0:
        # No item: CUDA's fused kernels return no tensor for an empty batch (torch 2.11, seen
        # on an H100). Keep the output attached to q so every parameter still gets a (zero)
        # gradient, as packed_attention does.
        return q.clone()
    gqa = q.shape[2] != k.shape[2]
    out = compat.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=key_mask[:, None, None, :],
        enable_gqa=gqa,
    )
    return out.transpose(1, 2)


def attention_of(
    lengths: Tensor, *, causal: bool, pieces: PackedPieces | None
) -> tuple[Callable[[Tensor, Tensor, Tensor], Tensor], Tensor]:
    """A packed batch's attention function and RoPE positions: each sequence on its own
    (positions from 0), or, with ``pieces`` (context parallelism), the pieces' (keys
    gathered over each split sequence's ranks, positions global in it)."""
    if pieces is None:
        attend = functools.partial(packed_attention, lengths=lengths, causal=causal)
        return attend, positions_from_lengths(lengths)
    return pieces.attend, pieces.positions.to(lengths.device)
