"""Run configs: the model's shapes, the data recipe, the balancing and the training settings.

Plain frozen dataclasses, torch-free, so the simulator and the planner can read shapes without
building a model. A config is checked when it is built, policy and placement names included
(so this module sits on the planner's floor, beside the policy registry it checks them in).

Every key has a default (the model's are the tiny CPU model of ``configs/tiny.yaml``, which also
sets ``data.scale: 0.1`` and ``balance.ranks_per_node: 2``: an empty config is the tiny model on
the paper's full-size lengths), so a YAML file states only what differs, ``base: other.yaml``
inherits another file first, and ``plugins: [my_module, path/to/file.py]`` imports a user's
registrations (:mod:`orchmllm.plugins`) before the rest is checked:

    base: mllm-10b.yaml          # relative to this file
    model:
      llm: {hidden: 5120, layers: 48}
      encoders:
        audio: null              # drop a modality (its encoder, its phase)

Mappings merge key by key; anything else replaces. ``model.encoders`` has one section per row
of the modality table (:data:`orchmllm.schema.MODALITIES`) the model encodes (default:
:data:`DEFAULT_ENCODERS`; a row is encoded only where a config names it), each built by its
``arch`` (:data:`ARCHS`, one folder per architecture in ``orchmllm/models/``; default: the
row's). An unknown key, modality or architecture is an
error that names it and the closest valid one, never a silent default.

The configs ship in the package (``orchmllm/configs/``; the checkout's ``configs/`` links
there), so ``load_config("tiny")`` or ``--config tiny`` finds one from any directory
(:func:`config_path`).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import yaml

from orchmllm.data.recipe import TASKS, RecipeConfig, TaskParams, default_tasks
from orchmllm.models.spec import ARCHS, EncoderConfig, TransformerConfig
from orchmllm.models.vit import VitConfig
from orchmllm.models.whisper import WhisperConfig
from orchmllm.overrides import closest
from orchmllm.planner.balance import PLACEMENTS
from orchmllm.planner.cost import CostModel
from orchmllm.planner.measured_cost import COSTS, cost_kind
from orchmllm.planner.policies import POLICIES
from orchmllm.plugins import load_plugins
from orchmllm.schema import LLM, MODALITIES, EncodingRates, is_integer, modality_named

__all__ = [
    "ARCHS",
    "BalanceConfig",
    "DEFAULT_ENCODERS",
    "DataConfig",
    "EncoderConfig",
    "LLMConfig",
    "ModelConfig",
    "RunConfig",
    "TrainConfig",
    "TrainRecipe",
    "VitConfig",
    "WhisperConfig",
    "config_path",
    "load_config",
    "packaged_configs",
    "run_config",
]


def _fail(path: str, message: str) -> ValueError:
    return ValueError(f"{path} {message}")


def _positive_int(path: str, value: Any) -> None:
    if not is_integer(value) or value < 1:
        raise _fail(path, f"must be a positive integer, got {value!r}")


def _positive_number(path: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise _fail(path, f"must be a positive number, got {value!r}")


def _check_fields(obj: Any, path: str) -> None:
    """Type checks every dataclass field by its annotation: ``int`` (positive), ``float``
    (positive), ``bool``, ``str``; other annotations, and the fields a class lists in
    ``OWN_CHECKS``, are checked by the class itself."""
    for f in dataclasses.fields(obj):
        if f.name in getattr(obj, "OWN_CHECKS", ()):
            continue
        value = getattr(obj, f.name)
        where = f"{path}.{f.name}"
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
        if kind == "int":
            _positive_int(where, value)
        elif kind == "float":
            _positive_number(where, value)
        elif kind == "bool" and not isinstance(value, bool):
            raise _fail(where, f"must be true or false, got {value!r}")
        elif kind == "str" and not isinstance(value, str):
            raise _fail(where, f"must be a string, got {value!r}")


def _unknown_key(path: str, key: str, valid: list[str]) -> ValueError:
    return _fail(path, f"has no key {key!r}; {closest(key, valid)}")


def _build(cls: type, path: str, raw: Any, *, also: tuple[str, ...] = ()) -> Any:
    """``cls(**raw)`` for a config section, naming an unknown key and the closest valid one
    (``also``: keys the caller consumed before)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise _fail(path, f"must be a mapping, got {raw!r}")
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    for key in raw:
        if key not in names:
            raise _unknown_key(path, str(key), [*names, *also])
    obj = cls(**raw)
    _check_fields(obj, path)
    return obj


