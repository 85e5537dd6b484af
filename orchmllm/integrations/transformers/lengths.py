"""Token counts from a dataset row's metadata, by the processor's own rules, without decoding.

The balanced loader plans on every example's length before it loads anything
(``BalancedDataLoader(..., length_column=...)``), but a processor decides an image's or a
clip's token count only once it has decoded and resized the pixels or samples. The count
follows from metadata alone: an image's size (its file's header: ``PIL.Image.open`` reads no
pixels), a video's frame count and size, a clip's sample count (a WAV header) and the
processor's settings. This module computes it with each processor family's rules:

- :class:`QwenVision`: Qwen2-VL, Qwen2.5-VL and the Qwen2.5-Omni thinker's dynamic
  resolution: the image is resized to multiples of ``patch_size * merge_size`` within a pixel
  budget (``smart_resize``), cut into patches, and ``merge_size ** 2`` patches make a token; a
  video's frames are padded to a multiple of ``temporal_patch_size`` (or sampled at ``fps``).
- :class:`FixedGrid`: LLaVA's CLIP processor: every image becomes the crop size (or, without
  the centre crop, the shortest edge), a fixed grid of patches.
- :class:`AnyResGrid`: LLaVA-OneVision's anyres images: a base tile and the tiles of the
  grid resolution the image fits best, the grid's features unpadded and pooled, with newlines.
- :class:`CroppedTiles`: InternVL's images: the crops of the tile grid closest to the image's
  aspect ratio and a thumbnail, a fixed number of tokens each, between ``<img>`` and
  ``</img>``.
- :class:`WhisperAudio`: Whisper's feature extractor (10 ms mel frames, clips cut or padded to
  30 s), its stride-2 convolution and the LLM side's pooling (Qwen2-Audio, Qwen2.5-Omni).

:class:`MetadataLengths` applies a family's rules (:data:`FAMILIES`, built from a processor by
:func:`lengths_for`) to a whole row and is a ``datasets.map`` function::

    lengths = omt.lengths.lengths_for(processor, family="qwen2.5-omni")
    dataset = dataset.map(lengths, num_proc=4)          # adds num_tokens, vision_tokens, ...
    loader = orchmllm.BalancedDataLoader(dataset, length_column="num_tokens", ...)

Each item's tokens count towards its encoder phase, a row of ``orchmllm.schema.MODALITIES``
(images and videos: ``vision``; clips: ``audio``); its ``rows`` are what that encoder
computes on (patches, tiles, mel frames), as the adapters' items.
"""

from __future__ import annotations

import io
import math
import wave
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from orchmllm.schema import MODALITIES, TEXT

#: Each kind of item's encoder phase (a name in ``orchmllm.schema.MODALITIES``): images and videos
#: share the vision tower.
PHASE_OF = {"image": "vision", "video": "vision", "audio": "audio"}
assert set(PHASE_OF.values()) <= set(MODALITIES), "PHASE_OF names a phase the table lacks"

#: EXIF orientations that rotate by 90 degrees: ``load_image`` transposes them, so the
#: processor sees the header's width and height swapped.
_EXIF_ORIENTATION, _TRANSPOSED = 0x0112, (5, 6, 7, 8)


@dataclass(frozen=True)
class ItemLength:
    """What one item (an image, a video, a clip) costs.

    Attributes:
        phase: its encoder phase (a name in ``orchmllm.schema.MODALITIES``).
        rows: the raw rows its encoder computes on (patches, tiles, mel frames).
        tokens: the placeholder tokens it becomes in the LLM's sequence.
        text_before, text_after: text tokens the processor writes around those placeholders
            (InternVL's ``<img>`` and ``</img>``).
    """

    phase: str
    rows: int
    tokens: int
    text_before: int = 0
    text_after: int = 0


def _positive(name: str, value: object) -> int | float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return value


# -- the families' rules ----------------------------------------------------------------------


def _fit(height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int) -> tuple:
    """Qwen's resize target: each side a multiple of ``factor`` (rounded to the nearest), the
    area scaled into ``[min_pixels, max_pixels]`` keeping the aspect ratio (rounding down
    when shrinking, up when growing)."""
    if max(height, width) > 200 * min(height, width):
        raise ValueError(f"an image's aspect ratio must be below 200, got {width}x{height}")
    h, w = (factor * round(s / factor) for s in (height, width))
    if h * w > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        h, w = (max(factor, factor * math.floor(s / scale / factor)) for s in (height, width))
    elif h * w < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        h, w = (factor * math.ceil(s * scale / factor) for s in (height, width))
    return h, w


