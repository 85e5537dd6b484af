"""Transformer building blocks shared by the encoders and the LLM.

One :class:`Block` covers the three styles in the reference MLLM: ViT (LayerNorm, GELU MLP,
RoPE over the token index), Whisper encoder (LayerNorm, GELU MLP, absolute positions added
outside) and Qwen2 (RMSNorm, SwiGLU, RoPE, grouped-query attention with q/k/v bias). Each block
is one FSDP2 unit. The attention pattern is passed in as a function, so a block does not care
whether its batch is packed or padded.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

AttendFn = Callable[[Tensor, Tensor, Tensor], Tensor]


def rotate(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """Rotary position embedding (rotate-half form). x: [..., T, H, D]; positions: [..., T]."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, device=x.device, dtype=torch.float64) / half)
    angles = positions.to(torch.float64)[..., None] * inv_freq  # [..., T, half]
    cos = angles.cos().to(x.dtype)[..., None, :]
    sin = angles.sin().to(x.dtype)[..., None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def sinusoids(positions: Tensor, dim: int) -> Tensor:
    """Fixed sinusoidal position embeddings [..., T, dim] (Whisper encoder style)."""
    half = dim // 2
    inv = torch.exp(
        -math.log(10000.0) * torch.arange(half, device=positions.device, dtype=torch.float64) / half
    )
    angles = positions.to(torch.float64)[..., None] * inv
    return torch.cat((angles.sin(), angles.cos()), dim=-1)


class SelfAttention(nn.Module):
    """Multi-head / grouped-query self-attention with one fused q|k|v projection.

    The fused projection means a rank with zero tokens still gives every weight a gradient.
    """

    def __init__(self, hidden: int, heads: int, kv_heads: int, *, rope_theta: float | None):
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads
        self.head_dim = hidden // heads
        self.rope_theta = rope_theta
        self.qkv = nn.Linear(hidden, (heads + 2 * kv_heads) * self.head_dim, bias=True)
        self.out = nn.Linear(heads * self.head_dim, hidden, bias=False)

    def forward(self, x: Tensor, attend: AttendFn, positions: Tensor | None) -> Tensor:
        lead = x.shape[:-1]
        qkv = self.qkv(x).view(*lead, self.heads + 2 * self.kv_heads, self.head_dim)
        q, k, v = qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=-2)
        if self.rope_theta is not None:
            q = rotate(q, positions, self.rope_theta)
            k = rotate(k, positions, self.rope_theta)
        return self.out(attend(q, k, v).reshape(*lead, self.heads * self.head_dim))


class GeluMLP(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.up = nn.Linear(hidden, ffn)
        self.down = nn.Linear(ffn, hidden)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.gelu(self.up(x)))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(
        self,
        hidden: int,
        ffn: int,
        heads: int,
        kv_heads: int,
        *,
        style: str,
        rope_theta: float | None = None,
    ):
        super().__init__()
        if style == "qwen2":
            self.norm1, self.norm2 = nn.RMSNorm(hidden, eps=1e-6), nn.RMSNorm(hidden, eps=1e-6)
            self.mlp: nn.Module = SwiGLU(hidden, ffn)
        elif style == "encoder":
            self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
            self.mlp = GeluMLP(hidden, ffn)
        else:
            raise ValueError(f"style must be 'qwen2' or 'encoder', got {style!r}")
        self.attn = SelfAttention(hidden, heads, kv_heads, rope_theta=rope_theta)

    def forward(self, x: Tensor, attend: AttendFn, positions: Tensor | None = None) -> Tensor:
        x = x + self.attn(self.norm1(x), attend, positions)
        return x + self.mlp(self.norm2(x))


class Connector(nn.Module):
    """Downsample by merging ``rate`` consecutive tokens, then a 2-layer MLP to the LLM width.

    Every item's length must be a multiple of ``rate`` so merged tokens never straddle items.
    """

    def __init__(self, hidden: int, rate: int, out_hidden: int):
        super().__init__()
        self.rate = rate
        self.fc1 = nn.Linear(hidden * rate, out_hidden)
        self.fc2 = nn.Linear(out_hidden, out_hidden)

    def forward(self, x: Tensor) -> Tensor:
        merged = x.reshape(x.shape[0] // self.rate, x.shape[1] * self.rate)
        return self.fc2(F.gelu(self.fc1(merged)))


def check_lengths(lengths: Tensor, multiple: int, name: str) -> None:
    """Raise ValueError unless ``lengths`` is 1-D, positive and divisible by ``multiple``."""
    if lengths.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(lengths.shape)}")
    if lengths.numel() and (int(lengths.min()) < 1 or bool((lengths % multiple != 0).any())):
        raise ValueError(f"{name} must be positive multiples of {multiple}, got {lengths.tolist()}")
