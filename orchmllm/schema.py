"""The multimodal example schema shared by the data, the orchestrator and the models.

One example is one HF ``datasets`` row (and the dict a loader yields per example):

- ``id`` int64; ``task`` str (optional; the synthetic recipe's task name)
- ``segments``: ``[kind, count]`` pairs in interleaving order; kind :data:`TEXT` (count = text
  tokens) or a modality's kind (count = its raw rows: image patches, mel frames, ...). An item
  whose LLM token count is not its raw rows over its rate (a Hugging Face model's tiles, clips
  or packed image features) says it: ``[kind, count, tokens]``
- ``input_ids``: every text segment's tokens concatenated in order; ``loss_mask``: 1 per text
  token that is a prediction target
- one field per modality that the example holds (the row's ``key``: ``image_patches``,
  ``audio_mels``, ...): one float32 ``[raw rows, feature_dim]`` array per item, in order. A
  dataset without a modality needs no field for it.

Every modality is one row of :data:`MODALITIES`. The row is the single place that names it:
its phase, encoder, config section, example field, default encoder architecture, balancing
policy and what its raw rows are all come from the row, so a new modality is a new row (plus
a task that produces it, :mod:`orchmllm.data.recipe`, and maybe an encoder architecture,
:mod:`orchmllm.models.spec`), registered from a file of the user's own (:mod:`orchmllm.plugins`),
not an edit of every module. Every reader looks the table up when it runs, never a copy.

Only ``segments`` is needed to plan (lengths before and after the encoders, LLM sequence
length), so the metadata functions here take segments, never tensors: a loader can compute them
for a whole dataset cheaply, and the orchestrator gathers nothing larger.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

TEXT = 0
LLM = "llm"  # the LLM phase's name; no modality may take it
IGNORE_INDEX = -100  # a label nothing predicts (the convention of torch's cross-entropy and HF)
# What a modality's raw rows are; decides how synthetic data fills them (orchmllm.data.synthetic).
UNITS = ("patch", "frame")


def is_integer(value: object) -> bool:
    """Whether ``value`` is an integer (Python or numpy); ``True``/``False`` are not counts."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool | np.bool_)


@dataclass(frozen=True)
class Modality:
    """One non-text modality: one row of the table that everything multimodal reads.

    Attributes:
        name: its encoder phase, its encoder in the model (``MLLM.encoders[name]``), its
            section of the model config (``model.encoders.<name>``) and its statistics.
        kind: its segment kind in ``segments`` (an integer > :data:`TEXT`).
        key: the example field holding one float32 ``[raw rows, feature_dim]`` array per item.
        policy: the balancing policy tailored to how its encoder batches (packed: ``greedy``;
            padded, like a Whisper-style encoder: ``binary_search``, paper section 8.3).
        arch: the encoder architecture a config gets when its section names none (a name in
            ``orchmllm.models.spec.ARCHS``: ``vit`` packed, ``whisper`` padded).
        unit: what one raw row is, one of :data:`UNITS`: ``patch`` (a flattened RGB pixel
            patch) or ``frame`` (a log-mel frame, 100 per second).

    Raises:
        ValueError: a kind that is not an integer > 0, an empty or reserved name, or a unit
            not in :data:`UNITS`.
    """

    name: str
    kind: int
    key: str
    policy: str
    arch: str
    unit: str

    def __post_init__(self) -> None:
        if not is_integer(self.kind) or self.kind <= TEXT:
            raise ValueError(f"kind must be an integer > {TEXT} (text), got {self.kind!r}")
        if not self.name or self.name == LLM:
            raise ValueError(f"name must be non-empty and not {LLM!r}, got {self.name!r}")
        if self.unit not in UNITS:
            raise ValueError(f"unit must be one of {UNITS}, got {self.unit!r}")


MODALITIES: dict[str, Modality] = {}
"""The modality table, name -> row, in phase order. Extend it with :func:`register_modality`."""


def register_modality(modality: Modality) -> Modality:
    """Add a modality to :data:`MODALITIES` (in every process that plans or loads it).

    Registering the same row again is a no-op.

    Args:
        modality: the new row.

    Returns:
        ``modality``.

    Raises:
        ValueError: its name, kind or example key is taken by another row.
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


def unregister_modality(name: str) -> None:
    """Remove a row added with :func:`register_modality` (tests, temporary rows).

    Raises:
        ValueError: no row is named ``name``.
    """
    if name not in MODALITIES:
        raise ValueError(f"no modality named {name!r}; the table has {list(MODALITIES)}")
    del MODALITIES[name]


register_modality(Modality("vision", 1, "image_patches", "greedy", arch="vit", unit="patch"))
register_modality(Modality("audio", 2, "audio_mels", "binary_search", arch="whisper", unit="frame"))
IMAGE = MODALITIES["vision"].kind  # the built-in rows' kinds, for segment tables in tests
AUDIO = MODALITIES["audio"].kind


def modality_of(kind: int) -> Modality:
    """The row whose segments have ``kind``.

    Raises:
        ValueError: no row has that kind (text has none).
    """
    for row in MODALITIES.values():
        if row.kind == kind:
            return row
    known = {m.kind: m.name for m in MODALITIES.values()}
    raise ValueError(f"no modality has segment kind {kind!r}; the table has {known}")


def modality_named(name: str) -> Modality:
    """The row called ``name``.

    Raises:
        ValueError: no row is called ``name`` (the error lists the table).
    """
    if name not in MODALITIES:
        raise ValueError(f"no modality named {name!r}; the table has {list(MODALITIES)}")
    return MODALITIES[name]


def kinds() -> tuple[int, ...]:
    """Every segment kind: text, then each modality's in table order."""
    return (TEXT, *(m.kind for m in MODALITIES.values()))


