"""A user's plugin, outside the package: an IMU modality with its own encoder architecture and
its own data task, all in this one file (``--plugin tests/plugins/imu_plugin.py`` on the
trainer, or ``plugins: [tests/plugins/imu_plugin.py]`` in a config).

- modality ``imu``: 6-channel inertial frames (accelerometer and gyroscope, 50 per second),
  balanced with ``greedy`` (its encoder packs its windows);
- architecture ``imu_conv``: ``window`` consecutive frames merged by a linear front end (a
  strided patch embedding), transformer blocks over the packed windows, the shared connector;
- task ``imu_caption``: a prompt, one recording of ``min_s``..``max_s`` seconds, a caption.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from torch import Tensor, nn

import orchmllm
from orchmllm.data.recipe import TaskParams
from orchmllm.models.attention import packed_attention, positions_from_lengths
from orchmllm.models.layers import Block, Connector, check_lengths

FRAMES_PER_S = 50


@dataclass(frozen=True)
class ImuConfig(orchmllm.EncoderConfig):
    """``model.encoders.<modality>`` of an ``imu_conv`` encoder.

    Attributes:
        channels: values per frame.
        window: frames merged into one encoder position by the front end.
    """

    arch: ClassVar[str] = "imu_conv"
    padded: ClassVar[bool] = False

    channels: int = 6
    window: int = 2

    @property
    def stride(self) -> int:
        return self.window

    @property
    def feature_dim(self) -> int:
        return self.channels

    @property
    def front_end_parameters(self) -> int:
        return (self.window * self.channels + 1) * self.hidden


class ImuEncoder(nn.Module):
    """frames [F, channels] of n recordings (lengths) -> [F // (window * downsample), llm]."""

    def __init__(self, cfg: ImuConfig, llm_hidden: int):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Linear(cfg.window * cfg.channels, cfg.hidden)
        self.blocks = nn.ModuleList(
            Block(cfg.hidden, cfg.ffn, cfg.heads, cfg.kv_heads, style="encoder", rope_theta=1e4)
            for _ in range(cfg.layers)
        )
        self.norm = nn.LayerNorm(cfg.hidden)
        self.connector = Connector(cfg.hidden, cfg.downsample, llm_hidden)

    def forward(self, frames: Tensor, lengths: Tensor) -> Tensor:
        check_lengths(lengths, self.cfg.rate.divisor, "lengths")
        windows = lengths // self.cfg.window
        x = self.embed(frames.reshape(-1, self.cfg.window * self.cfg.channels))
        attend = functools.partial(packed_attention, lengths=windows, causal=False)
        positions = positions_from_lengths(windows)
        for block in self.blocks:
            x = block(x, attend, positions)
        return self.connector(self.norm(x))


@dataclass(frozen=True)
class ImuCaptionParams(TaskParams):
    """``data.tasks.imu_caption``: the recordings' shortest and longest duration in seconds."""

    min_s: float = 2.0
    max_s: float = 20.0

    def check(self, path: str) -> None:
        super().check(path)
        if not 0 < self.min_s <= self.max_s:
            raise ValueError(f"{path}.min_s must be in (0, max_s], got {self.min_s!r}")


def draw_imu_caption(
    gen: np.random.Generator, n: int, params: ImuCaptionParams
) -> orchmllm.TaskDraw:
    """Prompt tokens, the recording's frames (uniform duration), caption tokens."""
    prompt = gen.integers(4, 12, n)
    frames = np.round(gen.uniform(params.min_s, params.max_s, n) * FRAMES_PER_S)
    caption = gen.integers(8, 60, n)
    return orchmllm.TaskDraw(np.column_stack([prompt, frames, caption]))


orchmllm.register_modality(
    orchmllm.Modality("imu", 3, "imu_frames", "greedy", arch="imu_conv", unit="frame")
)
orchmllm.register_architecture(ImuConfig, module=ImuEncoder)
orchmllm.register_task(
    orchmllm.Task(
        "imu_caption",
        (("text", False), ("imu", False), ("text", True)),
        ImuCaptionParams(),
        draw=draw_imu_caption,
    )
)
