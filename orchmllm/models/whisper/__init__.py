"""The Whisper-style encoder architecture's spec (torch-free; the module is :mod:`.module`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from orchmllm.models.spec import EncoderConfig, register_architecture


@dataclass(frozen=True)
class WhisperConfig(EncoderConfig):
    """A Whisper-style encoder: a convolution front end of total stride ``conv_stride`` over
    ``n_mels``-bin log-mel frames (100 per second), padded attention, merge ``downsample``,
    MLP connector.

    ``bucket``: a batch is padded to the next multiple of this many frames rather than to its
    longest clip, so the encoder meets fewer shapes (a kernel's set-up for a new shape is paid
    once per shape). 1 pads to the longest clip: measured on CPU, a new shape's cost is paid
    once per distinct length over the run, less than a bucket's padding costs every step
    (``python benchmarks/shape_buckets.py``; docs/results.md). Outputs do not depend on it.
    """

    arch: ClassVar[str] = "whisper"
    padded: ClassVar[bool] = True

    n_mels: int = 16
    conv_stride: int = 2
    downsample: int = 2
    bucket: int = 1

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
