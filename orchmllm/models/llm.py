"""Qwen2-style decoder LLM over packed interleaved sequences (no padding)."""

from __future__ import annotations

import functools

from torch import Tensor, nn

from orchmllm.config import LLMConfig

from .attention import packed_attention, positions_from_lengths
from .layers import Block, check_lengths


class LLM(nn.Module):
    """RMSNorm, RoPE, SwiGLU, grouped-query attention; causal within each packed sequence."""

    def __init__(self, cfg: LLMConfig, vocab: int):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(vocab, cfg.hidden)
        self.blocks = nn.ModuleList(
            Block(
                cfg.hidden,
                cfg.ffn,
                cfg.heads,
                cfg.kv_heads,
                style="qwen2",
                rope_theta=cfg.rope_theta,
            )
            for _ in range(cfg.layers)
        )
        self.norm = nn.RMSNorm(cfg.hidden, eps=1e-6)
        self.lm_head = nn.Linear(cfg.hidden, vocab, bias=False)

    def embed(self, input_ids: Tensor) -> Tensor:
        """Token embeddings [T, hidden]."""
        return self.embed_tokens(input_ids)

    def forward(self, embeds: Tensor, lengths: Tensor) -> Tensor:
        """embeds [T, hidden] of packed sequences (lengths, sum T) -> logits [T, vocab]."""
        check_lengths(lengths, 1, "lengths")
        attend = functools.partial(packed_attention, lengths=lengths, causal=True)
        positions = positions_from_lengths(lengths)
        x = embeds
        for block in self.blocks:
            x = block(x, attend, positions)
        return self.lm_head(self.norm(x))