@dataclass(frozen=True)
class Rate:
    """How one modality's raw rows become LLM tokens.

    Attributes:
        stride: raw rows per position of its encoder (a Whisper-style convolution front end
            halves mel frames: 2; a ViT: 1).
        downsample: encoder positions per LLM token (the connector's merge).

    Raises:
        ValueError: a value that is not a positive integer.
    """

    stride: int = 1
    downsample: int = 1

    def __post_init__(self) -> None:
        for name in ("stride", "downsample"):
            value = getattr(self, name)
            if not is_integer(value) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @property
    def divisor(self) -> int:
        """Raw rows per LLM token: ``stride * downsample``."""
        return int(self.stride * self.downsample)


class EncodingRates(Mapping[str, Rate]):
    """How many raw rows become one LLM token, per modality name (a read-only mapping).

    A modality of the table without an entry keeps one LLM token per raw row. Build it from
    the model config (``ModelConfig.rates``) so that planned lengths are the ones the model
    produces.

    Args:
        rates: modality name -> :class:`Rate`.

    Raises:
        ValueError: a name that is no row of :data:`MODALITIES`, or a value that is not a
            :class:`Rate`.
    """

    def __init__(self, rates: Mapping[str, Rate] | None = None) -> None:
        rates = dict(rates or {})
        for name, rate in rates.items():
            modality_named(name)
            if not isinstance(rate, Rate):
                raise ValueError(f"rates[{name!r}] must be a Rate, got {rate!r}")
        self._rates = tuple(sorted(rates.items()))

    def __getitem__(self, name: str) -> Rate:
        return dict(self._rates)[name]

    def __iter__(self) -> Iterator[str]:
        return (name for name, _ in self._rates)

    def __len__(self) -> int:
        return len(self._rates)

    def __hash__(self) -> int:
        return hash(self._rates)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EncodingRates) and self._rates == other._rates

    def __repr__(self) -> str:
        return f"EncodingRates({dict(self._rates)!r})"

    def rate(self, kind: int) -> Rate:
        """The rate of segment ``kind``: text and a modality without an entry are 1:1.

        Args:
            kind: a segment kind (:data:`TEXT` or a modality's).

        Returns:
            Its :class:`Rate`.

        Raises:
            ValueError: ``kind`` is neither text nor a modality's kind.
        """
        if kind == TEXT:
            return Rate()
        return dict(self._rates).get(modality_of(kind).name, Rate())

    def divisor(self, kind: int) -> int:
        """Raw rows per encoded LLM token for segment ``kind`` (1 for text).

        Args:
            kind: a segment kind.

        Returns:
            ``stride * downsample`` of its rate.

        Raises:
            ValueError: ``kind`` is not a known segment kind.
        """
        return self.rate(kind).divisor

    def stride(self, kind: int) -> int:
        """Raw rows per position of ``kind``'s encoder (its own sequence is ``raw // stride``).

        Args:
            kind: a segment kind.

        Returns:
            Its rate's stride.

        Raises:
            ValueError: ``kind`` is not a known segment kind.
        """
        return int(self.rate(kind).stride)

    def encoded(self, kind: int, raw: int) -> int:
        """Tokens a segment contributes to the LLM sequence.

        Args:
            kind: the segment kind.
            raw: its raw rows (text tokens, image patches, mel frames, ...).

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
        raw: modality name -> raw rows of each of its items, in segment order (every row of
            the table, empty where the example has none).
        encoded: modality name -> LLM tokens of each of its items (its stated ``tokens``,
            else ``EncodingRates.encoded``), in order.
        seq_len: length of the whole interleaved sequence the LLM sees: ``text_len`` plus
            every encoded item.
    """

    text_len: int
    raw: Mapping[str, tuple[int, ...]]
    encoded: Mapping[str, tuple[int, ...]]
    seq_len: int