# -- model -------------------------------------------------------------------------------


@dataclass(frozen=True)
class LLMConfig(TransformerConfig):
    """A Qwen2-style decoder: RMSNorm, RoPE, SwiGLU, grouped-query attention, packed causal."""

    ffn: int = 160
    kv_heads: int = 2
    rope_theta: float = 10000.0


DEFAULT_ENCODERS = ("vision", "audio")
"""The encoders of a config that names none: the tiny model's. A row added to the modality
table is encoded only where a config names it (``model.encoders.<name>: {}``), so adding one
changes no existing config."""


def _default_encoders() -> dict[str, EncoderConfig]:
    """The default model's encoders, each with its row's architecture's defaults."""
    return {name: ARCHS[modality_named(name).arch]() for name in DEFAULT_ENCODERS}


@dataclass(frozen=True)
class ModelConfig:
    """The model: one encoder per modality it encodes, and the LLM.

    Attributes:
        vocab: LLM vocabulary size (text token ids are < vocab).
        encoders: modality name (a row of the modality table) -> its encoder's config, in
            table order; default: :data:`DEFAULT_ENCODERS`, each with its row's
            architecture's defaults.
        llm: the decoder.
    """

    vocab: int = 512
    encoders: Mapping[str, EncoderConfig] = field(default_factory=_default_encoders)
    llm: LLMConfig = field(default_factory=LLMConfig)

    def __post_init__(self) -> None:
        for name, enc in self.encoders.items():
            modality_named(name)
            if not isinstance(enc, EncoderConfig):
                raise _fail(f"model.encoders.{name}", f"must be an encoder config, got {enc!r}")
        order = [n for n in MODALITIES if n in self.encoders]  # table order, the phase order
        object.__setattr__(self, "encoders", {n: self.encoders[n] for n in order})

    @property
    def rates(self) -> EncodingRates:
        """Raw rows per LLM token of every encoder."""
        return EncodingRates({name: enc.rate for name, enc in self.encoders.items()})

    @property
    def feature_dims(self) -> dict[str, int]:
        """Raw row width per modality: what an encoder phase moves per raw row."""
        return {name: enc.feature_dim for name, enc in self.encoders.items()}

    @classmethod
    def from_dict(cls, raw: Any, path: str = "model") -> ModelConfig:
        """Validate and build from the ``model:`` mapping of a run config.

        Raises:
            ValueError: an unknown key, modality or architecture (naming the closest valid
                one), or a value of the wrong type or shape.
        """
        raw = dict(raw or {})
        for key in raw:
            if key not in ("vocab", "encoders", "llm"):
                raise _unknown_key(path, str(key), ["vocab", "encoders", "llm"])
        encoders = {}
        sections = raw.pop("encoders", None) or {}
        if not isinstance(sections, Mapping):
            raise _fail(f"{path}.encoders", f"must be a mapping, got {sections!r}")
        # Laid on the default encoders: a section changes or adds its row, null drops it.
        for name, section in merge(dict.fromkeys(DEFAULT_ENCODERS, {}), sections).items():
            where = f"{path}.encoders.{name}"
            if name not in MODALITIES:
                raise _unknown_key(f"{path}.encoders", str(name), list(MODALITIES))
            if section is None:  # dropped by a derived config
                continue
            section = dict(section)
            arch = section.pop("arch", MODALITIES[name].arch)
            if arch not in ARCHS:
                raise _fail(
                    f"{where}.arch", f"{arch!r} is unknown; {closest(str(arch), list(ARCHS))}"
                )
            encoders[name] = _build(ARCHS[arch], where, section, also=("arch",))
            encoders[name].check(where)
        llm = _build(LLMConfig, f"{path}.llm", raw.pop("llm", None))
        llm.check(f"{path}.llm")
        config = cls(encoders=encoders, llm=llm, **raw)
        _positive_int(f"{path}.vocab", config.vocab)
        return config