@dataclass(frozen=True, kw_only=True)
class QwenVision:
    """Qwen2-VL's dynamic resolution (also Qwen2.5-VL's, the Qwen2.5-Omni thinker's and
    Qwen3-VL's images, on its 16-pixel patches).

    Attributes:
        patch_size, merge_size, temporal_patch_size: the vision tower's patch geometry.
        min_pixels, max_pixels: the image processor's pixel budget (``size``).
        video_min_pixels, video_max_pixels: the video processor's.
        fps: the frames per second the video processor samples (``do_sample_frames``), or
            None: every frame is kept.
        min_frames, max_frames: the sampled frame count's bounds.
    """

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    video_min_pixels: int = 128 * 28 * 28
    video_max_pixels: int = 28 * 28 * 768
    fps: float | None = None
    min_frames: int = 4
    max_frames: int = 768

    @classmethod
    def from_processor(cls, processor: Any, *, video_processor: Any = None) -> QwenVision:
        """The rules of a Qwen processor (its ``image_processor`` and ``video_processor``), or
        of an image processor and, optionally, ``video_processor``."""
        image = getattr(processor, "image_processor", processor)
        video = video_processor or getattr(processor, "video_processor", None)
        out = {
            "patch_size": image.patch_size,
            "merge_size": image.merge_size,
            "temporal_patch_size": image.temporal_patch_size,
            "min_pixels": image.size["shortest_edge"],
            "max_pixels": image.size["longest_edge"],
        }
        if video is not None:
            out["video_min_pixels"] = video.size["shortest_edge"]
            out["video_max_pixels"] = video.size["longest_edge"]
            if getattr(video, "do_sample_frames", False):
                out.update(fps=video.fps, min_frames=video.min_frames, max_frames=video.max_frames)
        return cls(**out)

    def _grid(self, height: int, width: int, *, lo: int, hi: int) -> int:
        h, w = _fit(
            height, width, factor=self.patch_size * self.merge_size, min_pixels=lo, max_pixels=hi
        )
        return (h // self.patch_size) * (w // self.patch_size)

    def image(self, width: int, height: int) -> ItemLength:
        """An image of ``width`` x ``height`` pixels: its patches and tokens."""
        patches = self._grid(
            _positive("height", height),
            _positive("width", width),
            lo=self.min_pixels,
            hi=self.max_pixels,
        )
        return ItemLength(PHASE_OF["image"], patches, patches // self.merge_size**2)

    def frames(self, num_frames: int, fps: float | None = None) -> int:
        """The frames the video processor keeps of ``num_frames`` (sampled at :attr:`fps` when
        set, which needs the video's own ``fps``), padded to a multiple of
        ``temporal_patch_size``."""
        t = self.temporal_patch_size
        n = _positive("num_frames", num_frames)
        if self.fps is not None:
            if fps is None:
                raise ValueError("sampling at fps needs the video's fps, got fps=None")
            cap = min(self.max_frames, n) // t * t
            n = math.floor(min(max(n / _positive("fps", fps) * self.fps, self.min_frames), cap, n))
            n = n // t * t
            if n < 1:
                raise ValueError(f"a video of {num_frames} frames samples none at fps {self.fps}")
        return n + -n % t

    def video(
        self, num_frames: int, width: int, height: int, *, fps: float | None = None
    ) -> ItemLength:
        """A video of ``num_frames`` frames of ``width`` x ``height`` (``fps``: its frame rate,
        needed only when the processor samples frames)."""
        spatial = self._grid(
            _positive("height", height),
            _positive("width", width),
            lo=self.video_min_pixels,
            hi=self.video_max_pixels,
        )
        patches = self.frames(num_frames, fps) // self.temporal_patch_size * spatial
        return ItemLength(PHASE_OF["video"], patches, patches // self.merge_size**2)


@dataclass(frozen=True, kw_only=True)
class FixedGrid:
    """LLaVA's CLIP image processor and ``LlavaProcessor``: one tile per image, a fixed grid.

    Attributes:
        crop: the centre crop ``(height, width)``, or None (no crop: the image is resized so
            that its shortest edge is :attr:`shortest_edge`).
        shortest_edge: the resize target without a crop.
        patch_size: the tower's patch size.
        extra_tokens: tokens beyond the patches (``num_additional_image_tokens``, less the CLS
            token that the ``default`` feature strategy drops).
    """

    crop: tuple[int, int] | None = (224, 224)
    shortest_edge: int = 224
    patch_size: int = 14
    extra_tokens: int = 0

    @classmethod
    def from_processor(cls, processor: Any) -> FixedGrid:
        """The rules of a ``LlavaProcessor``."""
        image = processor.image_processor
        crop = image.crop_size if image.do_center_crop else None
        extra = processor.num_additional_image_tokens
        extra -= int(processor.vision_feature_select_strategy == "default")
        return cls(
            crop=None if crop is None else (crop["height"], crop["width"]),
            shortest_edge=image.size["shortest_edge"],
            patch_size=processor.patch_size,
            extra_tokens=extra,
        )

    def image(self, width: int, height: int) -> ItemLength:
        """An image of ``width`` x ``height`` pixels: one tile and its tokens."""
        _positive("height", height), _positive("width", width)
        if self.crop is not None:
            h, w = self.crop
        else:  # the short side becomes shortest_edge, the long one scales (truncated)
            short, long = sorted((height, width))
            size = (self.shortest_edge, int(self.shortest_edge * long / short))
            h, w = size if height <= width else size[::-1]
        tokens = (h // self.patch_size) * (w // self.patch_size) + self.extra_tokens
        return ItemLength(PHASE_OF["image"], 1, tokens)


def _best_resolution(height: int, width: int, pinpoints: Sequence[Sequence[int]]) -> tuple:
    """The anyres grid ``(height, width)`` an image is resized into: the pinpoint that keeps the
    most of its pixels once it is scaled to fit (never counting more than it has), then the
    one that wastes the least area; the first such in the list. Float scaling and truncation,
    as the processor computes it, so that the choice is the same at every tie."""
    best, key = None, None
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        if key is None or (kept, -(h * w - kept)) > key:
            best, key = (h, w), (kept, -(h * w - kept))
    return best


@dataclass(frozen=True, kw_only=True)
class AnyResGrid:
    """LLaVA-OneVision's anyres images (``LlavaOnevisionProcessor``): a row's only image is a
    base tile (the whole image resized to one tile) and the tiles of the pinpoint grid it is
    resized and padded into; an image among several in a row is padded to one square tile.
    (A row is one text and its images, passed as ``text=[text], images=[images]``; given a
    flat list of images, the processor tiles each as if it were alone.)

    Tokens: the base tile's features, plus the grid's features with the padding rows or columns
    cut off (the grid is ``side`` features a tile; the image's aspect ratio decides how many it
    covers), pooled down to about ``max_tiles`` tiles' worth when it exceeds that by 10%, and
    one newline per remaining feature row. An image among several: its tile's features and one
    newline. Images only: a video's frames come from the video processor (which needs
    torchvision), whose count this module does not model.

    Attributes:
        pinpoints: the grid resolutions ``(height, width)`` (``image_grid_pinpoints``).
        tile: a tile's side in pixels (the image processor's ``size``).
        features: one tile's features (``num_image_tokens``; ``side ** 2``).
        max_tiles: the ``N`` of ``vision_aspect_ratio="anyres_max_N"``.
        drop_cls: the ``default`` feature strategy drops one feature per image.
    """

    pinpoints: tuple[tuple[int, int], ...]
    tile: int = 384
    features: int = 729
    max_tiles: int = 9
    drop_cls: bool = False

    @classmethod
    def from_processor(cls, processor: Any) -> AnyResGrid:
        """The rules of a ``LlavaOnevisionProcessor``.

        Raises:
            ValueError: its ``num_image_tokens`` is unset, its ``vision_aspect_ratio`` is not
                ``anyres_max_N``, or its image processor's ``size`` is not a square.
        """
        image = processor.image_processor
        if not processor.num_image_tokens:
            raise ValueError(
                f"processor.num_image_tokens must be set, got {processor.num_image_tokens!r}"
            )
        aspect = processor.vision_aspect_ratio
        if not (aspect.startswith("anyres_max_") and aspect[11:].isdigit()):
            raise ValueError(f"vision_aspect_ratio must be 'anyres_max_N', got {aspect!r}")
        size = image.size
        if "height" not in size or size["height"] != size["width"]:
            raise ValueError(f"the image processor's size must be a square, got {size!r}")
        return cls(
            pinpoints=tuple((int(h), int(w)) for h, w in image.image_grid_pinpoints),
            tile=size["height"],
            features=processor.num_image_tokens,
            max_tiles=int(aspect[11:]),
            drop_cls=processor.vision_feature_select_strategy == "default",
        )

    def image(self, width: int, height: int, *, alone: bool = True) -> ItemLength:
        """An image of ``width`` x ``height`` pixels: its tiles and tokens.

        Args:
            alone: the row's only image (only then is it tiled; else one padded tile).
        """
        _positive("height", height), _positive("width", width)
        if not alone:
            return ItemLength(PHASE_OF["image"], 1, self.features + 1 - self.drop_cls)
        grid_h, grid_w = _best_resolution(height, width, self.pinpoints)
        tiles = 1 + -(-grid_h // self.tile) * -(-grid_w // self.tile)
        side = math.isqrt(self.features)
        rows, cols = side * (grid_h // self.tile), side * (grid_w // self.tile)
        # the grid's features that the resized image covers (exact integer scaling)
        if width * rows > height * cols:  # wider than the grid: padding above and below
            rows -= (rows - height * cols // width) // 2 * 2
        else:
            cols -= (cols - width * rows // height) // 2 * 2
        ratio = math.sqrt(rows * cols / (self.max_tiles * side**2))
        if ratio > 1.1:  # pooled down to about max_tiles tiles
            rows, cols = int(rows // ratio), int(cols // ratio)
        tokens = self.features + rows * cols + rows - self.drop_cls
        return ItemLength(PHASE_OF["image"], tiles, tokens)


@dataclass(frozen=True, kw_only=True)
class CroppedTiles:
    """InternVL's ``GotOcr2ImageProcessor`` and ``InternVLProcessor``: an image is cut into the
    tiles of the grid (within ``min_patches`` to ``max_patches``) closest to its aspect ratio,
    plus a thumbnail when there are several; each tile becomes ``image_seq_length`` tokens,
    written between ``<img>`` and ``</img>``. The tile count is the image processor's own
    ``get_number_of_image_patches`` (it agrees with the processor by construction; the tests
    check the whole row against the processor's output).

    Attributes:
        image_processor: the processor's image processor (its settings are read).
        tokens_per_tile: ``image_seq_length``.
    """

    image_processor: Any
    tokens_per_tile: int = 256

    @classmethod
    def from_processor(cls, processor: Any) -> CroppedTiles:
        """The rules of an ``InternVLProcessor``."""
        return cls(
            image_processor=processor.image_processor,
            tokens_per_tile=processor.image_seq_length,
        )

    def image(self, width: int, height: int) -> ItemLength:
        """An image of ``width`` x ``height`` pixels: its tiles, their tokens, and the
        ``<img>`` and ``</img>`` around them."""
        _positive("height", height), _positive("width", width)
        # images_kwargs: none over the processor's settings (older releases need the dict)
        tiles = self.image_processor.get_number_of_image_patches(height, width, images_kwargs={})
        return ItemLength(PHASE_OF["image"], tiles, tiles * self.tokens_per_tile, 1, 1)


@dataclass(frozen=True, kw_only=True)
class WhisperAudio:
    """Whisper's feature extractor and encoder front end, and the LLM side's pooling.

    A clip is cut to ``chunk_length`` seconds and padded to it; its frames are the unpadded
    ones (``feature_attention_mask``), one per ``hop_length`` samples. The encoder's stride-2
    convolution halves them, and the LLM side pools ``pool`` positions into a token
    (Qwen2-Audio and Qwen2.5-Omni: 2; Whisper's encoder alone: 1).

    Attributes:
        sampling_rate, hop_length, chunk_length: the feature extractor's.
        pool: encoder positions per LLM token.
    """

    sampling_rate: int = 16000
    hop_length: int = 160
    chunk_length: int = 30
    pool: int = 2

    @classmethod
    def from_processor(cls, processor: Any, *, pool: int = 2) -> WhisperAudio:
        """The rules of a processor's ``feature_extractor`` (or a feature extractor)."""
        fe = getattr(processor, "feature_extractor", processor)
        return cls(
            sampling_rate=fe.sampling_rate,
            hop_length=fe.hop_length,
            chunk_length=fe.chunk_length,
            pool=pool,
        )

    @property
    def padded_frames(self) -> int:
        """Every clip's frames after padding (what a padded Whisper encoder computes on)."""
        return self.chunk_length * self.sampling_rate // self.hop_length

    def audio(self, num_samples: int) -> ItemLength:
        """A clip of ``num_samples`` samples at :attr:`sampling_rate`."""
        samples = min(_positive("num_samples", num_samples), self.chunk_length * self.sampling_rate)
        frames = -(-samples // self.hop_length)
        positions = (frames - 1) // 2 + 1  # the stride-2 convolution
        tokens = positions if self.pool == 1 else (positions - self.pool) // self.pool + 1
        return ItemLength(PHASE_OF["audio"], frames, tokens)


# -- metadata of a row's items ----------------------------------------------------------------


def image_size(value: Any) -> tuple[int, int]:
    """``(width, height)`` of an image as a row stores it, reading at most its file header.

    Args:
        value: a path, an HF ``Image`` feature's undecoded dict (``{"bytes", "path"}``: cast
            the column with ``datasets.Image(decode=False)``, or ``map`` decodes every image),
            a ``{"width", "height"}`` dict, a ``(width, height)`` pair or a ``PIL.Image``.

    Raises:
        ValueError: anything else.
    """
    if isinstance(value, Mapping) and "width" in value:
        return int(value["width"]), int(value["height"])
    if isinstance(value, Sequence) and not isinstance(value, str | bytes) and len(value) == 2:
        return int(value[0]), int(value[1])
    if hasattr(value, "size") and hasattr(value, "getexif"):  # a PIL image
        return _oriented(value)
    if isinstance(value, Mapping) and (value.get("bytes") or value.get("path")):
        value = io.BytesIO(value["bytes"]) if value.get("bytes") else value["path"]
    if isinstance(value, str | io.IOBase) or hasattr(value, "__fspath__"):
        from PIL import Image  # Pillow comes with transformers' vision extra

        with Image.open(value) as im:  # lazy: the header only
            return _oriented(im)
    raise ValueError(f"an image must be a path, bytes dict, size or PIL image, got {value!r}")


def _oriented(im: Any) -> tuple[int, int]:
    w, h = im.size
    return (h, w) if im.getexif().get(_EXIF_ORIENTATION) in _TRANSPOSED else (w, h)


def audio_samples(value: Any, *, sampling_rate: int) -> int:
    """A clip's samples at ``sampling_rate``, from what a row stores.

    Args:
        value: a WAV file's path (its header is read), ``{"num_samples": n}`` (already at
            ``sampling_rate``), ``{"duration": seconds}``, or ``{"num_samples", "sampling_rate"}``
            at another rate (resampled length: ``ceil(n * sampling_rate / rate)``, as librosa
            and soxr give).

    Raises:
        ValueError: anything else.
    """
    if isinstance(value, str) or hasattr(value, "__fspath__"):
        with wave.open(str(value), "rb") as w:
            value = {"num_samples": w.getnframes(), "sampling_rate": w.getframerate()}
    if isinstance(value, Mapping):
        if "duration" in value:
            return round(float(value["duration"]) * sampling_rate)
        if "num_samples" in value:
            n, rate = int(value["num_samples"]), int(value.get("sampling_rate", sampling_rate))
            return n if rate == sampling_rate else -(-n * sampling_rate // rate)
    raise ValueError(f"a clip must be a WAV path or a num_samples/duration dict, got {value!r}")


# -- families and rows ------------------------------------------------------------------------


@dataclass(frozen=True)
class Rules:
    """One processor family's rules: how each kind of item (``image``, ``video``, ``audio``)
    becomes an :class:`ItemLength` from its metadata, and the placeholder text that stands
    for it before the processor expands it.

    ``several`` holds a kind's rule for the items of a row with more than one of that kind,
    where the processor treats them differently (LLaVA-OneVision tiles a row's only image);
    a kind it lacks takes its ``items`` rule whatever the count."""

    items: Mapping[str, Callable[[Any], ItemLength]]
    placeholders: Mapping[str, str]
    several: Mapping[str, Callable[[Any], ItemLength]] = field(default_factory=dict)


def _qwen(processor: Any, *, audio: bool = False, video: bool = True) -> Rules:
    vision = QwenVision.from_processor(processor)
    items = {
        "image": lambda v: vision.image(*image_size(v)),
        "video": lambda v: vision.video(v["num_frames"], v["width"], v["height"], fps=v.get("fps")),
    }
    if not video:  # Qwen3-VL writes a timestamp before each merged pair of a video's frames
        items["video"] = _not_modelled("video", "a timestamp precedes each pair of frames")
    names = {"image": "image_token", "video": "video_token"}
    if audio:
        clips = WhisperAudio.from_processor(processor)
        items["audio"] = lambda v: clips.audio(audio_samples(v, sampling_rate=clips.sampling_rate))
        names["audio"] = "audio_token"
    return Rules(items, {k: getattr(processor, n) for k, n in names.items()})


def _not_modelled(kind: str, why: str) -> Callable[[Any], ItemLength]:
    """A rule for a kind of item this module does not count: it raises, naming why, rather
    than let the item's placeholder pass for text."""

    def refuse(value: Any) -> ItemLength:
        raise ValueError(f"this family's {kind} token count is not modelled ({why}): got {value!r}")

    return refuse


def _llava(processor: Any) -> Rules:
    grid = FixedGrid.from_processor(processor)
    return Rules({"image": lambda v: grid.image(*image_size(v))}, {"image": processor.image_token})


def _onevision(processor: Any) -> Rules:
    grid = AnyResGrid.from_processor(processor)
    return Rules(
        {"image": lambda v: grid.image(*image_size(v))},
        {"image": processor.image_token},
        several={"image": lambda v: grid.image(*image_size(v), alone=False)},
    )


def _internvl(processor: Any) -> Rules:
    tiles = CroppedTiles.from_processor(processor)
    return Rules(
        {
            "image": lambda v: tiles.image(*image_size(v)),
            "video": _not_modelled("video", "each frame is written as 'FrameN: <img>...</img>'"),
        },
        {"image": processor.image_token, "video": processor.video_token},
    )


def _whisper_llm(processor: Any) -> Rules:
    clips = WhisperAudio.from_processor(processor)
    fn = lambda v: clips.audio(audio_samples(v, sampling_rate=clips.sampling_rate))  # noqa: E731
    return Rules({"audio": fn}, {"audio": processor.audio_token})


FAMILIES: dict[str, Callable[[Any], Rules]] = {
    "qwen2-vl": _qwen,
    "qwen2.5-vl": _qwen,
    "qwen3-vl": lambda p: _qwen(p, video=False),  # images; its videos raise
    "qwen2.5-omni": lambda p: _qwen(p, audio=True),
    "llava": _llava,
    "llava-onevision": _onevision,
    "internvl": _internvl,  # images; its videos raise
    "qwen2-audio": _whisper_llm,
}
"""Processor family -> its :class:`Rules` from a processor (each family's rules read the
processor's own settings). Add a family with an entry here."""


# Where a row keeps its text and each kind's items, unless told otherwise.
TEXT_COLUMN = "text"
ITEM_COLUMNS = {"image": "images", "video": "videos", "audio": "audios"}


@dataclass(frozen=True)
class MetadataLengths:
    """A row's token counts from its metadata: a ``datasets.map`` function.

    The row holds its text with one placeholder per item (the processor's ``image_token``,
    ...; as passed to the processor, before expansion) and each kind's items in a column
    (see :func:`image_size`, :func:`audio_samples`; a video is ``{"num_frames", "width",
    "height"}`` and its ``fps`` when the processor samples frames), processed as one sample
    (``text=[text], images=[images]``).

    Calling it returns ``num_tokens`` (the processed ``input_ids`` length), ``text_tokens``,
    ``<kind>_tokens`` per kind of item the family takes (``image``, ``video``, ``audio``), per
    encoder phase (a name of ``orchmllm.schema.MODALITIES``: ``vision``, ``audio``)
    ``<phase>_tokens`` and ``<phase>_rows`` (patches, tiles or frames its encoder computes),
    and ``segments``: the row in ``orchmllm.schema``'s form (text runs, and each item as
    ``[kind, rows, tokens]``), as the family's adapter makes it of the processed row.

    Args:
        rules: the family's :class:`Rules` (see :func:`lengths_for`).
        tokenizer: the processor's tokenizer (its placeholders are single tokens).
        text_column: the row's text.
        columns: item kind -> the column holding that kind's items (a list per row; a
            missing or None column holds none).

    Raises (when called):
        ValueError: a row whose placeholders do not match its items in number.
    """

    rules: Rules
    tokenizer: Any
    text_column: str = TEXT_COLUMN
    columns: Mapping[str, str] = field(default_factory=lambda: dict(ITEM_COLUMNS))

    def values(self, row: Mapping[str, Any], kind: str) -> list:
        """The row's items of ``kind`` (its column's list; a missing or None column: none)."""
        values = row.get(self.columns.get(kind, kind)) or []
        return [values] if isinstance(values, str | Mapping) else list(values)

    def __call__(self, row: Mapping[str, Any]) -> dict[str, Any]:
        ids = self.tokenizer(row[self.text_column])["input_ids"]  # as the processor calls it
        found: list[tuple[int, str, ItemLength]] = []  # (placeholder position, kind, item)
        for kind, fn in self.rules.items.items():
            values = self.values(row, kind)
            mark = self.rules.placeholders[kind]
            token = self.tokenizer.convert_tokens_to_ids(mark)
            at = [i for i, t in enumerate(ids) if t == token]
            if len(at) != len(values):
                raise ValueError(
                    f"the text has {len(at)} {kind} placeholders ({mark!r}), column "
                    f"{self.columns.get(kind, kind)!r} {len(values)} items"
                )
            fn = self.rules.several.get(kind, fn) if len(values) > 1 else fn
            found += [(i, kind, fn(v)) for i, v in zip(at, values, strict=True)]
        around = sum(it.text_before + it.text_after for _, _, it in found)
        out = {"text_tokens": len(ids) - len(found) + around}
        for kind in self.rules.items:
            out[f"{kind}_tokens"] = sum(it.tokens for _, k, it in found if k == kind)
        for phase in dict.fromkeys(PHASE_OF[kind] for kind in self.rules.items):
            items = [it for _, _, it in found if it.phase == phase]
            out[f"{phase}_tokens"] = sum(it.tokens for it in items)
            out[f"{phase}_rows"] = sum(it.rows for it in items)
        out["num_tokens"] = out["text_tokens"] + sum(it.tokens for _, _, it in found)
        out["segments"] = _segments(found, len(ids))
        return out


def _segments(found: list[tuple[int, str, ItemLength]], length: int) -> list[list[int]]:
    """The row's ``segments`` (``orchmllm.schema``): text runs between the items (with the
    text the processor writes around each), each item ``[kind, rows, tokens]``, in the order
    of their placeholders."""
    out, pos, carried = [], 0, 0  # carried: the last item's text_after
    for at, _, item in sorted(found, key=lambda f: f[0]):
        run = carried + at - pos + item.text_before
        if run:
            out.append([TEXT, run])
        out.append([MODALITIES[item.phase].kind, item.rows, item.tokens])
        pos, carried = at + 1, item.text_after
    if carried + length - pos:
        out.append([TEXT, carried + length - pos])
    return out


def lengths_for(
    processor: Any,
    *,
    family: str,
    text_column: str = TEXT_COLUMN,
    columns: Mapping[str, str] = ITEM_COLUMNS,
) -> MetadataLengths:
    """The ``datasets.map`` function counting a row's tokens as ``processor`` would.

    Args:
        processor: the family's HF processor (its tokenizer and item processors' settings
            are read; nothing is run).
        family: a key of :data:`FAMILIES`.
        text_column: the row's text.
        columns: item kind -> the column holding that kind's items.

    Raises:
        ValueError: an unknown ``family``, or a processor of another family (naming the
            families it is one of).
    """
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {family!r}")
    try:
        rules = FAMILIES[family](processor)
        tokenizer = processor.tokenizer
    except AttributeError as exc:  # the family's rules read a setting this processor lacks
        fits = [f for f in FAMILIES if f != family and _reads(f, processor)]
        raise ValueError(
            f"lengths_for(family={family!r}) reads that family's processor settings, and "
            f"{type(processor).__name__} has not all of them ({exc}); "
            + (f"it is a processor of family {fits}" if fits else "no family reads it")
            + ": pass the model's own processor (AutoProcessor.from_pretrained) and its family"
        ) from None
    return MetadataLengths(rules, tokenizer, text_column, dict(columns))


def _reads(family: str, processor: Any) -> bool:
    """Whether ``family``'s rules build from ``processor`` (every setting they read is there
    and valid)."""
    try:
        FAMILIES[family](processor)
    except (AttributeError, KeyError, TypeError, ValueError):
        return False
    return hasattr(processor, "tokenizer")
