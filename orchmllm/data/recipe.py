"""The per-task example recipe: which items an example holds and how long each part is.

One vectorised draw gives many examples at once (numpy only, 10^5 examples in well under a
second). It is the single source of these lengths: the simulator (:mod:`orchmllm.sim.workload`)
reads a step's global batch from it, and the synthetic dataset (:mod:`orchmllm.data.synthetic`)
draws its examples' lengths from it and only fills tensors (token ids, patches, mels).

Item lengths come from :mod:`orchmllm.data.workloads` (LLaVA-1.5 images, LibriSpeech, AIR-Bench,
ShareGPT) and every other number from the table :data:`orchmllm.data.workload_facts.FACTS`, each
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

Beyond the paper's mix, ``document`` (weight 0: drawn only where a config names it) is a long
text: a short prompt and a continuation of ``min_tokens``-``max_tokens`` tokens (log-uniform,
before ``scale``), the long items that context parallelism splits (issue 40). A config that
draws it raises ``max_text_tokens`` to let them through.

Rules settled where the simulator and the synthetic generator used to differ (the simulator's
rule in each case, so the simulator's figures did not move):

- Patch grid: ``ceil(round(side * shrink) / patch)`` per side at full resolution (whole pixels;
  a partial border patch counts), then ``scale`` multiplies the patch count, rounded down to a
  multiple of the vision downsample (at least one). Not: a grid of ``round(side / patch)``
  with ``sqrt(scale)`` per side.
- OCR-VQA covers: long side log-normal median 350 px, sigma 0.25, clipped to [150, 800] px
  (:mod:`orchmllm.data.workloads`). Not: sigma 0.3 unclipped.
- Audio frames: ``round(seconds * 100)`` (the LibriSpeech mixture clipped as a whole to
  [1, 24.5] s), capped at ``max_audio_s``, then times ``scale`` rounded down to a multiple of the
  frames per LLM token (at least one). Not: ``int(seconds * 100 * scale)``.
- Text: an example's runs are summed, times ``scale``, rounded, and clipped to
  [2, ``max_text_tokens``]: the cap bounds the whole example (not each run, which let a chat
  exceed it). The floor is 2 (the simulator's was 1) so an example always has a prompt token at
  position 0 and a target; at ``scale`` 1 no text is below 12 tokens, so this never binds there.
  :func:`split_text` then shares the total among the runs.
- Each task owns its settings (its :class:`TaskParams`, a run config's ``data.tasks.<name>``):
  its weight, and for the paper's tasks the image bound ``max_image_side`` (caption, vqa), the
  clip cap ``max_audio_s`` (asr, spoken_qa, vqa's spoken question) and vqa's ``p_multi_image``
  and ``p_spoken_question``, defaulting to the table's.

Tasks are rows of :data:`TASKS`. The five above are the paper's mix, drawn together by one
function; :func:`register_task` adds a task with its own params class and draw (e.g. one that
holds a modality added to :data:`orchmllm.schema.MODALITIES`, from a plugin), drawn after
them, and only where a recipe names it.

Random stream: one :class:`numpy.random.Generator` per draw, consumed in a fixed order (task,
images, audio, then text per task of the paper's mix, the chat turn split last, then each
registered task in table order), so the lengths of ``n`` examples for a seed never depend on
the chat split, and a registered task with weight 0 changes nothing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import orchmllm.data.workloads as workloads
from orchmllm.data.workload_facts import fact
from orchmllm.schema import MODALITIES, TEXT, EncodingRates, modality_named

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


def _check_number(where: str, value: object, *, lo: float, hi: float = math.inf) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float | np.number):
        raise ValueError(f"{where} must be a number, got {value!r}")
    if not (lo <= value <= hi and math.isfinite(value)):
        raise ValueError(f"{where} must be in [{lo}, {hi}], got {value!r}")


@dataclass(frozen=True)
class TaskParams:
    """A task's own settings, a config's ``data.tasks.<name>`` section: its weight in the mix
    (normalised over the tasks a config names) and whatever a subclass adds for its draw.

    A subclass checks its own fields in ``check``, which the recipe calls with the section's
    path.
    """

    weight: float = 0.0

    def check(self, path: str) -> None:
        """Raise ``ValueError`` naming ``path.<field>`` for a bad value."""
        _check_number(f"{path}.weight", self.weight, lo=0.0)


def _check_side(path: str, value: object) -> None:
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{path}.max_image_side must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class CaptionParams(TaskParams):
    """``caption``: ``max_image_side``, the dynamic-resolution bound of its image in pixels."""

    max_image_side: int = workloads.MAX_IMAGE_SIDE

    def check(self, path: str) -> None:
        super().check(path)
        _check_side(path, self.max_image_side)


@dataclass(frozen=True)
class ClipParams(TaskParams):
    """A task with one clip (``asr``, ``spoken_qa``): ``max_audio_s``, its clips' longest
    duration in seconds (longer ones are capped; 30: Whisper's window)."""

    max_audio_s: float = 30.0

    def check(self, path: str) -> None:
        super().check(path)
        _check_number(f"{path}.max_audio_s", self.max_audio_s, lo=1.0 / workloads.FRAMES_PER_S)


@dataclass(frozen=True)
class VqaParams(TaskParams):
    """``vqa``: its images' bound (``max_image_side``), ``p_multi_image`` that an example
    holds a second image, ``p_spoken_question`` that its first question is a clip (0 for a
    model without audio) and that clip's cap ``max_audio_s``."""

    max_image_side: int = workloads.MAX_IMAGE_SIDE
    p_multi_image: float = fact("mix.p_multi_image")
    p_spoken_question: float = fact("mix.p_spoken_question")
    max_audio_s: float = 30.0

    def check(self, path: str) -> None:
        super().check(path)
        _check_side(path, self.max_image_side)
        for name in ("p_multi_image", "p_spoken_question"):
            _check_number(f"{path}.{name}", getattr(self, name), lo=0.0, hi=1.0)
        _check_number(f"{path}.max_audio_s", self.max_audio_s, lo=1.0 / workloads.FRAMES_PER_S)


Draw = Callable[[np.random.Generator, int, Any], TaskDraw]


@dataclass(frozen=True)
class Task:
    """One task of the recipe.

    Attributes:
        name: the ``task`` string of its examples, and its config section
            ``data.tasks.<name>``.
        runs: its examples' runs in order: ``("text", is_target)`` or ``(modality name,
            False)``; an example fills a subset of them.
        params: its settings' defaults (a :class:`TaskParams`, or a subclass of it with the
            task's own fields); a config's section is laid on them.
        draw: how a registered task draws its examples' lengths, called
            ``draw(generator, n, params)`` with the run's params of the task (None: the
            paper's mix, drawn together by this module).
        optional: modality -> the field of ``params`` that is the probability an example
            holds it; a modality whose probability is 0 is never held.
    """

    name: str
    runs: tuple[Run, ...]
    params: TaskParams = field(default_factory=TaskParams)
    draw: Draw | None = None
    optional: Mapping[str, str] = field(default_factory=dict)

    @property
    def weight(self) -> float:
        """Its default weight."""
        return float(self.params.weight)

    def kinds(self) -> np.ndarray:
        """The segment kind of each run.

        Returns:
            int ``[len(runs)]``.

        Raises:
            ValueError: a run names no modality of the table.
        """
        return np.array([TEXT if k == "text" else modality_named(k).kind for k, _ in self.runs])

    def is_target(self) -> np.ndarray:
        """Whether each run is a prediction target.

        Returns:
            bool ``[len(runs)]``.
        """
        return np.array([t for _, t in self.runs], dtype=bool)

    def modalities(self, params: TaskParams) -> set[str]:
        """The modalities its examples can hold.

        Args:
            params: its settings in a recipe (an optional modality with probability 0 is
                never held).

        Returns:
            The modality names.
        """
        held = {k for k, _ in self.runs if k != "text"}
        return {m for m in held if getattr(params, self.optional.get(m, ""), 1) > 0}


_CAPTION, _VQA, _ASR, _SPOKEN_QA, _CHAT = fact("mix.weights")
TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task(
            "caption",
            (_PROMPT, ("vision", False), _PROMPT, _TARGET),
            CaptionParams(_CAPTION),
        ),
        Task(
            "vqa",
            (_PROMPT, ("vision", False), _PROMPT, ("vision", False), ("audio", False))
            + (_PROMPT, _TARGET) * MAX_VQA_TURNS,
            VqaParams(_VQA),
            optional={"audio": "p_spoken_question"},  # a spoken first question
        ),
        Task("asr", (_PROMPT, ("audio", False), _TARGET), ClipParams(_ASR)),
        Task("spoken_qa", (_PROMPT, ("audio", False), _PROMPT, _TARGET), ClipParams(_SPOKEN_QA)),
        Task("chat", (_PROMPT,) + (_PROMPT, _TARGET) * MAX_CHAT_TURNS, TaskParams(_CHAT)),
    )
}
"""The task table, name -> row, in draw order. Extend it with :func:`register_task`."""
PAPER_MIX = tuple(TASKS)  # the tasks drawn by _draw_paper_mix