# -- data, balance, train ----------------------------------------------------------------


# Keys of ``data:`` that moved into their tasks' sections (each task owns its settings).
MOVED_DATA_KEYS = {
    "mix": "data.tasks.<task>.weight",
    "max_image_side": "data.tasks.caption.max_image_side and data.tasks.vqa.max_image_side",
    "max_audio_s": "data.tasks.<asr, spoken_qa, vqa>.max_audio_s",
    "p_multi_image": "data.tasks.vqa.p_multi_image",
    "p_spoken_question": "data.tasks.vqa.p_spoken_question",
}


@dataclass(frozen=True)
class DataConfig(RecipeConfig):
    """A run's data: the example recipe (:class:`orchmllm.data.recipe.RecipeConfig`: its tasks,
    each with its own settings, ``scale`` and ``max_text_tokens``; ``patch`` is the vision
    encoder's) and the mini-batch size.

    Attributes:
        examples_per_rank: mini-batch size of every data-parallel rank per step.
    """

    OWN_CHECKS: ClassVar[tuple[str, ...]] = ("tasks",)

    examples_per_rank: int = 8

    @classmethod
    def from_dict(cls, raw: Any, path: str = "data", *, patch: int | None = None) -> DataConfig:
        """Validate and build from the ``data:`` mapping of a run config.

        ``tasks: {name: {weight, ...}}`` names the tasks drawn (default: the paper's mix),
        each section laid on its task's defaults (``null`` drops a task a base config names).

        Args:
            raw: the mapping.
            path: its place in the config, for errors.
            patch: the vision encoder's patch side (None: the default).

        Raises:
            ValueError: a key that moved into a task (naming its new place), an unknown key or
                task (naming the closest valid one), or a bad value.
        """
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise _fail(path, f"must be a mapping, got {raw!r}")
        raw = dict(raw)
        for key, place in MOVED_DATA_KEYS.items():
            if key in raw:
                raise _fail(f"{path}.{key}", f"moved to {place} (each task owns its settings)")
        if "patch" in raw:
            raise _fail(f"{path}.patch", "is the vision encoder's: set model.encoders.vision.patch")
        sections = raw.pop("tasks", None)
        tasks = default_tasks() if sections is None else _tasks(f"{path}.tasks", sections)
        names = [f.name for f in dataclasses.fields(cls) if f.name not in ("tasks", "patch")]
        for key in raw:
            if key not in names:
                raise _unknown_key(path, str(key), [*names, "tasks"])
        try:
            data = cls(tasks=tasks, **({} if patch is None else {"patch": patch}), **raw)
        except ValueError as exc:
            raise ValueError(f"{path}.{exc}") from None
        _check_fields(data, path)
        return data


def _tasks(path: str, sections: Any) -> dict[str, TaskParams]:
    """``data.tasks``: each named task's settings laid on its defaults."""
    if not isinstance(sections, Mapping):
        raise _fail(path, f"must be a mapping of task -> settings, got {sections!r}")
    tasks = {}
    for name, section in sections.items():
        if name not in TASKS:
            raise _unknown_key(path, str(name), list(TASKS))
        if section is None:  # dropped by a derived config
            continue
        if not isinstance(section, Mapping):
            raise _fail(f"{path}.{name}", f"must be a mapping, got {section!r}")
        default = TASKS[name].params
        valid = [f.name for f in dataclasses.fields(default)]
        for key in section:
            if key not in valid:
                raise _unknown_key(f"{path}.{name}", str(key), valid)
        tasks[name] = dataclasses.replace(default, **section)
    return tasks


