"""The ViT encoder architecture's spec (torch-free; the module is :mod:`.module`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from orchmllm.models.spec import EncoderConfig, register_architecture


@dataclass(frozen=True)
class VitConfig(EncoderConfig):
    """A ViT over ``patch x patch`` RGB patches, packed bidirectional attention, then
    ``downsample`` consecutive tokens merged and an MLP connector to the LLM width."""

    arch: ClassVar[str] = "vit"
    padded: ClassVar[bool] = False

    patch: int = 14
    downsample: int = 4

    @property
    def feature_dim(self) -> int:
        return 3 * self.patch * self.patch

    @property
    def front_end_parameters(self) -> int:
        """The patch embedding: one linear layer with bias."""
        return (self.feature_dim + 1) * self.hidden


register_architecture(VitConfig)
