"""Adapters for the Qwen vision-language family: Qwen2-VL, Qwen2.5-VL, Qwen3-VL and the thinker
of Qwen2.5-Omni (vision and audio).

Images and videos share the vision phase, as they share the model's vision tower: an item is
an image or a video, its raw rows are its patches (``pixel_values`` rows), its record its grid
``(t, h, w)``, whether it is a video and its seconds per temporal patch. The tower runs once per
step on every item of the rank (its attention is per frame, so packing items changes nothing).
Each token's M-RoPE offsets and the position step after its item come from the model's own
functions (``get_rope_index`` on the item alone, Omni's ``get_llm_pos_ids_for_vision``) and
travel with the token to the LLM layout, where :func:`.adapter.mrope_positions` rebuilds
``get_rope_index`` over the packed sequences (over whole sequences, before the pieces of a
split one leave for their ranks: :func:`.adapter.packed_mrope_positions`).

Qwen3-VL separates a video's frames by timestamp text, so each frame is an item (its tokens
are one run; the tower attends per frame, so the features are the same); its DeepStack
features travel with the vision tokens and are added where the model adds them.

The Omni thinker's audio is its own phase (the audio tower packs clips by windows, so the
phase is balanced with ``greedy``): an item is a clip's log-mel frames; its tokens take
consecutive positions, like text. Videos with their audio interleaved
(``use_audio_in_video``) are not adapted.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

import orchmllm
from orchmllm.integrations import hf_compat
from orchmllm.integrations.transformers.adapter import (
    TEXT_ROPE,
    Adapter,
    Item,
    Source,
    item_rope,
    packed_mrope_positions,
    pixel_rows,
    register_adapter,
)

VISION_FIELDS = (
    orchmllm.ItemField("grid_thw", width=3),
    orchmllm.ItemField("video"),
    orchmllm.ItemField("seconds", dtype="float64"),  # per temporal patch (videos)
)
KINDS = ("image", "video")
MROPE_MESSAGE = (
    "a Qwen row with images or videos has no mm_token_type_ids: orchmllm builds its M-RoPE "
    "positions from the placeholders, but the plain HF model silently falls back to 1-D text "
    "positions without them, so a plain run (a baseline, evaluation, generation) on these "
    "rows trains or scores another model; keep the processor's mm_token_type_ids column "
    "(return_mm_token_type_ids=True, and not removed by the dataset or collator)"
)


class MRopeWarning(UserWarning):
    """Qwen rows without ``mm_token_type_ids``: the plain HF model would lose M-RoPE."""


class Qwen2VLAdapter(Adapter):
    """``Qwen2VLForConditionalGeneration``: vision phase (images and videos), M-RoPE."""

    fields = {"vision": VISION_FIELDS}
    seconds_key: str | None = None  # the row field with a video's seconds per temporal patch
    mm_token_types = True  # the plain model's M-RoPE needs the row's mm_token_type_ids (where
    # this release reads them: see __init__)

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        # releases before mm_token_type_ids find the items from the placeholders themselves
        self.mm_token_types = self.mm_token_types and hf_compat.rope_reads_token_types(model)
        vision = self.config.vision_config
        self.merge = vision.spatial_merge_size
        self.patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        self.tokens = {"image": self.config.image_token_id, "video": self.config.video_token_id}

    def sources(self) -> tuple[Source, ...]:
        return tuple(Source(kind, self.tokens[kind], "vision") for kind in KINDS)

    def feature_dims(self) -> dict[str, int]:
        return {"vision": self.patch_dim}

    def to_example(self, row: Mapping[str, Any]) -> dict:
        """As :meth:`Adapter.to_example`; warns (:class:`MRopeWarning`) when a row with images
        or videos lacks ``mm_token_type_ids``."""
        has_items = any(row.get(f"{kind}_grid_thw") is not None for kind in KINDS)
        if self.mm_token_types and has_items and row.get("mm_token_type_ids") is None:
            warnings.warn(MRopeWarning(MROPE_MESSAGE), stacklevel=2)
        return super().to_example(row)

    def split(self, kind: str, row: Mapping[str, Any]) -> list[Item]:
        if f"{kind}_grid_thw" not in row:
            return []
        grids = np.asarray(row[f"{kind}_grid_thw"]).reshape(-1, 3)
        key = "pixel_values" if kind == "image" else "pixel_values_videos"
        pixels = pixel_rows(row, key, self.patch_dim)
        sizes = grids.prod(1)
        if pixels.shape[0] != sizes.sum():
            raise ValueError(
                f"{kind}: {key} of shape {tuple(np.shape(row[key]))} is {pixels.shape[0]} patch "
                f"rows of {self.patch_dim} values, the grids say {sizes.sum()}: was it made by "
                "this model's processor, at this model's patch size?"
            )
        seconds = np.zeros(len(grids))
        if kind == "video" and self.seconds_key in row:
            seconds = np.asarray(row[self.seconds_key], dtype=np.float64).reshape(-1)
        items = []
        for grid, rows, sec in zip(
            grids, np.split(pixels, np.cumsum(sizes)[:-1]), seconds, strict=True
        ):
            items += self._items(grid, rows, int(kind == "video"), float(sec))
        return items

    def _items(self, grid: np.ndarray, rows: np.ndarray, video: int, seconds: float) -> list[Item]:
        meta = {"grid_thw": grid.tolist(), "video": video, "seconds": seconds}
        return [Item(rows, meta, int(grid.prod()) // self.merge**2)]

    def dummy(self, phase: str) -> Item:
        grid = np.array([1, self.merge, self.merge])
        return self._items(grid, np.zeros((self.merge**2, self.patch_dim), np.float32), 0, 0.0)[0]

    def encode(
        self,
        model: nn.Module,
        phase: str,
        rows: torch.Tensor,
        lengths: torch.Tensor,
        meta: Mapping[str, torch.Tensor],
    ) -> orchmllm.Encoded:
        grid = meta["grid_thw"]
        out = hf_compat.features(model, "get_image_features", rows, grid)
        rope = [
            self.rope(model, g, int(v), s)
            for g, v, s in zip(grid, meta["video"][:, 0], meta["seconds"][:, 0], strict=True)
        ]
        values = {"rope": torch.cat(rope)}
        values.update(self.extra_values(out))
        return orchmllm.Encoded(out.tokens(), values)

    def extra_values(self, out: hf_compat.Features) -> dict[str, torch.Tensor]:
        """Per-token values besides positions (Qwen3-VL: DeepStack features)."""
        return {}

    def rope(
        self, model: nn.Module, grid: torch.Tensor, video: int, seconds: torch.Tensor
    ) -> torch.Tensor:
        """One item's rope rows, from the model's own ``get_rope_index`` on the item alone
        (after its vision-start token, before one text token, whose position is where the
        positions move on to): the rule differs between releases (how far the positions move
        on after an item, how a video's seconds round), so it is not restated here."""
        n = int(grid.prod()) // self.merge**2
        kind = "video" if video else "image"
        ids = [self.config.vision_start_token_id, *[self.tokens[kind]] * n, 0]
        types = [0, *[1 + video] * n, 0]
        grids = {"image_grid_thw": None, "video_grid_thw": None, f"{kind}_grid_thw": grid[None]}
        if video and self.seconds_key == "second_per_grid_ts":
            # float32, as the processor's tensor is, so positions round as the model's do
            grids["second_per_grid_ts"] = seconds.to(torch.float32).reshape(1)
        device = grid.device
        pos = (
            hf_compat.rope_index(
                model,
                torch.tensor([ids], device=device),
                torch.tensor([types], device=device),
                **grids,
            )[:, 0]
            - 1
        )  # [3, n + 2], from the item's first token
        return item_rope(pos[:, 1:-1], int(pos[0, -1]))

    def position_ids(self, batch: orchmllm.LLMBatch) -> torch.Tensor:
        return packed_mrope_positions(batch, batch.token_values("rope", TEXT_ROPE, home=True))


class Qwen2_5VLAdapter(Qwen2VLAdapter):
    """``Qwen2_5_VLForConditionalGeneration``: as Qwen2-VL; a video's temporal positions step
    by ``tokens_per_second * second_per_grid_ts``."""

    seconds_key = "second_per_grid_ts"


class Qwen3VLAdapter(Qwen2VLAdapter):
    """``Qwen3VLForConditionalGeneration``: a video's frames are items of their own (timestamp
    text separates them); DeepStack features travel with the vision tokens."""

    def _items(self, grid: np.ndarray, rows: np.ndarray, video: int, seconds: float) -> list[Item]:
        t, h, w = (int(x) for x in grid)
        frames = np.split(rows, t) if video else [rows]
        frame = np.array([1, h, w]) if video else grid
        base = super()._items
        return [item for f in frames for item in base(frame, f, video, seconds)]

    def extra_values(self, out: hf_compat.Features) -> dict[str, torch.Tensor]:
        return {"deepstack": torch.stack(out.deepstack_features, 1)}  # [tokens, layers, hidden]

    def language_kwargs(self, batch: orchmllm.LLMBatch) -> dict[str, Any]:
        if "vision" in batch.absent:  # no image anywhere: no DeepStack, as the plain forward
            return {}
        vision = batch.mask("vision")
        deepstack = batch.token_values("deepstack", 0.0)[vision]
        layers = list(deepstack.unbind(1))
        return {"visual_pos_masks": vision[None], "deepstack_visual_embeds": layers}


class Qwen2_5OmniThinkerAdapter(Qwen2VLAdapter):
    """``Qwen2_5OmniThinkerForConditionalGeneration``: a vision phase and an audio phase."""

    fields = {"vision": VISION_FIELDS}
    policies = {"audio": "greedy"}  # the audio tower packs clips (windowed attention)
    seconds_key = "video_second_per_grid"
    mm_token_types = False  # its positions come from the placeholders themselves

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.tokens["audio"] = self.config.audio_token_id
        self.n_mels = self.config.audio_config.num_mel_bins

    def sources(self) -> tuple[Source, ...]:
        return (*super().sources(), Source("audio", self.tokens["audio"], "audio"))

    def feature_dims(self) -> dict[str, int]:
        return {**super().feature_dims(), "audio": self.n_mels}

    def split(self, kind: str, row: Mapping[str, Any]) -> list[Item]:
        if kind != "audio":
            return super().split(kind, row)
        if "input_features" not in row:
            return []
        features = np.asarray(row["input_features"]).reshape(
            -1, self.n_mels, np.shape(row["input_features"])[-1]
        )
        mask = np.asarray(row["feature_attention_mask"]).reshape(len(features), -1)
        return [self._clip(f[:, : int(m.sum())].T) for f, m in zip(features, mask, strict=True)]

    @staticmethod
    def _clip(frames: np.ndarray) -> Item:
        n = frames.shape[0]
        return Item(frames, {}, ((n - 1) // 2 + 1 - 2) // 2 + 1)  # the audio tower's rule

    def dummy(self, phase: str) -> Item:
        if phase == "audio":
            return self._clip(np.zeros((4, self.n_mels), np.float32))
        return super().dummy(phase)

    def encode(
        self,
        model: nn.Module,
        phase: str,
        rows: torch.Tensor,
        lengths: torch.Tensor,
        meta: Mapping[str, torch.Tensor],
    ) -> orchmllm.Encoded:
        if phase != "audio":
            return super().encode(model, phase, rows, lengths, meta)
        width = int(lengths.max())
        mask = torch.arange(width, device=rows.device) < lengths[:, None]
        features = rows.new_zeros(len(lengths), width, self.n_mels)
        features[mask] = rows
        out = hf_compat.features(
            model,
            "get_audio_features",
            features.transpose(1, 2),
            feature_attention_mask=mask.long(),
        )
        tower = hf_compat.part(model, "audio_tower")
        _, tokens = tower._get_feat_extract_output_lengths(lengths)
        rope = [
            item_rope(torch.arange(n, device=rows.device).expand(3, -1), n) for n in tokens.tolist()
        ]
        return orchmllm.Encoded(out.last_hidden_state, {"rope": torch.cat(rope)})

    def rope(
        self, model: nn.Module, grid: torch.Tensor, video: int, seconds: torch.Tensor
    ) -> torch.Tensor:
        """Omni's rule: temporal positions at ``position_id_per_seconds`` per second, and the
        next position after an item's largest."""
        per_grid = seconds.float().cpu() if video else 1
        t_index = (torch.arange(grid[0]) * per_grid * self.config.position_id_per_seconds).long()
        offsets = hf_compat.part(model, "get_llm_pos_ids_for_vision")(
            0, 0, self.merge, t_index, grid[1:2], grid[2:3]
        ).to(grid.device)
        return item_rope(offsets, int(offsets.max()) + 1)


for _cls, _adapter in (
    ("Qwen2VLForConditionalGeneration", Qwen2VLAdapter),
    ("Qwen2_5_VLForConditionalGeneration", Qwen2_5VLAdapter),
    ("Qwen3VLForConditionalGeneration", Qwen3VLAdapter),
    ("Qwen2_5OmniThinkerForConditionalGeneration", Qwen2_5OmniThinkerAdapter),
):
    register_adapter(_cls, _adapter)