@dataclass(frozen=True)
class BalanceConfig:
    """How each phase is balanced (the trainer's ``--balance``/``--placement`` override it).

    Attributes:
        policies: phase name (a modality or ``llm``) -> a policy name in
            ``orchmllm.POLICIES``; a phase left out gets its tailored policy (the modality
            row's; ``greedy`` for the LLM).
        placement: ``none``, ``assign``, ``ilp`` or ``auto`` (node-wise placement).
        ranks_per_node: None: ``LOCAL_WORLD_SIZE`` from the launcher.
        costs: phase name -> ``{alpha, beta, const}`` of its cost model, in the form its
            policy balances (packed or padded, :class:`orchmllm.planner.cost.CostModel`); a
            phase left out balances its policy's default cost.
        cost: ``default``: plan with ``costs`` throughout; ``measured``: time every phase in
            the first ``calibrate_steps`` steps, fit each phase's cost to the times of all
            ranks and plan with the fits (:mod:`orchmllm.dist.calibrator`; the trainer's
            ``--cost``).
        calibrate_steps: with ``cost: measured``, the steps timed.
        calibrate_every: with ``cost: measured``, refit every this many timed steps.
        min_r2: with ``cost: measured``, a fit explaining less of the times (R^2) keeps the
            phase's cost as it was.
        context_parallel: N > 1 lets a phase split an item over up to N ranks of one group
            of N consecutive ranks (context parallelism, the trainer's ``--context-parallel``):
            an item whose cost exceeds the phase's ``max_load``, or whose split lowers the
            slowest rank; its keys and values are gathered inside the group. The LLM phase
            splits examples; an encoder phase with a packed LPT policy (greedy, e.g. vision)
            splits its items into whole merged tokens; a padded one (audio) keeps them whole.
            Needs ``placement: none``; N divides the ranks per node (or is a multiple of them).
        max_load: with ``context_parallel``, phase name -> a rank's budget in the phase's cost
            units (the default packed cost: tokens for ``llm``, patches for ``vision``); a
            phase left out splits only where it lowers the slowest rank.
    """

    OWN_CHECKS: ClassVar[tuple[str, ...]] = ("min_r2",)

    policies: Mapping[str, str] = field(default_factory=dict)
    placement: str = "auto"
    ranks_per_node: int | None = None
    costs: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    cost: str = "default"
    calibrate_steps: int = 8
    calibrate_every: int = 2
    min_r2: float = 0.5
    context_parallel: int = 1
    max_load: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.policies, Mapping):
            raise _fail("balance.policies", f"must be a mapping, got {self.policies!r}")
        for name, policy in self.policies.items():
            if name != LLM and name not in MODALITIES:
                raise _unknown_key("balance.policies", str(name), [*MODALITIES, LLM])
            if policy not in POLICIES:
                raise _fail(
                    f"balance.policies.{name}",
                    f"{policy!r} is no policy; {closest(str(policy), list(POLICIES))}",
                )
        if self.placement not in PLACEMENTS:
            hint = closest(str(self.placement), list(PLACEMENTS))
            raise _fail("balance.placement", f"{self.placement!r} is no placement; {hint}")
        if self.ranks_per_node is not None:
            _positive_int("balance.ranks_per_node", self.ranks_per_node)
        if self.cost not in COSTS:
            raise _fail(
                "balance.cost", f"{self.cost!r} is no cost; {closest(str(self.cost), list(COSTS))}"
            )
        if not 0.0 <= self.min_r2 <= 1.0:
            raise _fail("balance.min_r2", f"must be in [0, 1], got {self.min_r2!r}")
        _positive_int("balance.context_parallel", self.context_parallel)
        if self.context_parallel > 1 and self.placement != "none":
            raise _fail(
                "balance.placement",
                f"must be 'none' with balance.context_parallel={self.context_parallel} (pieces "
                f"are placed in their group, not node-wise), got {self.placement!r}: set it "
                "(--placement none)",
            )
        if not isinstance(self.max_load, Mapping):
            raise _fail(
                "balance.max_load", f"must be a mapping of phase -> budget, got {self.max_load!r}"
            )
        if self.max_load and self.context_parallel == 1:
            raise _fail(
                "balance.max_load",
                f"is a budget for splitting: set balance.context_parallel > 1 (got "
                f"{dict(self.max_load)!r} with context_parallel=1)",
            )
        for name, budget in self.max_load.items():
            if name != LLM and name not in MODALITIES:
                raise _unknown_key("balance.max_load", str(name), [*MODALITIES, LLM])
            if isinstance(budget, bool) or not isinstance(budget, int | float) or budget <= 0:
                raise _fail(f"balance.max_load.{name}", f"must be a number > 0, got {budget!r}")
        if not isinstance(self.costs, Mapping):
            raise _fail("balance.costs", f"must be a mapping, got {self.costs!r}")
        for name in self.costs:
            if name != LLM and name not in MODALITIES:
                raise _unknown_key("balance.costs", str(name), [*MODALITIES, LLM])
            self.cost_model(name)

    def policy(self, phase: str) -> str:
        """The policy of ``phase``: configured, else tailored."""
        default = "greedy" if phase == LLM else modality_named(phase).policy
        return self.policies.get(phase, default)

    def cost_model(self, phase: str) -> CostModel | None:
        """The configured cost of ``phase`` in its policy's form (None: the policy's default).

        Raises:
            ValueError: a key other than alpha, beta and const, or a value the cost model
                refuses, naming ``balance.costs.<phase>``.
        """
        terms = self.costs.get(phase)
        if terms is None:
            return None
        where = f"balance.costs.{phase}"
        if not isinstance(terms, Mapping):
            raise _fail(where, f"must be a mapping of alpha, beta, const, got {terms!r}")
        for key in terms:
            if key not in ("alpha", "beta", "const"):
                raise _unknown_key(where, str(key), ["alpha", "beta", "const"])
        try:
            return CostModel(cost_kind(self.policy(phase)), **terms)
        except (TypeError, ValueError) as exc:
            raise _fail(where, str(exc)) from None