def check_segments(segments: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """Return ``segments`` as ``(kind, count)`` tuples, or raise ``ValueError``."""
    out = []
    known = kinds()
    for seg in segments:
        if len(seg) not in (2, 3) or (len(seg) == 3 and int(seg[0]) == TEXT):
            raise ValueError(
                f"segments entries must be [kind, count] or, for an item, [kind, count, tokens], "
                f"got {list(seg)!r}"
            )
        kind, count = int(seg[0]), int(seg[1])
        if kind not in known:
            raise ValueError(f"segments kind must be one of {known}, got {kind}")
        if count < 1:
            raise ValueError(f"segments count must be >= 1, got {count} (kind {kind})")
        if len(seg) == 3 and int(seg[2]) < 1:
            raise ValueError(f"segments tokens must be >= 1, got {int(seg[2])} (kind {kind})")
        out.append((kind, count))
    return out


def given_tokens(segments: Sequence[Sequence[int]]) -> list[int]:
    """The LLM token count each segment states (an item's third entry), -1 where it states
    none (text, and items whose rate decides: ``EncodingRates.encoded``).

    Raises:
        ValueError: a bad segment (:func:`check_segments`).
    """
    check_segments(segments)
    return [int(seg[2]) if len(seg) == 3 else -1 for seg in segments]


def segment_tokens(segments: Sequence[Sequence[int]], rates: EncodingRates) -> list[int]:
    """LLM tokens of every segment: the text count, an item's stated tokens, or its raw count
    over its rate.

    Raises:
        ValueError: a bad segment (:func:`check_segments`).
    """
    segs, given = check_segments(segments), given_tokens(segments)
    return [g if g >= 0 else rates.encoded(k, c) for (k, c), g in zip(segs, given, strict=True)]


def example_metadata(segments: Sequence[Sequence[int]], rates: EncodingRates) -> ExampleMeta:
    """Lengths per modality and the LLM sequence length of one example (pure).

    Args:
        segments: the example's ``[kind, count]`` pairs, or ``[kind, count, tokens]`` for an
            item stating its LLM tokens (schema field ``segments``).
        rates: how raw counts become LLM tokens where an item states none.

    Returns:
        The example's :class:`ExampleMeta`.

    Raises:
        ValueError: a segment that is neither a ``[kind, count]`` pair nor an item's
            ``[kind, count, tokens]``, has an unknown kind, or a count or tokens below 1.
    """
    segs = check_segments(segments)
    tokens = segment_tokens(segments, rates)
    raw = {m.name: tuple(c for k, c in segs if k == m.kind) for m in MODALITIES.values()}
    encoded = {
        m.name: tuple(t for (k, _), t in zip(segs, tokens, strict=True) if k == m.kind)
        for m in MODALITIES.values()
    }
    text = sum(c for k, c in segs if k == TEXT)
    return ExampleMeta(
        text_len=text,
        raw=raw,
        encoded=encoded,
        seq_len=text + sum(sum(e) for e in encoded.values()),
    )


def validate_example(
    example: Mapping,
    *,
    rates: EncodingRates,
    feature_dims: Mapping[str, int] | None = None,
) -> None:
    """Check that ``example`` follows the schema: its tensors match its ``segments``.

    Args:
        example: one example as the schema dict (module docstring), e.g. from
            :func:`orchmllm.data.synthetic.as_example`.
        rates: the encoding rates; every item's raw count must be a multiple of its divisor,
            so its encoded length is exact.
        feature_dims: modality name -> the width each of its arrays must have (a modality
            left out is not checked).

    Raises:
        ValueError: bad ``segments``; a ``task`` that is not a string; ``input_ids`` /
            ``loss_mask`` whose length is not the text segments' total; a modality's arrays
            whose number, shape or width does not match ``segments`` (or a missing field
            where segments of its kind exist); a count not divisible by its rate (an item
            that states its tokens is not held to its rate).
    """
    segs = check_segments(example["segments"])
    if "task" in example and not isinstance(example["task"], str):
        raise ValueError(f"task must be a string, got {example['task']!r}")
    n_text = sum(c for k, c in segs if k == TEXT)
    if len(example["input_ids"]) != n_text or len(example["loss_mask"]) != n_text:
        raise ValueError(
            f"input_ids/loss_mask must have {n_text} tokens (sum of text segments), got "
            f"{len(example['input_ids'])}/{len(example['loss_mask'])}"
        )
    widths = dict(feature_dims or {})
    given = given_tokens(example["segments"])
    for m in MODALITIES.values():
        counts = [(c, g) for (k, c), g in zip(segs, given, strict=True) if k == m.kind]
        if m.key not in example and not counts:
            continue
        arrays = list(example.get(m.key) or [])
        if len(arrays) != len(counts):
            raise ValueError(f"{m.key} has {len(arrays)} items, segments say {len(counts)}")
        width = widths.get(m.name)
        for arr, (count, stated) in zip(arrays, counts, strict=True):
            arr = np.asarray(arr)
            if arr.ndim != 2 or arr.shape[0] != count or width not in (None, arr.shape[1]):
                raise ValueError(f"{m.key} item shape {arr.shape} does not match count {count}")
            if stated < 0 and count % rates.divisor(m.kind):
                raise ValueError(
                    f"{m.key} count {count} is not divisible by {rates.divisor(m.kind)} "
                    "(encoded-length rule)"
                )
