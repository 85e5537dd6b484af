"""Whisper-style audio encoder: conv front end, then a transformer over padded batches.

Audio is batched with padding (paper Section 8), because of the convolutions: clips are padded
to the longest one and attention masks the padded keys. The cost is therefore
batch * max_length, which is why the audio phase is balanced with a padded-cost policy.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from orchmllm.models.attention import padded_attention
from orchmllm.models.layers import Block, Connector, check_lengths, sinusoids
from orchmllm.models.spec import register_architecture
from orchmllm.models.whisper import WhisperConfig


class AudioEncoder(nn.Module):
    """mels [F, n_mels] of n clips (lengths, sum F) -> [F // (stride*downsample), llm_hidden]."""

    def __init__(self, cfg: WhisperConfig, llm_hidden: int):
        super().__init__()
        self.cfg = cfg
        self.conv1 = nn.Conv1d(cfg.n_mels, cfg.hidden, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(
            cfg.hidden, cfg.hidden, kernel_size=3, stride=cfg.conv_stride, padding=1
        )
        self.blocks = nn.ModuleList(
            Block(cfg.hidden, cfg.ffn, cfg.heads, cfg.kv_heads, style="encoder")
            for _ in range(cfg.layers)
        )
        self.norm = nn.LayerNorm(cfg.hidden)
        self.connector = Connector(cfg.hidden, cfg.downsample, llm_hidden)
        if cfg.frozen:
            for module in (self.conv1, self.conv2, self.blocks, self.norm):
                module.requires_grad_(False)

    def forward(self, mels: Tensor, lengths: Tensor) -> Tensor:
        cfg = self.cfg
        check_lengths(lengths, cfg.rate.divisor, "lengths")
        if mels.dim() != 2 or mels.shape[1] != cfg.n_mels:
            raise ValueError(f"mels must be [F, {cfg.n_mels}], got {tuple(mels.shape)}")
        n = lengths.numel()
        # An empty batch still needs a conv-able width; its rows are all padding.
        longest = int(lengths.max()) if n else cfg.rate.divisor
        t_max = -(-longest // cfg.bucket) * cfg.bucket  # the shape the encoder meets
        frame = torch.arange(t_max, device=mels.device)
        valid = frame[None, :] < lengths[:, None]  # [B, T]
        padded = mels.new_zeros(n, t_max, cfg.n_mels)
        padded[valid] = mels
        # Zero the padded frames after conv1 so a clip's output does not depend on its batch.
        h = F.gelu(self.conv1(padded.transpose(1, 2))) * valid[:, None, :]
        h = F.gelu(self.conv2(h)).transpose(1, 2)  # [B, T', hidden]
        out_lengths = lengths // cfg.conv_stride
        key_mask = frame[None, : h.shape[1]] < out_lengths[:, None]
        h = h + sinusoids(frame[: h.shape[1]], cfg.hidden).to(h.dtype)
        attend = functools.partial(padded_attention, key_mask=key_mask)
        for block in self.blocks:
            h = block(h, attend)
        return self.connector(self.norm(h[key_mask]))


register_architecture(WhisperConfig, module=AudioEncoder)