@dataclass(frozen=True)
class TrainConfig:
    """The training loop's settings (the trainer's ``--steps``, ``--seed`` and
    ``--grad-accum`` override them).

    Attributes:
        steps: optimizer steps.
        lr: AdamW's learning rate.
        weight_decay: AdamW's decoupled weight decay (>= 0). A parameter without a gradient in
            a step (a tower no rank had an item for) is not decayed, as in a plain run.
        seed: model and data seed (>= 0).
        grad_accum: micro-steps per optimizer step, each a balanced step of
            ``data.examples_per_rank`` examples per rank (:func:`orchmllm.data.accumulate`).
        sync_micro_steps: with ``grad_accum > 1``, reduce-scatter the gradients after every
            micro-step (memory of one micro-step), or, when false, only after the last: one
            reduce-scatter a step, but between micro-steps every rank holds the whole model's
            unsharded gradients (for a model small next to its accelerator's memory).
        max_skipped_steps: with ``--on-nonfinite skip``, the run stops (an error naming the
            count and the first skipped step) after this many consecutive skipped steps: a
            diverged run skips every step from then on.
    """

    OWN_CHECKS: ClassVar[tuple[str, ...]] = ("seed", "weight_decay")

    steps: int = 10
    lr: float = 1.0e-3
    weight_decay: float = 0.0
    seed: int = 0
    grad_accum: int = 1
    sync_micro_steps: bool = True
    max_skipped_steps: int = 5

    def __post_init__(self) -> None:
        if not is_integer(self.seed) or self.seed < 0:
            raise _fail("train.seed", f"must be an integer >= 0, got {self.seed!r}")
        wd = self.weight_decay
        if isinstance(wd, bool) or not isinstance(wd, (int, float)) or not wd >= 0:
            raise _fail("train.weight_decay", f"must be a number >= 0, got {wd!r}")


PRECISIONS = ("float32", "float64", "bf16-mixed")


