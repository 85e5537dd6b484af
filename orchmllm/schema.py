"""The multimodal example schema shared by the data, the orchestrator and the models.

One example is one HF ``datasets`` row (and the dict a loader yields per example):

- ``id`` int64; ``task`` str in :data:`TASKS`
- ``segments``: ``[kind, count]`` pairs in interleaving order; kind :data:`TEXT` (count = text
  tokens), :data:`IMAGE` (count = raw patches), :data:`AUDIO` (count = raw mel frames)
- ``input_ids``: every text segment's tokens concatenated in order; ``loss_mask``: 1 per text
  token that is a prediction target
- ``image_patches``: float32 ``[n_patches, patch_dim]`` per image, in order
- ``audio_mels``: float32 ``[n_frames, n_mels]`` per audio clip, in order

Only ``segments`` is needed to plan (lengths before and after the encoders, LLM sequence
length), so the metadata functions here take segments, never tensors: a loader can compute them
for a whole dataset cheaply, and the orchestrator gathers nothing larger.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

TEXT, IMAGE, AUDIO = 0, 1, 2
TASKS = ("caption", "vqa", "asr", "spoken_qa", "chat")


def is_integer(value: object) -> bool:
    """Whether ``value`` is an integer (Python or numpy); ``True``/``False`` are not counts."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool | np.bool_)


@dataclass(frozen=True)
class Modality:
    """One non-text modality: one row of the table that everything multimodal reads.

    ``name``: its encoder phase, its encoder in the model (``MLLM.encoders[name]``) and its
    section of the model config; ``kind``: its segment kind in ``segments``; ``key``: the
    example field holding one float32 ``[raw rows, feature_dim]`` array per item;
    ``policy``: the balancing policy tailored to how its encoder batches (packed: ``greedy``;
    padded, like a Whisper-style encoder: ``binary_search``, paper section 8.3).
    """

    name: str
    kind: int
    key: str
    policy: str

    def __post_init__(self) -> None:
        if not is_integer(self.kind) or self.kind <= TEXT:
            raise ValueError(f"kind must be an integer > {TEXT} (text), got {self.kind!r}")
        if not self.name or self.name == "llm":
            raise ValueError(f"name must be non-empty and not 'llm', got {self.name!r}")


MODALITIES: dict[str, Modality] = {}
"""The modality table, name -> row, in phase order. Extend it with :func:`register_modality`."""


def register_modality(modality: Modality) -> Modality:
    """Add a modality to :data:`MODALITIES` (in every process that plans or loads it).

    Raises ``ValueError`` when its name, kind or example key is taken by another row.
    """
    for row in MODALITIES.values():
        if row == modality:
            return modality
        for field in ("name", "kind", "key"):
            if getattr(row, field) == getattr(modality, field):
                raise ValueError(
                    f"modality {field} {getattr(modality, field)!r} is taken by {row.name!r}"
                )
    MODALITIES[modality.name] = modality
    return modality


register_modality(Modality("vision", IMAGE, "image_patches", "greedy"))
register_modality(Modality("audio", AUDIO, "audio_mels", "binary_search"))


def kinds() -> tuple[int, ...]:
    """Every segment kind: text, then each modality's in table order."""
    return (TEXT, *(m.kind for m in MODALITIES.values()))


