"""Adapters for models whose vision tower encodes fixed-size tiles: LLaVA, LLaVA-OneVision and
InternVL.

An item's raw rows are its tiles, one flattened ``[channels * side * side]`` row each (an
image's anyres tiles, a video's frames, an InternVL image's crops), so the vision phase balances
tiles, which cost the tower the same each. The item states its tokens (a tile becomes a fixed
number of features, but anyres packing, pooling and newlines change the count); the language
model runs on packed sequences with restarting 1-D positions.

LLaVA-OneVision's images and videos share the vision phase (one tower); the tower runs on them
through the model's own ``get_image_features`` and ``get_video_features``, once each per step
on every rank (a dummy item where the rank has none, so FSDP2 sees the same calls everywhere).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers.models.llava_onevision.modeling_llava_onevision import image_size_to_num_patches

import orchmllm
from orchmllm.integrations import hf_compat
from orchmllm.integrations.transformers.adapter import (
    Adapter,
    Item,
    Source,
    pixel_rows,
    register_adapter,
)


class LlavaAdapter(Adapter):
    """``LlavaForConditionalGeneration``: each image one tile (``pixel_values[i]``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        vision = self.config.vision_config
        self.channels, self.side = vision.num_channels, _side(vision.image_size)
        self.token = self.config.image_token_id

    def sources(self) -> tuple[Source, ...]:
        return (Source("image", self.token, "vision"),)

    def feature_dims(self) -> dict[str, int]:
        return {"vision": self.channels * self.side**2}

    def tiles(self, pixels: torch.Tensor) -> torch.Tensor:
        """Raw rows as the tower's ``[tiles, channels, side, side]``."""
        return pixels.reshape(-1, self.channels, self.side, self.side)

    def tokens_per_tile(self) -> int:
        patches = (self.side // self.config.vision_config.patch_size) ** 2
        return patches + int(self.config.vision_feature_select_strategy == "full")

    def split(self, kind: str, row: Mapping[str, Any]) -> list[Item]:
        if "pixel_values" not in row:
            return []
        pixels = pixel_rows(row, "pixel_values", self.feature_dims()["vision"])[:, None]
        return [Item(p, {}, self.tokens_per_tile()) for p in pixels]

    def dummy(self, phase: str) -> Item:
        rows = np.zeros((1, self.feature_dims()["vision"]), np.float32)
        return Item(rows, {}, self.tokens_per_tile())

    def encode(
        self,
        model: nn.Module,
        phase: str,
        rows: torch.Tensor,
        lengths: torch.Tensor,
        meta: Mapping[str, torch.Tensor],
    ) -> orchmllm.Encoded:
        out = hf_compat.features(model, "get_image_features", pixel_values=self.tiles(rows))
        return orchmllm.Encoded(out.tokens())  # tiles in order


class InternVLAdapter(LlavaAdapter):
    """``InternVLForConditionalGeneration``: an image is a run of crops (tiles), each a fixed
    number of tokens; the crops of one image fill one run of placeholders."""

    def tokens_per_tile(self) -> int:
        return self.config.image_seq_length

    def split(self, kind: str, row: Mapping[str, Any]) -> list[Item]:
        if "pixel_values" not in row:
            return []
        pixels = pixel_rows(row, "pixel_values", self.feature_dims()["vision"])
        ids = np.asarray(row["input_ids"]).reshape(-1)
        runs = _runs(ids == self.token)  # one run of placeholders per image
        tiles = [n // self.tokens_per_tile() for n in runs]
        if sum(tiles) != len(pixels) or any(n % self.tokens_per_tile() for n in runs):
            raise ValueError(
                f"{len(pixels)} crops do not fill the image runs of {runs} placeholders "
                f"({self.tokens_per_tile()} per crop)"
            )
        parts = np.split(pixels, np.cumsum(tiles)[:-1])
        return [Item(p, {}, len(p) * self.tokens_per_tile()) for p in parts]


class LlavaOnevisionAdapter(LlavaAdapter):
    """``LlavaOnevisionForConditionalGeneration``: an image's anyres tiles (as many as the
    model's ``image_size_to_num_patches`` gives its size) and a video's frames."""

    fields = {"vision": (orchmllm.ItemField("image_size", width=2), orchmllm.ItemField("video"))}

    def sources(self) -> tuple[Source, ...]:
        return (*super().sources(), Source("video", self.config.video_token_id, "vision"))

    def tile_count(self, size: np.ndarray) -> int:
        return image_size_to_num_patches(
            [int(s) for s in size], self.config.image_grid_pinpoints, self.side
        )

    def video_tokens(self, frames: int) -> int:
        per_side = -(-(self.side // self.config.vision_config.patch_size) // 2)  # ceil: pooling
        return frames * per_side**2 + 1  # and one newline

    def split(self, kind: str, row: Mapping[str, Any]) -> list[Item]:
        width = self.feature_dims()["vision"]
        if kind == "video":
            if "pixel_values_videos" not in row:
                return []
            count = np.shape(row["pixel_values_videos"])[0]
            videos = pixel_rows(row, "pixel_values_videos", width, count)
            meta = {"image_size": [self.side, self.side], "video": 1}
            return [Item(v, meta, self.video_tokens(len(v))) for v in videos]
        if "pixel_values" not in row:
            return []
        sizes = np.asarray(row["image_sizes"]).reshape(-1, 2)
        pixels = pixel_rows(row, "pixel_values", width, len(sizes))
        items = []
        for size, tiles in zip(sizes, pixels, strict=True):
            n = self.tile_count(size)
            # its tokens (packed, unpadded features and newlines): its run of placeholders
            items.append(Item(tiles[:n], {"image_size": size.tolist(), "video": 0}, None))
        return items

    def dummy(self, phase: str) -> Item:
        meta = {"image_size": [self.side, self.side], "video": 1}  # a one-frame video
        rows = np.zeros((1, self.feature_dims()["vision"]), np.float32)
        return Item(rows, meta, self.video_tokens(1))

    def encode(
        self,
        model: nn.Module,
        phase: str,
        rows: torch.Tensor,
        lengths: torch.Tensor,
        meta: Mapping[str, torch.Tensor],
    ) -> orchmllm.Encoded:
        """Images through ``get_image_features``, videos through ``get_video_features``, one
        call each on every rank (a rank without one encodes a dummy and keeps none of it)."""
        video = meta["video"][:, 0].bool()
        parts = torch.split(rows, lengths.tolist())
        images = [p for p, v in zip(parts, video.tolist(), strict=True) if not v]
        videos = [p for p, v in zip(parts, video.tolist(), strict=True) if v]
        sizes = meta["image_size"][~video]
        no_image, no_video = not images, not videos
        if no_image:
            square = [self.side, self.side]
            images, sizes = (
                [rows.new_zeros(self.tile_count(square), rows.shape[1])],
                sizes.new_tensor([square]),
            )
        if no_video:
            videos = [rows.new_zeros(1, rows.shape[1])]
        image_tokens = hf_compat.features(
            model, "get_image_features", pixel_values=self.tiles(torch.cat(images)),
            image_sizes=sizes,
        ).pooler_output  # fmt: skip
        per_frame = self.video_tokens(1) - 1
        count = per_frame * sum(len(v) for v in videos)
        frames = hf_compat.features(
            model, "get_video_features", self.tiles(torch.cat(videos))[None]
        ).pooler_output[0, :count]  # every frame pooled, as one video (a newline dropped) ...
        newline = hf_compat.part(model, "image_newline")[None].to(frames.dtype)
        video_tokens = [  # ... and one appended per video, as the model gives each video
            torch.cat([f, newline])
            for f in torch.split(frames, [len(v) * per_frame for v in videos])
        ]
        next_image, next_video = iter(image_tokens), iter(video_tokens)
        tokens = [next(next_video) if v else next(next_image) for v in video.tolist()]
        tokens += [image_tokens[0][:0]] * no_image + [video_tokens[0][:0]] * no_video
        return orchmllm.Encoded(torch.cat(tokens))


def _runs(mask: np.ndarray) -> list[int]:
    """Lengths of the runs of True in ``mask``."""
    edges = np.diff(np.concatenate(([0], mask.astype(np.int8), [0])))
    return (np.flatnonzero(edges == -1) - np.flatnonzero(edges == 1)).tolist()


def _side(size: int | list[int]) -> int:
    return int(size[0] if isinstance(size, list | tuple) else size)


for _cls, _adapter in (
    ("LlavaForConditionalGeneration", LlavaAdapter),
    ("LlavaOnevisionForConditionalGeneration", LlavaOnevisionAdapter),
    ("InternVLForConditionalGeneration", InternVLAdapter),
):
    register_adapter(_cls, _adapter)
