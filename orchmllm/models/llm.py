"""Qwen2-style decoder LLM over packed interleaved sequences (no padding)."""

from __future__ import annotations

from torch import Tensor, nn

from orchmllm.config import LLMConfig
from orchmllm.dist.context_parallel import PackedPieces
from orchmllm.dist.loss import chunked_cross_entropy

from .attention import attention_of
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

    def forward(
        self,
        embeds: Tensor,
        lengths: Tensor,
        targets: Tensor | None = None,
        *,
        denom: float = 1.0,
        loss_chunk: int = 4096,
        pieces: PackedPieces | None = None,
    ) -> Tensor:
        """The packed sequences' logits, or their loss.

        Args:
            embeds: ``[T, hidden]``, packed sequences.
            lengths: the sequences' lengths (summing to T).
            targets: int64 ``[T]``, the next token at each position (``IGNORE_INDEX`` where
                nothing is predicted); None returns logits.
            denom: the summed loss is divided by it (the global target count).
            loss_chunk: tokens per chunk of the loss
                (:func:`orchmllm.dist.loss.chunked_cross_entropy`).
            pieces: the batch's pieces of split sequences (context parallelism,
                :attr:`orchmllm.dist.orchestrator.LLMBatch.pieces`): the positions and the
                attention come from it (keys gathered over each piece's ranks, a collective
                in every layer); None: every sequence is whole here.

        Returns:
            ``[T, vocab]`` logits without ``targets``; with them the summed cross-entropy over
            ``denom``, computed inside this call so that a sharded LM head is gathered for it.
        """
        check_lengths(lengths, 1, "lengths")
        attend, positions = attention_of(lengths, causal=True, pieces=pieces)
        x = embeds
        for block in self.blocks:
            x = block(x, attend, positions)
        hidden = self.norm(x)
        if targets is None:
            return self.lm_head(hidden)
        return chunked_cross_entropy(
            hidden, self.lm_head.weight, targets, chunk=loss_chunk, denom=denom
        )