@dataclass(frozen=True)
class TrainRecipe:
    """How a step runs on the hardware: what every GPU run sets, and the memory model reads.

    Attributes:
        precision: ``bf16-mixed``: FSDP2 mixed precision, parameters computed in bf16 while
            the sharded master weights, the optimizer state and the gradient reduction stay
            fp32 (a GPU run); ``float32``, or ``float64`` (exact comparisons in tests): one
            dtype throughout.
        checkpointing: activation checkpointing of the transformer blocks of every trained
            encoder and the LLM: 0 off, k > 0 every k-th block (1: every block), so only a
            checkpointed block's input is kept and the block is recomputed in backward.
        loss_chunk: tokens per chunk of the LM-head loss: its logits and their gradient are
            computed ``loss_chunk`` tokens at a time, never ``[tokens, vocab]`` at once.
    """

    OWN_CHECKS: ClassVar[tuple[str, ...]] = ("checkpointing",)

    precision: str = "float32"
    checkpointing: int = 0
    loss_chunk: int = 4096

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            hint = closest(str(self.precision), list(PRECISIONS))
            raise _fail("recipe.precision", f"{self.precision!r} is no precision; {hint}")
        if not is_integer(self.checkpointing) or self.checkpointing < 0:
            raise _fail(
                "recipe.checkpointing",
                f"must be 0 (off) or k > 0 (every k-th block), got {self.checkpointing!r}",
            )

    @property
    def mixed(self) -> bool:
        """Whether parameters compute in bf16 over fp32 master weights."""
        return self.precision == "bf16-mixed"

    def checkpointed(self, layer: int) -> bool:
        """Whether a module's block is checkpointed (every ``checkpointing``-th, from 0).

        Args:
            layer: the block's index in its module, from 0.

        Returns:
            True where the block recomputes its activations in backward.
        """
        return self.checkpointing > 0 and layer % self.checkpointing == 0