@dataclass(frozen=True)
class EncodingRates:
    """How many raw units (patches, mel frames) become one LLM token, per modality.

    image: ``n_patches // vision_downsample``; audio: ``n_frames // (audio_conv_stride *
    audio_downsample)`` (Whisper-style stride-2 convolution, then the connector's downsample).
    Build it from the model config so that planned lengths are the ones the model produces.

    Attributes:
        vision_downsample: image patches per LLM token.
        audio_conv_stride: mel frames per position of the audio encoder (its convolution's
            stride; 2 for Whisper).
        audio_downsample: audio-encoder positions per LLM token (the connector's downsample).

    Raises:
        ValueError: a rate that is not a positive integer.
    """

    vision_downsample: int = 1
    audio_conv_stride: int = 2
    audio_downsample: int = 2

    def __post_init__(self) -> None:
        for name in ("vision_downsample", "audio_conv_stride", "audio_downsample"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    def divisor(self, kind: int) -> int:
        """Raw units per encoded LLM token for one segment kind.

        Args:
            kind: a segment kind: :data:`TEXT`, :data:`IMAGE` or :data:`AUDIO`.

        Returns:
            1 for text, ``vision_downsample`` for images, ``audio_conv_stride *
            audio_downsample`` for audio.

        Raises:
            ValueError: ``kind`` is none of the three.
        """
        if kind == TEXT:
            return 1
        if kind == IMAGE:
            return int(self.vision_downsample)
        if kind == AUDIO:
            return int(self.audio_conv_stride * self.audio_downsample)
        raise ValueError(f"kind must be one of {(TEXT, IMAGE, AUDIO)}, got {kind!r}")

    def stride(self, kind: int) -> int:
        """Raw units per position of ``kind``'s encoder (its own sequence is ``raw // stride``).

        Args:
            kind: a segment kind.

        Returns:
            ``audio_conv_stride`` for :data:`AUDIO` (the audio encoder's convolution, stride 2
            for Whisper, halves its mel frames); 1 for any other kind.
        """
        return int(self.audio_conv_stride) if kind == AUDIO else 1

    def encoded(self, kind: int, raw: int) -> int:
        """Tokens a segment of ``raw`` units contributes to the LLM sequence.

        Args:
            kind: the segment kind (see :meth:`divisor`).
            raw: the segment's count: text tokens, image patches or mel frames.

        Returns:
            ``raw // divisor(kind)`` (rounded down).

        Raises:
            ValueError: ``kind`` is not a known segment kind.
        """
        return int(raw) // self.divisor(kind)


@dataclass(frozen=True)
class ExampleMeta:
    """Per-example lengths, derived from ``segments`` alone (see :func:`example_metadata`).

    Attributes:
        text_len: text tokens, all text segments together.
        image_raw: patches of each image, in segment order.
        image_encoded: LLM tokens of each image (``EncodingRates.encoded``), in order.
        audio_raw: mel frames of each audio clip, in segment order.
        audio_encoded: LLM tokens of each audio clip, in order.
        seq_len: length of the whole interleaved sequence the LLM sees: ``text_len`` plus
            every encoded image and audio length.
    """

    text_len: int
    image_raw: tuple[int, ...]
    image_encoded: tuple[int, ...]
    audio_raw: tuple[int, ...]
    audio_encoded: tuple[int, ...]
    seq_len: int


def check_segments(segments: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """Return ``segments`` as ``(kind, count)`` tuples, or raise ``ValueError``."""
    out = []
    for seg in segments:
        if len(seg) != 2:
            raise ValueError(f"segments entries must be [kind, count], got {list(seg)!r}")
        kind, count = int(seg[0]), int(seg[1])
        if kind not in kinds():
            raise ValueError(f"segments kind must be one of {kinds()}, got {kind}")
        if count < 1:
            raise ValueError(f"segments count must be >= 1, got {count} (kind {kind})")
        out.append((kind, count))
    return out


def example_metadata(segments: Sequence[Sequence[int]], rates: EncodingRates) -> ExampleMeta:
    """Lengths per modality and the LLM sequence length of one example (pure).

    Args:
        segments: the example's ``[kind, count]`` pairs (schema field ``segments``).
        rates: how raw counts become LLM tokens.

    Returns:
        The example's :class:`ExampleMeta`.

    Raises:
        ValueError: a segment that is not a ``[kind, count]`` pair, has an unknown kind, or a
            count below 1.
    """
    segs = check_segments(segments)
    text = sum(c for k, c in segs if k == TEXT)
    img = tuple(c for k, c in segs if k == IMAGE)
    aud = tuple(c for k, c in segs if k == AUDIO)
    img_enc = tuple(rates.encoded(IMAGE, c) for c in img)
    aud_enc = tuple(rates.encoded(AUDIO, c) for c in aud)
    return ExampleMeta(
        text_len=text,
        image_raw=img,
        image_encoded=img_enc,
        audio_raw=aud,
        audio_encoded=aud_enc,
        seq_len=text + sum(img_enc) + sum(aud_enc),
    )


def validate_example(
    example: Mapping,
    *,
    rates: EncodingRates,
    patch_dim: int | None = None,
    n_mels: int | None = None,
) -> None:
    """Check that ``example`` follows the schema: its tensors match its ``segments``.

    Args:
        example: one example as the schema dict (module docstring), e.g. from
            :func:`orchmllm.data.synthetic.as_example`.
        rates: the encoding rates; every image's patch count and audio clip's frame count
            must be a multiple of its divisor, so its encoded length is exact.
        patch_dim: the width each image's patch array must have (None: not checked).
        n_mels: the width each audio clip's mel array must have (None: not checked).

    Raises:
        ValueError: bad ``segments`` or ``task``; ``input_ids``/``loss_mask`` whose length is
            not the text segments' total; image or audio arrays whose number, shape or width
            does not match ``segments``; a count not divisible by its rate.
    """
    segs = check_segments(example["segments"])
    if example["task"] not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {example['task']!r}")
    n_text = sum(c for k, c in segs if k == TEXT)
    if len(example["input_ids"]) != n_text or len(example["loss_mask"]) != n_text:
        raise ValueError(
            f"input_ids/loss_mask must have {n_text} tokens (sum of text segments), got "
            f"{len(example['input_ids'])}/{len(example['loss_mask'])}"
        )
    for kind, key, width in ((IMAGE, "image_patches", patch_dim), (AUDIO, "audio_mels", n_mels)):
        counts = [c for k, c in segs if k == kind]
        arrays = list(example[key])
        if len(arrays) != len(counts):
            raise ValueError(f"{key} has {len(arrays)} items, segments say {len(counts)}")
        for arr, count in zip(arrays, counts, strict=True):
            arr = np.asarray(arr)
            if (
                arr.ndim != 2
                or arr.shape[0] != count
                or (width is not None and arr.shape[1] != width)
            ):
                raise ValueError(f"{key} item shape {arr.shape} does not match count {count}")
            if count % rates.divisor(kind):
                raise ValueError(
                    f"{key} count {count} is not divisible by {rates.divisor(kind)} "
                    "(encoded-length rule)"
                )
