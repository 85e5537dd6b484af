"""The per-task example recipe: which items an example holds and how long each part is.

One vectorised draw gives many examples at once (numpy only, 10^5 examples in well under a
second). It is the single source of these lengths: the simulator (:mod:`orchmllm.sim.workload`)
reads a step's global batch from it, and the synthetic dataset (:mod:`orchmllm.data.synthetic`)
draws its examples' lengths from it and only fills tensors (token ids, patches, mels).

Item lengths come from :mod:`orchmllm.workloads` (LLaVA-1.5 images, LibriSpeech, AIR-Bench,
ShareGPT) and every other number from the table :data:`orchmllm.workload_facts.FACTS`, each
entry with its source or "assumed". The paper's data mix (section 3.1, 8), per task:

- ``caption`` (LLaVA-1.5 captions): a prefix, one image, a prompt, and an answer that is a
  brief COCO-style caption or a detailed LLaVA-Instruct description.
- ``vqa`` (LLaVA-1.5 packs several VQAv2/GQA questions about one image into one conversation):
  a prefix, one image (a second one, after a few more prompt tokens, with ``p_multi_image``),
  1 + Poisson turns of a question and an answer, short ("answer with a single word or
  phrase") or conversational. With ``p_spoken_question`` the first question is a spoken clip.
- ``asr`` (LibriSpeech): a prompt, one clip, a transcript whose length follows the clip's
  (the corpus's words per second, tokens per word): text correlates with audio.
- ``spoken_qa`` (AIR-Bench): a prompt, one clip, a question with choices, a choice or a chat
  answer: long audio, short text, no correlation.
- ``chat`` (the ShareGPT conversations of the mix): a prefix and a ShareGPT body split into
  user/assistant turn pairs by a flat Dirichlet (loss on assistant turns).

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
- ``p_multi_image`` and ``p_spoken_question`` are fields of :class:`RecipeConfig` (and of a
  run config's ``data:``), defaulting to the table's.

Tasks are rows of :data:`TASKS`. The five above are the paper's mix, drawn together by one
function; :func:`register_task` adds a task with its own draw (e.g. one that holds a modality
added to :data:`orchmllm.schema.MODALITIES`), drawn after them.

Random stream: one :class:`numpy.random.Generator` per draw, consumed in a fixed order (task,
images, audio, then text per task of the paper's mix, the chat turn split last, then each
registered task in table order), so the lengths of ``n`` examples for a seed never depend on
the chat split, and a registered task with weight 0 changes nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from orchmllm import workloads
from orchmllm.config import DataConfig, ModelConfig
from orchmllm.schema import MODALITIES, TEXT, EncodingRates, modality_named
from orchmllm.workload_facts import fact

MIN_TEXT = 2  # a prompt token at position 0 (never a target) and one target token
MAX_VQA_TURNS = int(fact("vqa.max_turns"))
MAX_CHAT_TURNS = int(fact("chat.max_turn_pairs"))

Run = tuple[str, bool]  # ("text" or a modality name, is_target)
_PROMPT: Run = ("text", False)
_TARGET: Run = ("text", True)


@dataclass(frozen=True)
class ItemLengths:
    """One modality's items in a draw: the owning example of each (ascending) and its raw
    rows."""

    example: np.ndarray  # int64[items]
    raw: np.ndarray  # int64[items]


@dataclass(frozen=True)
class TaskDraw:
    """What a registered task's ``draw`` returns for its ``n`` examples.

    Attributes:
        lengths: float64 ``[n, len(task.runs)]``: per text run its raw length before
            ``scale`` (the example's text is their sum), per item run its raw rows before
            ``scale``; 0 where the example lacks the run.
    """

    lengths: np.ndarray


Draw = Callable[[np.random.Generator, int, "RecipeConfig"], TaskDraw]


@dataclass(frozen=True)
class Task:
    """One task of the recipe.

    Attributes:
        name: the ``task`` string of its examples.
        runs: its examples' runs in order: ``("text", is_target)`` or ``(modality name,
            False)``; an example fills a subset of them.
        weight: its weight in the default mix.
        draw: how a registered task draws its examples' lengths (None: the paper's mix,
            drawn together by this module).
        optional: modality -> the :class:`RecipeConfig` probability that an example holds
            it; a modality whose probability is 0 is never held.
    """

    name: str
    runs: tuple[Run, ...]
    weight: float = 0.0
    draw: Draw | None = None
    optional: Mapping[str, str] = field(default_factory=dict)

    def kinds(self) -> np.ndarray:
        """The segment kind of each run."""
        return np.array([TEXT if k == "text" else modality_named(k).kind for k, _ in self.runs])

    def is_target(self) -> np.ndarray:
        return np.array([t for _, t in self.runs], dtype=bool)

    def modalities(self, cfg: RecipeConfig) -> set[str]:
        """The modalities its examples can hold under ``cfg``."""
        held = {k for k, _ in self.runs if k != "text"}
        return {m for m in held if getattr(cfg, self.optional.get(m, ""), 1) > 0}


_CAPTION, _VQA, _ASR, _SPOKEN_QA, _CHAT = fact("mix.weights")
TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task("caption", (_PROMPT, ("vision", False), _PROMPT, _TARGET), _CAPTION),
        Task(
            "vqa",
            (_PROMPT, ("vision", False), _PROMPT, ("vision", False), ("audio", False))
            + (_PROMPT, _TARGET) * MAX_VQA_TURNS,
            _VQA,
            optional={"audio": "p_spoken_question"},  # a spoken first question
        ),
        Task("asr", (_PROMPT, ("audio", False), _TARGET), _ASR),
        Task("spoken_qa", (_PROMPT, ("audio", False), _PROMPT, _TARGET), _SPOKEN_QA),
        Task("chat", (_PROMPT,) + (_PROMPT, _TARGET) * MAX_CHAT_TURNS, _CHAT),
    )
}
"""The task table, name -> row, in draw order. Extend it with :func:`register_task`."""
PAPER_MIX = tuple(TASKS)  # the tasks drawn by _draw_paper_mix


def register_task(task: Task) -> Task:
    """Add a task with its own ``draw`` to :data:`TASKS` (in every process that draws it).

    Raises:
        ValueError: the name is taken, ``draw`` is missing, or a run names no modality.
    """
    if task.name in TASKS:
        raise ValueError(f"task {task.name!r} is already in the table {list(TASKS)}")
    if task.draw is None:
        raise ValueError(f"task {task.name!r} needs a draw function")
    task.kinds()  # every run names text or a modality of the table
    TASKS[task.name] = task
    return task


def unregister_task(name: str) -> None:
    """Remove a task added with :func:`register_task`.

    Raises:
        ValueError: ``name`` is not a registered task (the paper's mix stays).
    """
    if name not in TASKS or name in PAPER_MIX:
        raise ValueError(
            f"no registered task {name!r}; registered: {[t for t in TASKS if t not in PAPER_MIX]}"
        )
    del TASKS[name]


def default_mix() -> dict[str, float]:
    """Every task's default weight."""
    return {t.name: t.weight for t in TASKS.values()}


@dataclass(frozen=True)
class RecipeConfig:
    """Everything that shapes an example's lengths, except the model's encoding rates."""

    task_weights: Mapping[str, float] = field(default_factory=default_mix)
    patch: int = workloads.PATCH
    max_image_side: int = workloads.MAX_IMAGE_SIDE
    max_audio_s: float = 30.0  # Whisper's window
    max_text_tokens: int = 2048
    scale: float = 1.0  # multiplies every length, so a tiny config keeps the composition
    p_multi_image: float = fact("mix.p_multi_image")
    p_spoken_question: float = fact("mix.p_spoken_question")

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
            raise ValueError(
                f"task_weights has unknown tasks {sorted(unknown)}; known: {list(TASKS)}"
            )
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


def run_fields(data: DataConfig, model: ModelConfig) -> dict[str, Any]:
    """The :class:`RecipeConfig` fields a run config sets: its ``data:`` section, and the patch
    side of the vision encoder that sees the paper mix's images."""
    vision = model.encoders.get("vision")
    return {
        **({} if data.mix is None else {"task_weights": dict(data.mix)}),
        **({} if vision is None else {"patch": vision.patch}),
        "max_image_side": data.max_image_side,
        "max_audio_s": float(data.max_audio_s),
        "max_text_tokens": data.max_text_tokens,
        "scale": float(data.scale),
        "p_multi_image": float(data.p_multi_image),
        "p_spoken_question": float(data.p_spoken_question),
    }


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
    """The lengths of ``n`` examples, in the simulator's units (raw patches, mel frames...).

    Attributes:
        tasks: the task table the examples were drawn from (:data:`TASKS` then).
        task: int64 ``[n]``, index into ``tasks``.
        text: int64 ``[n]``, text tokens.
        items: modality name -> its items (every row of the modality table, empty where no
            example holds one).
        weights: task name -> float64 ``[examples of the task, len(task.runs)]``: per column a
            text run's raw length or 1 for an item, 0 where the example lacks the run.
    """

    tasks: tuple[Task, ...]
    task: np.ndarray
    text: np.ndarray
    items: Mapping[str, ItemLengths]
    weights: Mapping[str, np.ndarray] = field(repr=False)

    def runs(self, i: int) -> list[tuple[int, int, bool]]:
        """Example ``i`` in order as ``(kind, count, is_target)``: text counts sum to
        ``text[i]`` (:func:`split_text`), items are its items in order."""
        task = self.tasks[int(self.task[i])]
        row = self.weights[task.name][np.count_nonzero(self.task[:i] == self.task[i])]
        kinds, is_target = task.kinds(), task.is_target()
        counts = np.zeros(row.size, dtype=np.int64)
        text = np.flatnonzero((row > 0) & (kinds == TEXT))
        counts[text] = split_text(int(self.text[i]), row[text], is_target[text])
        for m in MODALITIES.values():
            items = self.items[m.name]
            lo, hi = np.searchsorted(items.example, [i, i + 1])
            counts[(row > 0) & (kinds == m.kind)] = items.raw[lo:hi]
        return [(int(kinds[c]), int(counts[c]), bool(is_target[c])) for c in np.flatnonzero(counts)]


def _lognormal(rng: np.random.Generator, median: str, sigma: str, shape) -> np.ndarray:
    """Log-normal draws with the median and sigma of two table entries."""
    return fact(median) * np.exp(fact(sigma) * rng.standard_normal(shape))


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
    """``n`` i.i.d. examples of ``cfg``'s mix; every item's raw rows are a multiple of its
    modality's divisor in ``rates``. ``rng`` is a generator or a seed for
    ``numpy.random.default_rng``."""
    if not isinstance(n, int | np.integer) or n < 0:
        raise ValueError(f"n must be an integer >= 0, got {n!r}")
    gen = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    task = gen.choice(len(TASKS), size=n, p=cfg.task_probs)
    own = {name: np.flatnonzero(task == k) for k, name in enumerate(TASKS)}
    text = np.zeros(n)
    weights: dict[str, np.ndarray] = {}
    pieces: dict[str, list[ItemLengths]] = {m: [] for m in MODALITIES}
    _draw_paper_mix(gen, own, cfg, rates, text=text, weights=weights, pieces=pieces)
    for t in TASKS.values():
        if t.draw is not None:
            _draw_task(t, gen, own[t.name], cfg, rates, text=text, weights=weights, pieces=pieces)
    text = np.clip(np.round(text * cfg.scale), MIN_TEXT, cfg.max_text_tokens).astype(np.int64)
    return Examples(
        tasks=tuple(TASKS.values()),
        task=task.astype(np.int64),
        text=text,
        items={m: _by_example(p) for m, p in pieces.items()},
        weights=weights,
    )


def _by_example(pieces: list[ItemLengths]) -> ItemLengths:
    """One modality's items from several draws, ordered by owning example (stable)."""
    example = np.concatenate([p.example for p in pieces] or [np.zeros(0, np.int64)])
    raw = np.concatenate([p.raw for p in pieces] or [np.zeros(0, np.int64)])
    order = np.argsort(example, kind="stable")
    return ItemLengths(example[order].astype(np.int64), raw[order].astype(np.int64))


def _draw_task(
    task: Task,
    gen: np.random.Generator,
    examples: np.ndarray,
    cfg: RecipeConfig,
    rates: EncodingRates,
    *,
    text: np.ndarray,
    weights: dict[str, np.ndarray],
    pieces: dict[str, list[ItemLengths]],
) -> None:
    """A registered task's draw, read into the shared arrays: text is the sum of its text
    runs, items are scaled like the paper mix's (down to a multiple of the divisor)."""
    lengths = np.asarray(task.draw(gen, examples.size, cfg).lengths, dtype=np.float64)
    if lengths.shape != (examples.size, len(task.runs)) or np.any(lengths < 0):
        raise ValueError(
            f"task {task.name!r}: draw must return lengths >= 0 of shape "
            f"{(examples.size, len(task.runs))}, got {lengths.shape}"
        )
    kinds = task.kinds()
    is_text = kinds == TEXT
    text[examples] = lengths[:, is_text].sum(axis=1)
    weights[task.name] = np.where(is_text[None, :], lengths, lengths > 0)
    for m in MODALITIES.values():
        rows, cols = np.nonzero(lengths * (kinds == m.kind)[None, :])  # row-major: in order
        raw = _scaled(lengths[rows, cols], cfg.scale, rates.divisor(m.kind))
        pieces[m.name].append(ItemLengths(examples[rows], raw))


def _draw_paper_mix(
    gen: np.random.Generator,
    own: Mapping[str, np.ndarray],
    cfg: RecipeConfig,
    rates: EncodingRates,
    *,
    text: np.ndarray,
    weights: dict[str, np.ndarray],
    pieces: dict[str, list[ItemLengths]],
) -> None:
    """The five tasks of the paper's mix (module docstring), in their historical draw order."""
    # images: one per caption/vqa example, a second for some vqa examples
    vqa = own["vqa"]
    second = vqa[gen.random(vqa.size) < cfg.p_multi_image]
    image_example = np.sort(np.concatenate([own["caption"], vqa, second]))
    patches = workloads.sample_lengths(
        "llava_image", image_example.size, gen, max_image_side=cfg.max_image_side, patch=cfg.patch
    )
    image_patches = _scaled(patches, cfg.scale, rates.divisor(MODALITIES["vision"].kind))

    # audio: LibriSpeech for asr, AIR-Bench for spoken_qa, a short spoken question for some vqa
    spoken = vqa[gen.random(vqa.size) < cfg.p_spoken_question]
    asr_frames = workloads.sample_lengths("librispeech", own["asr"].size, gen)
    qa_frames = workloads.sample_lengths("spoken_qa", own["spoken_qa"].size, gen)
    question_s = gen.uniform(*fact("vqa.spoken_question_s"), spoken.size)
    audio_example = np.concatenate([own["asr"], own["spoken_qa"], spoken])
    frames = np.concatenate(
        [asr_frames, qa_frames, np.round(question_s * workloads.FRAMES_PER_S).astype(np.int64)]
    )
    frames = np.minimum(frames, int(cfg.max_audio_s * workloads.FRAMES_PER_S))
    order = np.argsort(audio_example, kind="stable")
    audio_frames = _scaled(frames[order], cfg.scale, rates.divisor(MODALITIES["audio"].kind))
    pieces["vision"].append(ItemLengths(image_example, image_patches))
    pieces["audio"].append(ItemLengths(audio_example[order], audio_frames))

    # text, and each task's runs (its row of TASKS)
    k = own["caption"]
    one = np.ones(k.size)
    brief = gen.random(k.size) < fact("caption.brief_share")
    answer = np.where(
        brief,
        _lognormal(gen, "caption.brief_median_tokens", "caption.brief_sigma", k.size),
        _lognormal(gen, "caption.detailed_median_tokens", "caption.detailed_sigma", k.size),
    )
    prefix = gen.integers(*fact("caption.prefix_tokens"), k.size)
    prompt = gen.integers(*fact("caption.prompt_tokens"), k.size)
    text[k] = prefix + prompt + answer
    weights["caption"] = np.column_stack([prefix, one, prompt, answer])

    k = vqa
    turns = 1 + np.minimum(MAX_VQA_TURNS - 1, gen.poisson(fact("vqa.turns_poisson_mean"), k.size))
    short = gen.random(k.size) < fact("vqa.short_share")
    dialogue_shape = (k.size, MAX_VQA_TURNS)
    questions = _lognormal(gen, "vqa.question_median_tokens", "vqa.question_sigma", dialogue_shape)
    has_clip = np.isin(k, spoken)
    questions[:, 0] *= ~has_clip  # a spoken first question has no text
    answers = np.where(
        short[:, None],
        gen.integers(*fact("vqa.short_answer_tokens"), dialogue_shape),
        _lognormal(gen, "vqa.long_answer_median_tokens", "vqa.long_answer_sigma", dialogue_shape),
    )
    used = np.arange(MAX_VQA_TURNS)[None, :] < turns[:, None]
    prefix = gen.integers(*fact("vqa.prefix_tokens"), k.size)
    text[k] = prefix + ((questions + answers) * used).sum(axis=1)
    has_second = np.isin(k, second)
    bridge = np.zeros(k.size)
    bridge[has_second] = gen.integers(*fact("vqa.bridge_tokens"), second.size)
    text[second] += bridge[has_second]
    dialogue = np.stack([questions * used, answers * used], axis=2)  # q0, a0, q1, a1, ...
    runs = [prefix, np.ones(k.size), bridge, has_second, has_clip]  # image, image, clip: 0/1
    weights["vqa"] = np.column_stack([*runs, dialogue.reshape(k.size, 2 * MAX_VQA_TURNS)])

    k = own["asr"]
    prefix = gen.integers(*fact("asr.prompt_tokens"), k.size)
    seconds = asr_frames / workloads.FRAMES_PER_S
    words = seconds * fact("asr.words_per_s")
    noise = np.exp(fact("asr.noise_sigma") * gen.standard_normal(k.size))
    transcript = words * fact("asr.tokens_per_word") * noise
    text[k] = prefix + transcript
    weights["asr"] = np.column_stack([prefix, np.ones(k.size), transcript])

    k = own["spoken_qa"]
    short = gen.random(k.size) < fact("spoken_qa.choice_share")
    prefix = gen.integers(*fact("spoken_qa.prompt_tokens"), k.size)
    question = _lognormal(
        gen, "spoken_qa.question_median_tokens", "spoken_qa.question_sigma", k.size
    )
    answer = np.where(
        short,
        gen.integers(*fact("spoken_qa.choice_answer_tokens"), k.size),
        _lognormal(
            gen, "spoken_qa.chat_answer_median_tokens", "spoken_qa.chat_answer_sigma", k.size
        ),
    )
    text[k] = prefix + question + answer
    weights["spoken_qa"] = np.column_stack([prefix, np.ones(k.size), question, answer])

    k = own["chat"]
    prefix = gen.integers(*fact("chat.prefix_tokens"), k.size)
    body = workloads.sample_lengths("text", k.size, gen)
    text[k] = prefix + body
    # drawn last (layout only): 1-8 turn pairs share the body, a flat Dirichlet
    pairs = gen.integers(1, MAX_CHAT_TURNS + 1, k.size)
    shares = gen.standard_exponential((k.size, 2 * MAX_CHAT_TURNS))
    shares *= np.arange(2 * MAX_CHAT_TURNS)[None, :] < 2 * pairs[:, None]
    shares *= body[:, None] / shares.sum(axis=1, keepdims=True)
    weights["chat"] = np.column_stack([prefix, shares])