@dataclass(frozen=True)
class RunConfig:
    """One run: ``model``, ``data``, ``balance``, ``train`` and ``recipe`` sections (all
    defaulted)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    balance: BalanceConfig = field(default_factory=BalanceConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    recipe: TrainRecipe = field(default_factory=TrainRecipe)

    @property
    def rates(self) -> EncodingRates:
        return self.model.rates

    @property
    def phases(self) -> tuple[str, ...]:
        """Every phase of a step, in execution order: each encoder's, then the LLM's."""
        return (*self.model.encoders, LLM)


_SECTIONS = {
    "balance": BalanceConfig,
    "train": TrainConfig,
    "recipe": TrainRecipe,
}


def run_config(raw: Mapping[str, Any] | None) -> RunConfig:
    """Build and validate a :class:`RunConfig` from a (merged) mapping of sections.

    Its ``plugins:`` list (module names or ``.py`` paths, :mod:`orchmllm.plugins`) is imported
    first, so the modalities, architectures, tasks and policies they register are there when
    the sections are checked.

    Raises:
        ValueError: an unknown section or key (naming the closest valid one), a plugin that
            does not load, or a bad value.
    """
    raw = dict(raw or {})
    load_plugins(raw.pop("plugins", None))
    valid = ["model", "data", "plugins", *_SECTIONS]
    for key in raw:
        if key not in valid:
            raise _unknown_key("config", str(key), valid)
    sections = {name: _build(cls, name, raw.get(name)) for name, cls in _SECTIONS.items()}
    model = ModelConfig.from_dict(raw.get("model"))
    vision = model.encoders.get("vision")  # the paper mix's images are its patches
    data = DataConfig.from_dict(raw.get("data"), patch=getattr(vision, "patch", None))
    # A policy of a modality the model does not encode (one a derived config dropped) is unused.
    return RunConfig(model=model, data=data, **sections)


def merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``over`` laid on ``base``: mappings merge key by key, anything else replaces."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def read_config(path: str | os.PathLike, *, _seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """A config file's mapping with its ``base:`` chain merged in (paths relative to the file).

    Raises:
        ValueError: a file that is not a mapping, or a ``base:`` cycle.
    """
    path = os.path.abspath(path)
    if path in _seen:
        raise ValueError(f"config base cycle: {' -> '.join((*_seen, path))}")
    with open(path) as f:
        try:
            raw = yaml.safe_load(f) or {}
        except yaml.YAMLError as exc:
            raise ValueError(f"config {path!r} is not valid YAML: {exc}") from None
    if not isinstance(raw, Mapping):
        raise ValueError(f"config {path!r} must be a mapping, got {raw!r}")
    raw = dict(raw)
    base = raw.pop("base", None)
    if base is None:
        return raw
    parent = read_config(os.path.join(os.path.dirname(path), base), _seen=(*_seen, path))
    return merge(parent, raw)


CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
"""The configs shipped in the package (the checkout's ``configs/`` is a link to it)."""


def packaged_configs() -> list[str]:
    """The names of the configs shipped in the package, sorted (``tiny``, ``mllm-10b``...)."""
    return sorted(n[: -len(".yaml")] for n in os.listdir(CONFIG_DIR) if n.endswith(".yaml"))


def _yaml_names(directory: str) -> list[str]:
    if not os.path.isdir(directory):
        return []
    return sorted(n for n in os.listdir(directory) if n.endswith((".yaml", ".yml")))


def config_path(config: str | os.PathLike) -> str:
    """The file a config argument names: an existing file as given; else a packaged config
    by its name (``tiny``, ``tiny.yaml``) or by the checkout's path of it
    (``configs/tiny.yaml``), so the README's commands also work outside the checkout, from an
    installed wheel.

    Raises:
        FileNotFoundError: neither; the message lists the YAML files beside the given path,
            the closest of them, and the packaged names.
    """
    path = os.fspath(config)
    if os.path.isfile(path):
        return path
    folder, name = os.path.split(path)
    stem = name.removesuffix(".yaml")
    packaged = packaged_configs()
    if stem in packaged and folder in ("", "configs"):
        return os.path.join(CONFIG_DIR, f"{stem}.yaml")
    beside = _yaml_names(folder or ".")
    lines = [f"config {path!r}: no such file (from {os.getcwd()})"]
    if guess := difflib.get_close_matches(name, beside, n=1):
        lines.append(f"did you mean {os.path.join(folder, guess[0])!r}?")
    elif guess := difflib.get_close_matches(stem, packaged, n=1):
        lines.append(f"did you mean {guess[0]!r} (a packaged config)?")
    if beside:
        lines.append(f"configs in {folder or '.'}/: {', '.join(beside)}")
    lines.append(
        f"packaged configs, by name from any directory (--config tiny): {', '.join(packaged)}"
    )
    raise FileNotFoundError("\n".join(lines))


def load_config(path: str | os.PathLike, overrides: Mapping[str, Any] | None = None) -> RunConfig:
    """Read, merge (``base:``) and validate a run config: a file, or a packaged config's name
    (:func:`config_path`), with ``overrides`` (dotted key -> value, as YAML would give it:
    :func:`orchmllm.overrides.override_value`) laid on it in order, each as a one-key config
    file on top.

    Raises:
        ValueError: as :func:`run_config` and :func:`read_config`, naming the file and the
            overrides.
        FileNotFoundError: no such file or packaged config (listing those there are).
    """
    overrides = dict(overrides or {})
    try:
        raw = read_config(config_path(path))
        for key, value in overrides.items():
            raw = merge(raw, _nested(key.split("."), value))
        return run_config(raw)
    except ValueError as exc:
        given = "".join(f" --{key}={value!r}" for key, value in overrides.items())
        where = f"config {os.fspath(path)!r}" + (f" with{given}" if given else "")
        raise ValueError(f"{where}: {exc}") from None


def _nested(keys: list[str], value: Any) -> dict[str, Any]:
    return {keys[0]: _nested(keys[1:], value) if len(keys) > 1 else value}
