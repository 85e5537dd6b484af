"""The lengths of one global batch: everything the planner and the step model need.

Rank ``r`` samples examples ``r*b .. r*b+b-1`` (gather order). An example holds text tokens and
any number of images (raw patches) and audio clips (raw mel frames), each owned by one example.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from orchmllm.config import ModelConfig


def _ints(name: str, values: object) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"{name} must be a 1-D integer array, got {arr.dtype} {arr.shape}")
    arr = arr.astype(np.int64)
    if arr.size and arr.min() < 0:
        raise ValueError(f"{name} must be non-negative, got {int(arr.min())}")
    return arr


@dataclass(frozen=True)
class Batch:
    """One step's global batch as lengths, ``examples_per_rank`` examples on every rank."""

    num_ranks: int
    text: np.ndarray  # int64[n]: text tokens per example
    image_example: np.ndarray  # int64[n_img]: owning example of each image
    image_patches: np.ndarray  # int64[n_img]: raw patches (vision encoder tokens)
    audio_example: np.ndarray  # int64[n_aud]
    audio_frames: np.ndarray  # int64[n_aud]: raw mel frames

    def __post_init__(self) -> None:
        if self.num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {self.num_ranks!r}")
        for name in ("text", "image_example", "image_patches", "audio_example", "audio_frames"):
            object.__setattr__(self, name, _ints(name, getattr(self, name)))
        n = self.text.size
        if n % self.num_ranks:
            raise ValueError(f"text: {n} examples do not split evenly over {self.num_ranks} ranks")
        for owner, size in (
            (self.image_example, self.image_patches),
            (self.audio_example, self.audio_frames),
        ):
            if owner.shape != size.shape:
                raise ValueError(
                    f"an item list and its owners differ: {owner.shape} vs {size.shape}"
                )
            if owner.size and owner.max() >= n:
                raise ValueError(f"item owners must index examples < {n}, got {owner.max()}")

    @property
    def examples_per_rank(self) -> int:
        return self.text.size // self.num_ranks

    @property
    def example_src(self) -> np.ndarray:
        """Rank each example was sampled on."""
        return np.arange(self.text.size, dtype=np.int64) // self.examples_per_rank

    def vision_lengths(self) -> np.ndarray:
        """Vision encoder sequence length per image (one token per patch)."""
        return self.image_patches

    def audio_lengths(self, config: ModelConfig) -> np.ndarray:
        """Audio encoder sequence length per clip (after the stride-``conv_stride`` convs)."""
        return self.audio_frames // config.audio.conv_stride

    def llm_lengths(self, config: ModelConfig) -> np.ndarray:
        """Whole interleaved sequence per example: text plus encoded image and audio tokens."""
        n = self.text.size
        img = np.bincount(
            self.image_example,
            weights=self.image_patches // config.vision.downsample,
            minlength=n,
        )
        aud = np.bincount(
            self.audio_example,
            weights=self.audio_frames // config.audio.frames_per_token,
            minlength=n,
        )
        return self.text + img.astype(np.int64) + aud.astype(np.int64)

    def take(self, examples_per_rank: int) -> Batch:
        """The first ``examples_per_rank`` examples of every rank (nested mini-batches).

        Growing the mini-batch only adds examples, so the memory a rank needs grows with it and
        a search over mini-batch sizes sees one sample, not a fresh draw per size.
        """
        b = self.examples_per_rank
        if not 1 <= examples_per_rank <= b:
            raise ValueError(f"examples_per_rank must be in [1, {b}], got {examples_per_rank!r}")
        idx = np.arange(self.text.size, dtype=np.int64)
        keep = idx % b < examples_per_rank
        new_id = np.cumsum(keep) - 1

        def items(owner: np.ndarray, size: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            k = keep[owner]
            return new_id[owner[k]], size[k]

        img_ex, img = items(self.image_example, self.image_patches)
        aud_ex, aud = items(self.audio_example, self.audio_frames)
        return Batch(self.num_ranks, self.text[keep], img_ex, img, aud_ex, aud)

    @classmethod
    def uniform(
        cls, num_ranks: int, examples_per_rank: int, *, text: int, patches: int, frames: int
    ) -> Batch:
        """Every example identical: one image and one clip each (a no-imbalance control)."""
        n = num_ranks * examples_per_rank
        idx = np.arange(n, dtype=np.int64)
        return cls(
            num_ranks,
            text=np.full(n, text),
            image_example=idx if patches else idx[:0],
            image_patches=np.full(n, patches) if patches else idx[:0],
            audio_example=idx if frames else idx[:0],
            audio_frames=np.full(n, frames) if frames else idx[:0],
        )