@dataclass(frozen=True)
class DocumentParams(TaskParams):
    """``document``: its continuation's token bounds before ``scale`` (log-uniform between
    them); the default, 32k-128k, is the long-context range of current training mixes."""

    min_tokens: int = 32_768
    max_tokens: int = 131_072

    def check(self, path: str) -> None:
        super().check(path)
        for name in ("min_tokens", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{path}.{name} must be a positive integer, got {value!r}")
        if self.max_tokens < self.min_tokens:
            raise ValueError(
                f"{path}.max_tokens must be >= min_tokens {self.min_tokens}, got {self.max_tokens}"
            )


def _draw_document(gen: np.random.Generator, n: int, params: DocumentParams) -> TaskDraw:
    """A prompt of ``chat.prefix_tokens`` and a log-uniform continuation (its target)."""
    prompt = gen.integers(*fact("chat.prefix_tokens"), size=n, endpoint=True)
    lo, hi = np.log(params.min_tokens), np.log(params.max_tokens)
    body = np.exp(gen.uniform(lo, hi, size=n))
    return TaskDraw(np.stack([prompt.astype(np.float64), body], axis=1))


def register_task(task: Task) -> Task:
    """Add a task with its own ``draw`` to :data:`TASKS` (in every process that draws it).

    Registering the same row again is a no-op. A config draws it only where it names it
    (``data.tasks.<name>``), so registering one changes no existing config.

    Args:
        task: the new row, with its ``draw`` and its params' defaults.

    Returns:
        ``task``.

    Raises:
        ValueError: the name is taken, ``draw`` is missing, ``params`` is no
            :class:`TaskParams`, or a run names no modality.
    """
    if TASKS.get(task.name) == task:
        return task
    if task.name in TASKS:
        raise ValueError(f"task {task.name!r} is already in the table {list(TASKS)}")
    if task.draw is None:
        raise ValueError(f"task {task.name!r} needs a draw function")
    if not isinstance(task.params, TaskParams):
        raise ValueError(f"task {task.name!r}: params must be a TaskParams, got {task.params!r}")
    task.kinds()  # every run names text or a modality of the table
    TASKS[task.name] = task
    return task


def unregister_task(name: str) -> None:
    """Remove a task added with :func:`register_task`.

    Raises:
        ValueError: ``name`` is not a registered task (the built-in ones stay).
    """
    if name not in TASKS or name in BUILT_IN:
        raise ValueError(
            f"no registered task {name!r}; registered: {[t for t in TASKS if t not in BUILT_IN]}"
        )
    del TASKS[name]


register_task(Task("document", (_PROMPT, _TARGET), DocumentParams(), draw=_draw_document))
BUILT_IN = tuple(TASKS)  # the paper's mix and document: unregister_task keeps them


def task_named(name: str) -> Task:
    """The task called ``name``.

    Raises:
        ValueError: none is (the message lists the table).
    """
    if name not in TASKS:
        raise ValueError(f"no task named {name!r}; the table has {list(TASKS)}")
    return TASKS[name]


def default_tasks() -> dict[str, TaskParams]:
    """The tasks a recipe that names none draws: the paper's mix, each with its defaults."""
    return {name: TASKS[name].params for name in PAPER_MIX}


def weighted_tasks(weights: Mapping[str, float]) -> dict[str, TaskParams]:
    """The tasks of ``weights``, each with its default settings and the given weight (a
    recipe's ``tasks``).

    Raises:
        ValueError: a name that is no task.
    """
    return {n: dataclasses.replace(task_named(n).params, weight=w) for n, w in weights.items()}


def default_mix() -> dict[str, float]:
    """The default weight of every task a recipe that names none draws."""
    return {name: float(p.weight) for name, p in default_tasks().items()}


@dataclass(frozen=True)
class RecipeConfig:
    """Everything that shapes an example's lengths, except the model's encoding rates: the
    one recipe class (a run config's ``data:`` section and the synthetic dataset's config
    extend it).

    Attributes:
        tasks: task name -> its :class:`TaskParams` (weight and the task's own settings); a
            task left out is not drawn. Default: the paper's mix (:func:`default_tasks`).
        scale: multiplies every length (patches, frames, tokens), so a tiny config keeps the
            paper's composition.
        max_text_tokens: bound on the text tokens of one example, all its runs together.
        patch: image patch side in pixels (the vision encoder's; a run config sets it from
            ``model.encoders.vision.patch``).
    """

    tasks: Mapping[str, TaskParams] = field(default_factory=default_tasks)
    scale: float = 1.0
    max_text_tokens: int = 2048
    patch: int = workloads.PATCH

    def __post_init__(self) -> None:
        if not isinstance(self.tasks, Mapping):
            raise ValueError(f"tasks must be a mapping of task -> TaskParams, got {self.tasks!r}")
        for name, params in self.tasks.items():
            task = task_named(name)
            if type(params) is not type(task.params):
                raise ValueError(
                    f"tasks.{name} must be a {type(task.params).__name__}, got {params!r}"
                )
            params.check(f"tasks.{name}")
            if isinstance(params, CaptionParams | VqaParams) and params.max_image_side < self.patch:
                raise ValueError(
                    f"tasks.{name}.max_image_side must be >= patch {self.patch}, got "
                    f"{params.max_image_side!r}"
                )
        for name in ("patch", "max_text_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int | np.integer) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_text_tokens < MIN_TEXT:
            raise ValueError(f"max_text_tokens must be >= {MIN_TEXT}, got {self.max_text_tokens!r}")
        if not (self.scale > 0 and math.isfinite(self.scale)):
            raise ValueError(f"scale must be a positive finite number, got {self.scale!r}")
        if sum(p.weight for p in self.tasks.values()) <= 0:
            raise ValueError(f"tasks need a positive total weight, got {dict(self.task_weights)!r}")

    def params(self, name: str) -> TaskParams:
        """Task ``name``'s settings: the recipe's, or its defaults at weight 0 (not drawn)."""
        if name in self.tasks:
            return self.tasks[name]
        return dataclasses.replace(task_named(name).params, weight=0.0)

    @property
    def task_weights(self) -> dict[str, float]:
        """Task name -> weight, of the tasks the recipe draws."""
        return {name: float(p.weight) for name, p in self.tasks.items()}

    def with_weights(self, weights: Mapping[str, float]) -> RecipeConfig:
        """This recipe with the weights of ``weights`` (tasks it names, each keeping its other
        settings; a task it adds gets its defaults)."""
        tasks = dict(self.tasks)
        for name, weight in weights.items():
            tasks[name] = dataclasses.replace(self.params(name), weight=weight)
        return dataclasses.replace(self, tasks=tasks)

    def with_task_settings(self, **settings: Any) -> RecipeConfig:
        """This recipe with each setting set in every task of it that has the field (e.g.
        ``max_audio_s`` in asr, spoken_qa and vqa).

        Raises:
            ValueError: no task of the recipe has one of the settings.
        """
        for key in settings:
            if not any(hasattr(p, key) for p in self.tasks.values()):
                raise ValueError(f"no task of {list(self.tasks)} has a setting {key!r}")
        tasks = {
            name: dataclasses.replace(p, **{k: v for k, v in settings.items() if hasattr(p, k)})
            for name, p in self.tasks.items()
        }
        return dataclasses.replace(self, tasks=tasks)

    @property
    def task_probs(self) -> np.ndarray:
        """Sampling probability of each task in :data:`TASKS` order."""
        weights = np.array([float(self.params(t).weight) for t in TASKS])
        return weights / weights.sum()


def recipe_fields(cfg: RecipeConfig) -> dict[str, Any]:
    """The :class:`RecipeConfig` fields of ``cfg`` (one of its subclasses: a run config's
    ``data:``), to build another subclass from."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(RecipeConfig)}


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
    draw = task.draw(gen, examples.size, cfg.params(task.name))
    lengths = np.asarray(draw.lengths, dtype=np.float64)
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
    vqa, caption_p, vqa_p = own["vqa"], cfg.params("caption"), cfg.params("vqa")
    asr_p, spoken_qa_p = cfg.params("asr"), cfg.params("spoken_qa")
    second = vqa[gen.random(vqa.size) < vqa_p.p_multi_image]
    image_example = np.sort(np.concatenate([own["caption"], vqa, second]))
    sides = np.where(
        np.isin(image_example, own["caption"]), caption_p.max_image_side, vqa_p.max_image_side
    )
    patches = workloads.sample_lengths(
        "llava_image", image_example.size, gen, max_image_side=sides, patch=cfg.patch
    )
    image_patches = _scaled(patches, cfg.scale, rates.divisor(MODALITIES["vision"].kind))

    # audio: LibriSpeech for asr, AIR-Bench for spoken_qa, a short spoken question for some vqa
    spoken = vqa[gen.random(vqa.size) < vqa_p.p_spoken_question]
    asr_frames = workloads.sample_lengths("librispeech", own["asr"].size, gen)
    qa_frames = workloads.sample_lengths("spoken_qa", own["spoken_qa"].size, gen)
    question_s = gen.uniform(*fact("vqa.spoken_question_s"), spoken.size)
    audio_example = np.concatenate([own["asr"], own["spoken_qa"], spoken])
    frames = np.concatenate(
        [asr_frames, qa_frames, np.round(question_s * workloads.FRAMES_PER_S).astype(np.int64)]
    )
    caps = [
        np.full(size, int(p.max_audio_s * workloads.FRAMES_PER_S))
        for size, p in (
            (asr_frames.size, asr_p),
            (qa_frames.size, spoken_qa_p),
            (spoken.size, vqa_p),
        )
    ]
    frames = np.minimum(frames, np.concatenate(caps))
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
