"""The per-task example recipe: which items an example holds and how long each part is.

One vectorised draw gives many examples at once (numpy only, 10^5 examples in well under a
second). It is the single source of these lengths: the simulator (:mod:`orchmllm.sim.workload`)
reads a step's global batch from it, and the synthetic dataset (:mod:`orchmllm.data.synthetic`)
draws its examples' lengths from it and only fills tensors (token ids, patches, mels).

Item lengths come from :mod:`orchmllm.workloads` (LLaVA-1.5 images, LibriSpeech, AIR-Bench,
ShareGPT; sources there). Per task (text in tokens before ``scale``; "assumed" marks our own
choice where no figure is published), following the paper's data mix (section 3.1, 8):

- ``caption`` (LLaVA-1.5 captions): prefix U[4, 10), one image, prompt U[8, 21), answer a brief
  COCO-style caption (about 10.5 words: log-normal median 13, sigma 0.3, weight 0.6) or a
  LLaVA-Instruct detailed description (median 110, sigma 0.4, assumed spread).
- ``vqa``: LLaVA-1.5 packs several VQAv2/GQA questions about one image into one conversation:
  prefix U[4, 10), one image (a second one, after U[2, 5) more prompt tokens, with
  ``p_multi_image``), 1 + Poisson(2.5) turns (at most 10) of a question (median 12) and an
  answer, short (U[1, 5), "answer with a single word or phrase", weight 0.7 per example) or
  conversational (median 60). With ``p_spoken_question`` the first question is spoken instead:
  a U(2, 8) s clip (cross-modal examples; assumed rates).
- ``asr`` (LibriSpeech train-clean-100: 990k words in 100.6 h, 2.73 words/s): prompt U[6, 15),
  one clip, transcript ``seconds * 2.73 words/s * 1.3 tokens/word * LogNormal(0, 0.15)`` (text
  correlates with audio).
- ``spoken_qa`` (AIR-Bench, Yang et al. 2024): prompt U[4, 10), one clip, question and choices
  median 30, answer U[1, 4) (multiple choice, weight 0.75) or a chat answer (median 40): long
  audio, short text, no correlation.
- ``chat`` (the 40K ShareGPT conversations of the mix): prefix U[6, 20) and a ShareGPT body,
  split into 1-8 user/assistant turn pairs by a flat Dirichlet (loss on assistant turns).
- Task mix (default): caption 0.25, vqa 0.30, asr 0.25, spoken_qa 0.10, chat 0.10. The raw
  dataset sizes (about 625k LLaVA visual, 40k ShareGPT, 281k LibriSpeech 960 h, 21k AIR-Bench)
  would give spoken QA 2%; it is upsampled so every task appears in small batches.

Rules settled where the simulator and the synthetic generator used to differ (the simulator's
rule in each case, so the simulator's figures did not move):

- Patch grid: ``ceil(round(side * shrink) / patch)`` per side at full resolution (whole pixels;
  a partial border patch counts), then ``scale`` multiplies the patch count, rounded down to a
  multiple of the vision downsample (at least one). Not: a grid of ``round(side / patch)``
  with ``sqrt(scale)`` per side.
- OCR-VQA covers: long side log-normal median 350 px, sigma 0.25, clipped to [150, 800] px
  (:mod:`orchmllm.workloads`). Not: sigma 0.3 unclipped.
- Audio frames: ``round(seconds * 100)`` (the LibriSpeech mixture clipped as a whole to
  [1, 24.5] s), capped at ``max_audio_s``, then times ``scale`` rounded down to a multiple of the
  frames per LLM token (at least one). Not: ``int(seconds * 100 * scale)``.
- Text: an example's runs are summed, times ``scale``, rounded, and clipped to
  [2, ``max_text_tokens``]: the cap bounds the whole example (not each run, which let a chat
  exceed it). The floor is 2 (the simulator's was 1) so an example always has a prompt token at
  position 0 and a target; at ``scale`` 1 no text is below 12 tokens, so this never binds there.
  :func:`split_text` then shares the total among the runs.
- ``p_multi_image`` and ``p_spoken_question`` are fields of :class:`RecipeConfig`, defaulting
  to the simulator's former constants (0.1 each).

Random stream: one :class:`numpy.random.Generator` per draw, consumed in a fixed order (task,
images, audio, then text per task); the chat turn split is drawn last, so the lengths of ``n``
examples for a seed never depend on it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from orchmllm import workloads
from orchmllm.schema import AUDIO, IMAGE, TASKS, TEXT, EncodingRates

DEFAULT_MIX = {"caption": 0.25, "vqa": 0.30, "asr": 0.25, "spoken_qa": 0.10, "chat": 0.10}
MIN_TEXT = 2  # a prompt token at position 0 (never a target) and one target token
MAX_VQA_TURNS = 10
MAX_CHAT_TURNS = 8

_PROMPT, _TARGET = (TEXT, False), (TEXT, True)
# The runs of an example of each task, in order: (kind, is_target). An example fills a subset
# of its task's columns; Examples.weights holds, per column, a text run's raw length or 1 for an
# image/audio item, and 0 where the example lacks the run.
TEMPLATES: dict[str, tuple[tuple[int, bool], ...]] = {
    "caption": (_PROMPT, (IMAGE, False), _PROMPT, _TARGET),
    "vqa": (_PROMPT, (IMAGE, False), _PROMPT, (IMAGE, False), (AUDIO, False))
    + (_PROMPT, _TARGET) * MAX_VQA_TURNS,
    "asr": (_PROMPT, (AUDIO, False), _TARGET),
    "spoken_qa": (_PROMPT, (AUDIO, False), _PROMPT, _TARGET),
    "chat": (_PROMPT,) + (_PROMPT, _TARGET) * MAX_CHAT_TURNS,
}
_KINDS = {t: np.array([k for k, _ in runs]) for t, runs in TEMPLATES.items()}
_IS_TARGET = {t: np.array([g for _, g in runs]) for t, runs in TEMPLATES.items()}


@dataclass(frozen=True)
class RecipeConfig:
    """Everything that shapes an example's lengths, except the model's encoding rates."""

    task_weights: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_MIX))
    patch: int = workloads.PATCH
    max_image_side: int = workloads.MAX_IMAGE_SIDE
    max_audio_s: float = 30.0  # Whisper's window
    max_text_tokens: int = 2048
    scale: float = 1.0  # multiplies every length, so a tiny config keeps the composition
    p_multi_image: float = 0.1
    p_spoken_question: float = 0.1

    def __post_init__(self) -> None:
        for name in ("patch", "max_image_side", "max_text_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int | np.integer) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_image_side < self.patch:
            raise ValueError(
                f"max_image_side must be >= patch {self.patch}, got {self.max_image_side!r}"
            )
        if self.max_text_tokens < MIN_TEXT:
            raise ValueError(f"max_text_tokens must be >= {MIN_TEXT}, got {self.max_text_tokens!r}")
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
                f"task_weights must be >= 0 with a positive sum, got {dict(self.task_weights)!r}"
            )

    @property
    def task_probs(self) -> np.ndarray:
        """Sampling probability of each task in :data:`TASKS` order."""
        weights = np.array([float(self.task_weights.get(t, 0.0)) for t in TASKS])
        return weights / weights.sum()


def split_text(total: int, weights: np.ndarray, is_target: np.ndarray) -> np.ndarray:
    """``total`` tokens shared among text runs in proportion to their raw ``weights``.

    Cumulative rounding, so the counts sum to ``total`` exactly; the first run (the prompt at
    position 0) and the last target run get one token each before the rest is shared, so an
    example never starts with a target and always has one. Needs ``total >= 2``.
    """
    counts = np.zeros(len(weights), dtype=np.int64)
    counts[0] += 1
    counts[np.flatnonzero(is_target)[-1]] += 1
    cum = np.cumsum(weights)
    shares = np.round(cum / cum[-1] * (total - MIN_TEXT)).astype(np.int64)
    return counts + np.diff(shares, prepend=0)


@dataclass(frozen=True)
class Examples:
    """The lengths of ``n`` examples, in the simulator's units (raw patches and mel frames)."""

    task: np.ndarray  # int64[n]: index into TASKS
    text: np.ndarray  # int64[n]: text tokens
    image_example: np.ndarray  # int64[n_img]: owning example, ascending
    image_patches: np.ndarray  # int64[n_img]: raw patches
    audio_example: np.ndarray  # int64[n_aud]: owning example, ascending
    audio_frames: np.ndarray  # int64[n_aud]: raw mel frames
    # task -> float64[examples of the task, len(TEMPLATES[task])], see TEMPLATES
    weights: Mapping[str, np.ndarray] = field(repr=False)

    def runs(self, i: int) -> list[tuple[int, int, bool]]:
        """Example ``i`` in order as ``(kind, count, is_target)``: text counts sum to
        ``text[i]`` (:func:`split_text`), images and clips are its items in order."""
        name = TASKS[int(self.task[i])]
        row = self.weights[name][np.count_nonzero(self.task[:i] == self.task[i])]
        kinds, is_target = _KINDS[name], _IS_TARGET[name]
        counts = np.zeros(row.size, dtype=np.int64)
        text = np.flatnonzero((row > 0) & (kinds == TEXT))
        counts[text] = split_text(int(self.text[i]), row[text], is_target[text])
        for kind, example, size in (
            (IMAGE, self.image_example, self.image_patches),
            (AUDIO, self.audio_example, self.audio_frames),
        ):
            lo, hi = np.searchsorted(example, [i, i + 1])
            counts[(row > 0) & (kinds == kind)] = size[lo:hi]
        return [(int(kinds[c]), int(counts[c]), bool(is_target[c])) for c in np.flatnonzero(counts)]


