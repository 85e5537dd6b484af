"""Seeded synthetic multimodal instruction data with Modality Composition Incoherence.

The paper (section 3.1, 8) trains on a random mix of LLaVA-1.5 instruction data (images),
LibriSpeech (ASR) and AIR-Bench (spoken QA). Which modalities an example holds, and how long
each part is, depends on its task, so a rank's load in one phase says little about its load
in another. This module generates such a mix with real tensors (pixel patches, log-mel-like
frames, token ids) and the schema of :mod:`orchmllm.schema`, stored with HF ``datasets``.

Lengths are not decided here: every example's task, image patch counts, audio frame counts and
text runs come from the shared recipe :mod:`orchmllm.data.recipe` (distributions, sources and
rounding rules are documented there), the same draw the simulator reads. Examples are drawn in
blocks of :data:`BLOCK`: block ``b`` is one ``recipe.sample_examples`` call seeded with
:func:`block_seed` ``(seed, b)``, so example ``i`` has the lengths of example ``i % BLOCK`` of a
simulator batch of ``BLOCK`` examples with that seed. This module then fills tensors from the
example's own generator, seeded ``[seed, i]``:

- a modality of unit ``patch`` (:data:`orchmllm.schema.UNITS`): a colour per patch
  and channel plus pixel noise, ``[n_patches, 3 * patch * patch]``;
- one of unit ``frame``: Whisper-style log-mel-like frames (100 per second, 16 kHz,
  hop 160): a per-clip spectral envelope, a slow loudness contour and frame noise,
  ``[n_frames, n_mels]``;
- token ids uniform in ``[4, vocab_size)``; the loss mask marks the recipe's target runs.

Each modality's field is filled by its row's unit (:data:`FILLERS`), at the width
:attr:`SyntheticConfig.widths` gives it, so a new row of the modality table needs nothing here.

Example ``i`` depends only on ``(cfg, rates, i)``, not on ``num_examples``, so generation is
reproducible, shardable, and can run as an endless stream.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from orchmllm.config import RunConfig
from orchmllm.data import recipe, workloads
from orchmllm.data.recipe import TASKS, Examples, RecipeConfig, sample_examples
from orchmllm.schema import MODALITIES, TEXT, EncodingRates, modality_named, modality_of

if TYPE_CHECKING:  # generating examples needs only numpy; HF datasets is for storage
    import datasets

BLOCK = 256  # examples per recipe draw, and per generator shard of build_dataset
_LENGTH_STREAM = 1  # third seed word: a block's stream never equals an example's [seed, i]
_N_SPECIAL = 4  # token ids below this are reserved (pad, bos, eos, image/audio markers)
DEFAULT_N_MELS = 80  # Whisper's mel bins, for frames when no width is given


@dataclass(frozen=True)
class SyntheticConfig(RecipeConfig):
    """Everything that determines the generated data (with the encoding rates): the example
    recipe's fields (:class:`orchmllm.data.recipe.RecipeConfig`) plus size, seed and tensor shapes.

    The recipe's fields decide lengths (distributions and sources in :mod:`orchmllm.data.recipe`);
    the fields of this class decide how many examples there are and their tensors' widths.

    Attributes:
        tasks: task name -> its settings (weight and the task's own knobs), as the recipe's
            (:class:`orchmllm.data.recipe.RecipeConfig`); default: the paper's mix.
        scale: multiplies every length, so a tiny config keeps the composition.
        max_text_tokens: most text tokens of one example, all its text runs together.
        patch: image patch side in pixels (default ``workloads.PATCH``, 14).
        num_examples: examples in the dataset (:func:`build_dataset`; example ``i`` does not
            depend on it).
        seed: seeds both the lengths (per block of :data:`BLOCK` examples) and the tensors.
        vocab_size: token ids are drawn uniformly in ``[4, vocab_size)`` (below 4: special).
        feature_dims: modality name -> the width of its arrays; the dataset has a field for
            exactly these modalities (None: every row of the table, ``3 * patch * patch`` for
            patches and :data:`DEFAULT_N_MELS` for frames). Pass the model's
            (``ModelConfig.feature_dims``).

    Raises:
        ValueError: a field out of range (the recipe's checks, ``num_examples < 0``,
            ``vocab_size <= 4``, a width < 1), a modality that is no row of the table, or a
            task of the mix that holds a modality ``feature_dims`` leaves out.
    """

    num_examples: int = 1000
    seed: int = 0
    vocab_size: int = 32000
    feature_dims: Mapping[str, int] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_examples < 0:
            raise ValueError(f"num_examples must be >= 0, got {self.num_examples!r}")
        if self.vocab_size <= _N_SPECIAL:
            raise ValueError(f"vocab_size must be > {_N_SPECIAL}, got {self.vocab_size!r}")
        for name, width in (self.feature_dims or {}).items():
            modality_named(name)
            if not isinstance(width, int | np.integer) or width < 1:
                raise ValueError(f"feature_dims[{name!r}] must be an integer >= 1, got {width!r}")
        widths = self.widths
        for task, weight in self.task_weights.items():
            missing = sorted(TASKS[task].modalities(self.params(task)) - set(widths))
            if weight > 0 and missing:
                raise ValueError(
                    f"task {task!r} (weight {weight}) holds {missing}, which feature_dims "
                    f"{dict(widths)} leaves out: give it weight 0 or a width"
                )

    @classmethod
    def for_run(cls, run: RunConfig, *, num_examples: int, seed: int) -> SyntheticConfig:
        """The synthetic data of a run config.

        Args:
            run: the run config: its recipe (its ``data:``, a
                :class:`~orchmllm.data.recipe.RecipeConfig`), and one array field per encoder of
                its model, as wide as the encoder's raw rows.
            num_examples: examples in the dataset.
            seed: seeds lengths and tensors.

        Returns:
            The :class:`SyntheticConfig`.

        Raises:
            ValueError: as the class (e.g. a task of the mix holds a modality the model does
                not encode).
        """
        return cls(
            **recipe.recipe_fields(run.data),
            num_examples=num_examples,
            seed=seed,
            vocab_size=run.model.vocab,
            feature_dims=run.model.feature_dims,
        )

    @property
    def widths(self) -> dict[str, int]:
        """Modality name -> array width, in table order (see ``feature_dims``)."""
        if self.feature_dims is not None:
            return {n: int(self.feature_dims[n]) for n in MODALITIES if n in self.feature_dims}
        default = {"patch": 3 * self.patch * self.patch, "frame": DEFAULT_N_MELS}
        return {name: default[m.unit] for name, m in MODALITIES.items()}


def block_seed(seed: int, block: int) -> list[int]:
    """The seed of the recipe draw that gives examples ``block * BLOCK`` onwards their lengths."""
    return [seed, block, _LENGTH_STREAM]


def fingerprint(cfg: SyntheticConfig, rates: EncodingRates) -> str:
    """A cache key of the generated data: the config, the rates and the source of every module
    that decides it (a registered task's draw included: a plugin's file), so a cached dataset
    is never one that older code generated."""
    key = hashlib.sha256(repr((cfg, rates)).encode())
    draws = [TASKS[name].draw for name in cfg.tasks if TASKS[name].draw is not None]
    for path in (recipe.__file__, workloads.__file__, __file__, *map(inspect.getfile, draws)):
        key.update(Path(path).read_bytes())
    return key.hexdigest()[:16]


def features(cfg: SyntheticConfig) -> datasets.Features:
    """HF ``datasets`` features of the schema (fixed widths, variable item counts)."""
    import datasets

    arrays = {
        MODALITIES[name].key: datasets.List(datasets.Array2D(shape=(None, w), dtype="float32"))
        for name, w in cfg.widths.items()
    }
    return datasets.Features(
        {
            "id": datasets.Value("int64"),
            "task": datasets.Value("string"),
            "segments": datasets.List(datasets.List(datasets.Value("int64"))),
            "input_ids": datasets.List(datasets.Value("int64")),
            "loss_mask": datasets.List(datasets.Value("int8")),
            **arrays,
        }
    )


def _patches(rng: np.random.Generator, n: int, width: int) -> np.ndarray:
    """Pixels: one colour per patch and channel plus pixel noise, flattened RGB patches
    (``width`` = 3 channels x pixels)."""
    colour = rng.standard_normal((n, 3, 1)).astype(np.float32)
    noise = rng.standard_normal((n, 3, width // 3), dtype=np.float32)
    return (colour + 0.25 * noise).reshape(n, width)


def _mels(rng: np.random.Generator, frames: int, n_mels: int) -> np.ndarray:
    """Log-mel-like: a per-clip spectral envelope, a slow loudness contour, frame noise."""
    envelope = np.linspace(1.0, -1.0, n_mels, dtype=np.float32) + rng.standard_normal(
        n_mels, dtype=np.float32
    )
    contour = np.cumsum(rng.standard_normal(frames, dtype=np.float32)) * 0.05
    mel = envelope[None, :] + contour[:, None]
    mel += 0.3 * rng.standard_normal((frames, n_mels), dtype=np.float32)
    return mel.astype(np.float32)


# A modality's unit (orchmllm.schema.UNITS) -> fill(rng, rows, width): its item's array.
FILLERS = {"patch": _patches, "frame": _mels}


def _example(idx: int, lengths: Examples, j: int, cfg: SyntheticConfig) -> dict:
    """Example ``idx`` with the lengths of row ``j`` of its block, tensors from its own stream."""
    rng = np.random.default_rng([cfg.seed, idx])
    segments: list[list[int]] = []
    text: list[tuple[int, bool]] = []
    widths = cfg.widths
    items: dict[str, list[np.ndarray]] = {MODALITIES[name].key: [] for name in widths}
    for kind, count, target in lengths.runs(j):
        if kind == TEXT:
            text.append((count, target))
        else:
            m = modality_of(kind)
            items[m.key].append(FILLERS[m.unit](rng, count, widths[m.name]))
        if kind == TEXT and segments and segments[-1][0] == TEXT:
            segments[-1][1] += count
        else:
            segments.append([kind, count])
    counts = [n for n, _ in text]
    mask = np.repeat([int(t) for _, t in text], counts).astype(np.int8)
    ids = rng.integers(_N_SPECIAL, cfg.vocab_size, sum(counts), dtype=np.int64)
    return {
        "id": idx,
        "task": lengths.tasks[int(lengths.task[j])].name,
        "segments": segments,
        "input_ids": ids,
        "loss_mask": mask,
        **items,
    }


def iter_examples(
    cfg: SyntheticConfig, rates: EncodingRates, ids: range | None = None
) -> Iterator[dict]:
    """Examples ``ids`` (default: all ``cfg.num_examples``) in order."""
    block, lengths = -1, None
    for idx in ids if ids is not None else range(cfg.num_examples):
        if idx // BLOCK != block:
            block = idx // BLOCK
            lengths = sample_examples(cfg, BLOCK, block_seed(cfg.seed, block), rates=rates)
        yield _example(idx, lengths, idx % BLOCK, cfg)


def generate_example(idx: int, cfg: SyntheticConfig, rates: EncodingRates) -> dict:
    """Example ``idx`` of the dataset ``cfg`` describes; depends only on ``(cfg, rates, idx)``.

    Args:
        idx: the example's index (>= 0; may be ``>= cfg.num_examples``, as in a stream).
        cfg: the dataset's config.
        rates: the encoding rates; every item's raw count is a multiple of its divisor.

    Returns:
        The example as the schema dict (:mod:`orchmllm.schema`): ``id``, ``task``,
        ``segments``, ``input_ids`` (int64), ``loss_mask`` (int8) and one field per modality
        of ``cfg.widths`` (its row's ``key``: float32 ``[raw rows, width]`` per item).
    """
    return next(iter_examples(cfg, rates, range(idx, idx + 1)))


def _gen(cfg: SyntheticConfig, rates: EncodingRates, shards: list[range]) -> Iterator[dict]:
    for ids in shards:
        yield from iter_examples(cfg, rates, ids)


def build_dataset(
    cfg: SyntheticConfig,
    rates: EncodingRates,
    *,
    keep_in_memory: bool = False,
    num_proc: int | None = None,
    cache_dir: str | None = None,
) -> datasets.Dataset:
    """Generate the dataset as an HF ``Dataset`` (numpy format; see :func:`as_example`).

    HF ``datasets`` writes it to an Arrow cache keyed by a fingerprint of ``cfg``, ``rates``
    and the generating code, so a second call with the same arguments reads the cache and a
    change to that code regenerates.

    Args:
        cfg: the dataset's config (``cfg.num_examples`` rows).
        rates: the encoding rates.
        keep_in_memory: load the result into memory instead of memory-mapping the cache.
        num_proc: processes that generate the shards of :data:`BLOCK` examples in parallel
            (None: this process alone).
        cache_dir: where HF ``datasets`` writes its cache (None: its default).

    Returns:
        The dataset, one row per example (:func:`generate_example` of each index), in numpy
        format; pass its rows through :func:`as_example`.
    """
    import datasets

    shards = [range(a, min(a + BLOCK, cfg.num_examples)) for a in range(0, cfg.num_examples, BLOCK)]
    ds = datasets.Dataset.from_generator(
        _gen,
        features=features(cfg),
        gen_kwargs={"cfg": cfg, "rates": rates, "shards": shards},
        keep_in_memory=keep_in_memory,
        num_proc=num_proc,
        cache_dir=cache_dir,
        fingerprint=fingerprint(cfg, rates),
    )
    return ds.with_format("numpy")


def save_dataset(
    cfg: SyntheticConfig, rates: EncodingRates, path: str, **kwargs
) -> datasets.Dataset:
    """Generate and ``save_to_disk`` at ``path``; returns the dataset."""
    ds = build_dataset(cfg, rates, **kwargs)
    ds.save_to_disk(path)
    return ds


def load_dataset(path: str) -> datasets.Dataset:
    """``load_from_disk`` in numpy format; rows go through :func:`as_example`."""
    import datasets

    return datasets.load_from_disk(path).with_format("numpy")


def as_example(row: Mapping) -> dict:
    """A dataset row (numpy or python format) as the schema dict with plain Python/numpy types.

    Numpy formatting stacks equal-shaped images into one 3-D array and turns segments into a
    2-D array; this undoes that so every consumer sees the same types.

    Args:
        row: one row of a dataset in the schema (e.g. from :func:`build_dataset`); it holds
            the fields of the modalities it has (a vision-only dataset has no ``audio_mels``).

    Returns:
        A new dict: ``id`` int and ``task`` str when the row has them, ``segments`` a list of
        ``[kind, count]`` (or an item's ``[kind, count, tokens]``) int lists, ``input_ids`` and
        ``loss_mask`` int64 arrays, each modality field of the row as a list of float32 2-D
        arrays, and ``item_meta`` (the per-item records) as the row has it.
    """
    out = {
        "segments": [[int(v) for v in seg] for seg in row["segments"]],
        "input_ids": np.asarray(row["input_ids"], dtype=np.int64),
        "loss_mask": np.asarray(row["loss_mask"], dtype=np.int64),
    }
    if "id" in row:
        out["id"] = int(row["id"])
    if "task" in row:
        out["task"] = str(row["task"])
    for m in MODALITIES.values():
        if m.key in row:
            out[m.key] = [np.asarray(a, dtype=np.float32) for a in row[m.key]]
    if row.get("item_meta") is not None:
        out["item_meta"] = row["item_meta"]
    return out
