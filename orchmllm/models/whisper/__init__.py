"""The Whisper-style encoder architecture's spec (torch-free; the module is :mod:`.module`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from orchmllm.models.spec import EncoderConfig, register_architecture


@dataclass(frozen=True)
class WhisperConfig(EncoderConfig):
    """A Whisper-style encoder: a convolution front end of total stride ``conv_stride`` over
    ``n_mels``-bin log-mel frames (100 per second), padded attention, merge ``downsample``,
    MLP connector."""

    arch: ClassVar[str] = "whisper"
    padded: ClassVar[bool] = True

    n_mels: int = 16
    conv_stride: int = 2
    downsample: int = 2

    @property
    def stride(self) -> int:
        return self.conv_stride

    @property
    def feature_dim(self) -> int:
        return self.n_mels

    @property
    def front_end_parameters(self) -> int:
        """Two width-3 convolutions with bias: mels to ``hidden``, then ``hidden`` to itself."""
        return (3 * self.n_mels + 1) * self.hidden + (3 * self.hidden + 1) * self.hidden


register_architecture(WhisperConfig)
