"""Seeded synthetic multimodal instruction data with Modality Composition Incoherence.

The paper (section 3.1, 8) trains on a random mix of LLaVA-1.5 instruction data (images),
LibriSpeech (ASR) and AIR-Bench (spoken QA). Which modalities an example holds, and how long
each part is, depends on its task, so a rank's load in one phase says little about its load
in another. This module generates such a mix with real tensors (pixel patches, log-mel-like
frames, token ids) and the schema of :mod:`orchmllm.schema`, stored with HF ``datasets``.

Distributions (lengths before ``scale``; "assumed" marks our own choice where no figure is
published):

- Images, tasks ``caption`` and ``vqa``: source resolutions follow the LLaVA-1.5 mix665k
  sources (Liu et al. 2023, "Improved Baselines with Visual Instruction Tuning", Table 7):
  COCO-like long side 640 px (weight 0.55; COCO images are at most 640 px), Visual Genome /
  GQA-like 500 px (0.20), TextVQA/OpenImages-like 1024 px (0.15), OCR-VQA book covers,
  log-normal around 350 px (0.10); aspect ratio 4:3, 3:2, 16:9, 1:1 or portrait 3:4 (assumed
  weights 0.5/0.15/0.1/0.1/0.15). Dynamic resolution as in the paper's preprocessing (section 8):
  only images larger than ``max_image_side`` (448/672/896 for MLLM-10B/18B/84B) are resized,
  keeping the aspect ratio; the grid is ``round(side / patch)`` patches, patch 14.
- ``caption`` text: prompt 8-20 tokens; answer either a brief COCO-style caption (about 10.5
  words, ~13 tokens, weight 0.6) or a LLaVA-Instruct detailed description (log-normal, median
  110 tokens, weight 0.4, assumed spread).
- ``vqa``: LLaVA-1.5 packs several VQAv2/GQA questions about one image into one conversation:
  1 + Poisson(2.5) turns (at most 10), questions log-normal median 12 tokens, answers short
  (1-4 tokens, "answer with a single word or phrase", weight 0.7) or conversational (median 60).
  With ``p_multi_image`` a second image is added and with ``p_spoken_question`` the first
  question is spoken (an audio clip of 2-8 s): cross-modal examples (assumed rates).
- ``asr``: LibriSpeech train-clean-100 has 28,539 utterances in 100.6 h (mean 12.7 s) and
  990k words (2.73 words/s). Durations: 0.8 * Normal(14.5 s, 2.5 s) + 0.2 * Uniform(1.5, 10) s,
  clipped to [1, 24.5] s (mean about 12.8 s; the mixture shape is assumed). Transcript tokens =
  duration * 2.73 words/s * 1.3 tokens/word * LogNormal(0, 0.15): text correlates with audio.
- ``spoken_qa``: AIR-Bench (Yang et al. 2024) speech/sound/music clips of up to 30 s with a
  text question and mostly multiple-choice answers: durations log-normal median 12 s (sigma
  0.6) in [2, 30] s (assumed), question + choices median 30 tokens, answer 1-3 tokens (weight
  0.75) or a chat answer (median 40 tokens): long audio, short text, no correlation.
- ``chat``: the 40K ShareGPT conversations in the mix: 1-8 turns, total tokens log-normal
  median 700 (sigma 0.8, assumed), capped at ``max_text_tokens``; loss on assistant turns.
- Audio features: Whisper front end, 16 kHz, 10 ms hop: 100 mel frames per second, at most
  ``max_audio_s`` (Whisper's 30 s window).
- Task mix (default): caption 0.25, vqa 0.30, asr 0.25, spoken_qa 0.10, chat 0.10. The raw
  dataset sizes (about 625k LLaVA visual, 40k ShareGPT, 281k LibriSpeech 960 h, 21k AIR-Bench)
  would give spoken QA 2%; we upsample it so every task appears in small batches.

``scale`` multiplies every length (image patch count, audio frames, text tokens) so the tiny
CPU config keeps the same composition with small tensors; counts are then rounded to the
encoded-length rule (image patches divisible by ``vision_downsample``, audio frames by
``audio_conv_stride * audio_downsample``) so no raw unit is dropped by the encoders.

Example ``i`` depends only on ``(seed, i)``, so generation is reproducible and shardable.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from orchmllm.schema import AUDIO, IMAGE, TASKS, TEXT, EncodingRates

if TYPE_CHECKING:  # generating examples needs only numpy; HF datasets is for storage
    import datasets

_DEFAULT_MIX = {"caption": 0.25, "vqa": 0.30, "asr": 0.25, "spoken_qa": 0.10, "chat": 0.10}
_FRAMES_PER_S = 100  # Whisper: 16 kHz audio, hop 160
_N_SPECIAL = 4  # token ids below this are reserved (pad, bos, eos, image/audio markers)


@dataclass(frozen=True)
class SyntheticConfig:
    """Everything that determines the generated data (with the encoding rates)."""

    num_examples: int = 1000
    seed: int = 0
    task_weights: Mapping[str, float] = field(default_factory=lambda: dict(_DEFAULT_MIX))
    patch: int = 14
    max_image_side: int = 448
    n_mels: int = 80
    max_audio_s: float = 30.0
    vocab_size: int = 32000
    max_text_tokens: int = 2048
    scale: float = 1.0
    p_multi_image: float = 0.1
    p_spoken_question: float = 0.1

    def __post_init__(self) -> None:
        positive = ("patch", "max_image_side", "n_mels", "max_text_tokens")
        for name in positive:
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.num_examples < 0:
            raise ValueError(f"num_examples must be >= 0, got {self.num_examples!r}")
        if self.vocab_size <= _N_SPECIAL:
            raise ValueError(f"vocab_size must be > {_N_SPECIAL}, got {self.vocab_size!r}")
        if not (self.scale > 0 and math.isfinite(self.scale)):
            raise ValueError(f"scale must be a positive finite number, got {self.scale!r}")
        if not self.max_audio_s > 0:
            raise ValueError(f"max_audio_s must be > 0, got {self.max_audio_s!r}")
        for name in ("p_multi_image", "p_spoken_question"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)!r}")
        unknown = set(self.task_weights) - set(TASKS)
        if unknown:
            raise ValueError(f"task_weights has unknown tasks {sorted(unknown)}; known: {TASKS}")
        weights = list(self.task_weights.values())
        if any(not w >= 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(
                f"task_weights must be >= 0 with a positive sum, got {self.task_weights!r}"
            )

    @property
    def patch_dim(self) -> int:
        return 3 * self.patch * self.patch


def features(cfg: SyntheticConfig) -> datasets.Features:
    """HF ``datasets`` features of the schema (fixed widths, variable item counts)."""
    import datasets

    return datasets.Features(
        {
            "id": datasets.Value("int64"),
            "task": datasets.Value("string"),
            "segments": datasets.List(datasets.List(datasets.Value("int64"))),
            "input_ids": datasets.List(datasets.Value("int64")),
            "loss_mask": datasets.List(datasets.Value("int8")),
            "image_patches": datasets.List(
                datasets.Array2D(shape=(None, cfg.patch_dim), dtype="float32")
            ),
            "audio_mels": datasets.List(
                datasets.Array2D(shape=(None, cfg.n_mels), dtype="float32")
            ),
        }
    )


class _Builder:
    """Generates one example from its own RNG; text is collected as (n_tokens, is_target) runs."""

    def __init__(self, cfg: SyntheticConfig, rates: EncodingRates, rng: np.random.Generator):
        self.cfg, self.rates, self.rng = cfg, rates, rng
        self.segments: list[list[int]] = []
        self.text: list[tuple[int, int]] = []
        self.images: list[np.ndarray] = []
        self.audios: list[np.ndarray] = []

    # lengths -------------------------------------------------------------------------------
    def _lognormal(self, median: float, sigma: float) -> float:
        return float(median * math.exp(sigma * self.rng.standard_normal()))

    def _tokens(self, n: float) -> int:
        return max(1, min(self.cfg.max_text_tokens, round(n * self.cfg.scale)))

    # segments ------------------------------------------------------------------------------
    def add_text(self, n: float, target: bool) -> None:
        count = self._tokens(n)
        if self.segments and self.segments[-1][0] == TEXT:
            self.segments[-1][1] += count
        else:
            self.segments.append([TEXT, count])
        self.text.append((count, int(target)))

    def add_image(self) -> None:
        cfg, rng = self.cfg, self.rng
        source = rng.choice(4, p=[0.55, 0.20, 0.15, 0.10])
        long_side = (640.0, 500.0, 1024.0, 0.0)[source] or self._lognormal(350.0, 0.3)
        ratio = (4 / 3, 3 / 2, 16 / 9, 1.0, 3 / 4)[rng.choice(5, p=[0.5, 0.15, 0.1, 0.1, 0.15])]
        w, h = (long_side, long_side / ratio) if ratio >= 1 else (long_side * ratio, long_side)
        shrink = min(1.0, cfg.max_image_side / max(w, h))  # only larger images are resized
        side_scale = shrink * math.sqrt(cfg.scale)  # scale multiplies the patch count
        gh = max(1, round(h * side_scale / cfg.patch))
        gw = max(1, round(w * side_scale / cfg.patch))
        r = self.rates.divisor(IMAGE)
        step = r // math.gcd(gh, r)  # gh * gw divisible by r
        gw = max(step, gw // step * step)
        # Pixels: a smooth colour field (one colour per patch) plus pixel noise, normalised.
        p = cfg.patch
        colour = rng.standard_normal((gh, gw, 3, 1, 1)).astype(np.float32)
        noise = rng.standard_normal((gh, gw, 3, p, p), dtype=np.float32)
        self.images.append((colour + 0.25 * noise).reshape(gh * gw, 3 * p * p))
        self.segments.append([IMAGE, gh * gw])

    def add_audio(self, seconds: float) -> None:
        cfg, rng = self.cfg, self.rng
        seconds = min(seconds, cfg.max_audio_s)
        r = self.rates.divisor(AUDIO)
        frames = max(r, int(seconds * _FRAMES_PER_S * cfg.scale) // r * r)
        # Log-mel-like: a per-clip spectral envelope, a slow loudness contour, frame noise.
        envelope = np.linspace(1.0, -1.0, cfg.n_mels, dtype=np.float32) + rng.standard_normal(
            cfg.n_mels, dtype=np.float32
        )
        contour = np.cumsum(rng.standard_normal(frames, dtype=np.float32)) * 0.05
        mel = envelope[None, :] + contour[:, None]
        mel += 0.3 * rng.standard_normal((frames, cfg.n_mels), dtype=np.float32)
        self.audios.append(mel.astype(np.float32))
        self.segments.append([AUDIO, frames])

    # tasks ---------------------------------------------------------------------------------
    def caption(self) -> None:
        self.add_text(self.rng.integers(4, 10), target=False)  # system / role prefix
        self.add_image()
        self.add_text(self.rng.integers(8, 21), target=False)
        brief = self.rng.random() < 0.6
        self.add_text(self._lognormal(13, 0.3) if brief else self._lognormal(110, 0.4), target=True)

    def vqa(self) -> None:
        rng = self.rng
        self.add_text(rng.integers(4, 10), target=False)
        self.add_image()
        if rng.random() < self.cfg.p_multi_image:
            self.add_text(rng.integers(2, 5), target=False)
            self.add_image()
        turns = 1 + min(9, int(rng.poisson(2.5)))
        short = rng.random() < 0.7
        for turn in range(turns):
            if turn == 0 and rng.random() < self.cfg.p_spoken_question:
                self.add_audio(rng.uniform(2.0, 8.0))
            else:
                self.add_text(self._lognormal(12, 0.4), target=False)
            answer = rng.integers(1, 5) if short else self._lognormal(60, 0.5)
            self.add_text(answer, target=True)

    def asr(self) -> None:
        rng = self.rng
        if rng.random() < 0.8:
            seconds = float(np.clip(rng.normal(14.5, 2.5), 1.0, 24.5))
        else:
            seconds = float(rng.uniform(1.5, 10.0))
        self.add_text(rng.integers(6, 15), target=False)
        self.add_audio(seconds)
        self.add_text(seconds * 2.73 * 1.3 * math.exp(0.15 * rng.standard_normal()), target=True)

    def spoken_qa(self) -> None:
        rng = self.rng
        self.add_text(rng.integers(4, 10), target=False)
        self.add_audio(float(np.clip(self._lognormal(12.0, 0.6), 2.0, 30.0)))
        self.add_text(self._lognormal(30, 0.4), target=False)
        short = rng.random() < 0.75
        self.add_text(rng.integers(1, 4) if short else self._lognormal(40, 0.5), target=True)

    def chat(self) -> None:
        rng = self.rng
        turns = int(rng.integers(1, 9))
        total = self._lognormal(700, 0.8)
        self.add_text(rng.integers(6, 20), target=False)
        for share in rng.dirichlet(np.ones(2 * turns)).reshape(turns, 2):
            self.add_text(total * share[0], target=False)
            self.add_text(total * share[1], target=True)

    def example(self, idx: int, task: str) -> dict:
        getattr(self, task)()
        n_text = sum(n for n, _ in self.text)
        mask = np.repeat([t for _, t in self.text], [n for n, _ in self.text]).astype(np.int8)
        ids = self.rng.integers(_N_SPECIAL, self.cfg.vocab_size, n_text, dtype=np.int64)
        return {
            "id": idx,
            "task": task,
            "segments": self.segments,
            "input_ids": ids,
            "loss_mask": mask,
            "image_patches": self.images,
            "audio_mels": self.audios,
        }


def generate_example(idx: int, cfg: SyntheticConfig, rates: EncodingRates) -> dict:
    """Example ``idx`` of the dataset ``cfg`` describes; depends only on ``(cfg, rates, idx)``."""
    rng = np.random.default_rng([cfg.seed, idx])
    tasks = [t for t in TASKS if cfg.task_weights.get(t, 0) > 0]
    weights = np.array([cfg.task_weights[t] for t in tasks], dtype=np.float64)
    task = tasks[rng.choice(len(tasks), p=weights / weights.sum())]
    return _Builder(cfg, rates, rng).example(idx, task)


def iter_examples(
    cfg: SyntheticConfig, rates: EncodingRates, ids: range | None = None
) -> Iterator[dict]:
    for idx in ids if ids is not None else range(cfg.num_examples):
        yield generate_example(idx, cfg, rates)


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
    """Generate the dataset as an HF ``Dataset`` (numpy format; see :func:`as_example`)."""
    import datasets

    shard = 256
    shards = [range(a, min(a + shard, cfg.num_examples)) for a in range(0, cfg.num_examples, shard)]
    ds = datasets.Dataset.from_generator(
        _gen,
        features=features(cfg),
        gen_kwargs={"cfg": cfg, "rates": rates, "shards": shards},
        keep_in_memory=keep_in_memory,
        num_proc=num_proc,
        cache_dir=cache_dir,
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
    """
    return {
        "id": int(row["id"]),
        "task": str(row["task"]),
        "segments": [[int(k), int(c)] for k, c in row["segments"]],
        "input_ids": np.asarray(row["input_ids"], dtype=np.int64),
        "loss_mask": np.asarray(row["loss_mask"], dtype=np.int64),
        "image_patches": [np.asarray(a, dtype=np.float32) for a in row["image_patches"]],
        "audio_mels": [np.asarray(a, dtype=np.float32) for a in row["audio_mels"]],
    }