def _lognormal(rng: np.random.Generator, median: float, sigma: float, shape) -> np.ndarray:
    return median * np.exp(sigma * rng.standard_normal(shape))


def _scaled(raw: np.ndarray, scale: float, step: int) -> np.ndarray:
    """``raw * scale`` rounded down to a multiple of ``step`` (at least ``step``)."""
    return np.maximum(step, (raw * scale).astype(np.int64) // step * step)


def sample_examples(
    cfg: RecipeConfig,
    n: int,
    rng: np.random.Generator | int | Sequence[int],
    *,
    rates: EncodingRates,
) -> Examples:
    """``n`` i.i.d. examples of ``cfg``'s mix; image patches and audio frames are multiples of
    ``rates``' divisors. ``rng`` is a generator or a seed for ``numpy.random.default_rng``."""
    if not isinstance(n, int | np.integer) or n < 0:
        raise ValueError(f"n must be an integer >= 0, got {n!r}")
    gen = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    task = gen.choice(len(TASKS), size=n, p=cfg.task_probs)
    own = {name: np.flatnonzero(task == k) for k, name in enumerate(TASKS)}
    text = np.zeros(n)
    weights: dict[str, np.ndarray] = {}

    # images: one per caption/vqa example, a second for some vqa examples
    vqa = own["vqa"]
    second = vqa[gen.random(vqa.size) < cfg.p_multi_image]
    image_example = np.sort(np.concatenate([own["caption"], vqa, second]))
    patches = workloads.sample_lengths(
        "llava_image", image_example.size, gen, max_image_side=cfg.max_image_side, patch=cfg.patch
    )
    image_patches = _scaled(patches, cfg.scale, rates.divisor(IMAGE))

    # audio: LibriSpeech for asr, AIR-Bench for spoken_qa, a short spoken question for some vqa
    spoken = vqa[gen.random(vqa.size) < cfg.p_spoken_question]
    asr_frames = workloads.sample_lengths("librispeech", own["asr"].size, gen)
    qa_frames = workloads.sample_lengths("spoken_qa", own["spoken_qa"].size, gen)
    question_s = gen.uniform(2.0, 8.0, spoken.size)
    audio_example = np.concatenate([own["asr"], own["spoken_qa"], spoken])
    frames = np.concatenate(
        [asr_frames, qa_frames, np.round(question_s * workloads.FRAMES_PER_S).astype(np.int64)]
    )
    frames = np.minimum(frames, int(cfg.max_audio_s * workloads.FRAMES_PER_S))
    order = np.argsort(audio_example, kind="stable")
    audio_example = audio_example[order]
    audio_frames = _scaled(frames[order], cfg.scale, rates.divisor(AUDIO))

    # text, and each task's runs (TEMPLATES)
    k = own["caption"]
    one = np.ones(k.size)
    brief = gen.random(k.size) < 0.6
    answer = np.where(brief, _lognormal(gen, 13, 0.3, k.size), _lognormal(gen, 110, 0.4, k.size))
    prefix, prompt = gen.integers(4, 10, k.size), gen.integers(8, 21, k.size)
    text[k] = prefix + prompt + answer
    weights["caption"] = np.column_stack([prefix, one, prompt, answer])

    k = vqa
    turns = 1 + np.minimum(MAX_VQA_TURNS - 1, gen.poisson(2.5, k.size))
    short = gen.random(k.size) < 0.7
    questions = _lognormal(gen, 12, 0.4, (k.size, MAX_VQA_TURNS))
    has_clip = np.isin(k, spoken)
    questions[:, 0] *= ~has_clip  # a spoken first question has no text
    answers = np.where(
        short[:, None],
        gen.integers(1, 5, (k.size, MAX_VQA_TURNS)),
        _lognormal(gen, 60, 0.5, (k.size, MAX_VQA_TURNS)),
    )
    used = np.arange(MAX_VQA_TURNS)[None, :] < turns[:, None]
    prefix = gen.integers(4, 10, k.size)
    text[k] = prefix + ((questions + answers) * used).sum(axis=1)
    has_second = np.isin(k, second)
    bridge = np.zeros(k.size)
    bridge[has_second] = gen.integers(2, 5, second.size)
    text[second] += bridge[has_second]
    dialogue = np.stack([questions * used, answers * used], axis=2)  # q0, a0, q1, a1, ...
    runs = [prefix, np.ones(k.size), bridge, has_second, has_clip]  # image, image, clip: 0/1
    weights["vqa"] = np.column_stack([*runs, dialogue.reshape(k.size, 2 * MAX_VQA_TURNS)])

    k = own["asr"]
    prefix = gen.integers(6, 15, k.size)
    seconds = asr_frames / workloads.FRAMES_PER_S
    transcript = seconds * 2.73 * 1.3 * np.exp(0.15 * gen.standard_normal(k.size))
    text[k] = prefix + transcript
    weights["asr"] = np.column_stack([prefix, np.ones(k.size), transcript])

    k = own["spoken_qa"]
    short = gen.random(k.size) < 0.75
    prefix = gen.integers(4, 10, k.size)
    question = _lognormal(gen, 30, 0.4, k.size)
    answer = np.where(short, gen.integers(1, 4, k.size), _lognormal(gen, 40, 0.5, k.size))
    text[k] = prefix + question + answer
    weights["spoken_qa"] = np.column_stack([prefix, np.ones(k.size), question, answer])

    k = own["chat"]
    prefix = gen.integers(6, 20, k.size)
    body = workloads.sample_lengths("text", k.size, gen)
    text[k] = prefix + body
    # drawn last (layout only): 1-8 turn pairs share the body, a flat Dirichlet
    pairs = gen.integers(1, MAX_CHAT_TURNS + 1, k.size)
    shares = gen.standard_exponential((k.size, 2 * MAX_CHAT_TURNS))
    shares *= np.arange(2 * MAX_CHAT_TURNS)[None, :] < 2 * pairs[:, None]
    shares *= body[:, None] / shares.sum(axis=1, keepdims=True)
    weights["chat"] = np.column_stack([prefix, shares])

    text = np.clip(np.round(text * cfg.scale), MIN_TEXT, cfg.max_text_tokens).astype(np.int64)
    return Examples(
        task=task.astype(np.int64),
        text=text,
        image_example=image_example,
        image_patches=image_patches,
        audio_example=audio_example,
        audio_frames=audio_frames,
        weights=weights,
    )
