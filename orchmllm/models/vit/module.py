"""ViT vision encoder over packed, unpadded image patches (paper Section 8: no padding)."""

from __future__ import annotations

from torch import Tensor, nn

from orchmllm.dist.context_parallel import PackedPieces
from orchmllm.models.attention import attention_of
from orchmllm.models.layers import Block, Connector, check_lengths
from orchmllm.models.spec import register_architecture
from orchmllm.models.vit import VitConfig


class VisionEncoder(nn.Module):
    """patches [P, patch_dim] of n images (lengths, sum P) -> [P // downsample, llm_hidden].

    Each image attends only to itself (packed varlen, bidirectional); RoPE over the patch index
    within the image. Zero images (P = 0) run every submodule on empty tensors. With
    ``pieces`` (context parallelism: an image split over ranks, each piece whole merged
    tokens) a piece attends over its image's gathered keys at the image's positions.
    """

    def __init__(self, cfg: VitConfig, llm_hidden: int):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = nn.Linear(cfg.feature_dim, cfg.hidden)
        self.blocks = nn.ModuleList(
            Block(cfg.hidden, cfg.ffn, cfg.heads, cfg.kv_heads, style="encoder", rope_theta=1e4)
            for _ in range(cfg.layers)
        )
        self.norm = nn.LayerNorm(cfg.hidden)
        self.connector = Connector(cfg.hidden, cfg.downsample, llm_hidden)
        if cfg.frozen:
            for module in (self.patch_embed, self.blocks, self.norm):
                module.requires_grad_(False)

    def forward(
        self, patches: Tensor, lengths: Tensor, *, pieces: PackedPieces | None = None
    ) -> Tensor:
        check_lengths(lengths, self.cfg.downsample, "lengths")
        if patches.dim() != 2 or patches.shape[1] != self.cfg.feature_dim:
            raise ValueError(
                f"patches must be [P, {self.cfg.feature_dim}], got {tuple(patches.shape)}"
            )
        attend, positions = attention_of(lengths, causal=False, pieces=pieces)
        x = self.patch_embed(patches)
        for block in self.blocks:
            x = block(x, attend, positions)
        return self.connector(self.norm(x))


register_architecture(VitConfig, module=VisionEncoder)
