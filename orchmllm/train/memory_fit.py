"""The memory model's per-rank forms, fitted to torch's own accounting of the step.

The hand replay (:mod:`orchmllm.sim.allocations`) mirrors every module's forward and backward
op by op, so a new encoder architecture needs its own replay code. This module asks the
memory oracle (:mod:`orchmllm.train.memory_oracle`: ``FSDPMemTracker`` on fake tensors and a
fake process group of the shard group's size, one process) instead: it traces the rank's step
at a small design of per-rank shapes (:func:`design`) and fits each phase's peak (above the
static bytes) as the largest of a few linear forms in the per-rank features the planner
knows (:func:`fit_features`, a subset of :meth:`~orchmllm.sim.memory.MemoryModel.rank_features`).

Why a largest-of-forms and how it is fitted: a phase's peak is the largest of the live bytes
at each moment of the step, and the live bytes at one moment are linear in the shapes (a
tensor's bytes are); so the peak is a maximum of linear forms, each below the peak at every
shape. :func:`fit_envelope` builds it so: each new form is the linear program "touch the
shape the forms so far cover worst, stay at or below every traced peak, cover as much of the
rest as possible" (coefficients non-negative), until every traced shape is within 0.5%.
The forms are then checked on fresh shapes; while one is off by more than 5%, those shapes
join the design and new ones are drawn (:class:`DesignRange`), and the last check's error is
stored with the forms (``python -m orchmllm.train.memory_fit`` prints it per shape). One
linear form is not enough: the chunked loss alone makes the forward's peak a maximum (within
the first chunk, or within the second while the first's outputs live).

The forms are cached (:mod:`orchmllm.sim.memory_forms`) by a hash of the model config, the
recipe, the shard group, the device, torch's version and the schema (:func:`forms_key`); a
second call with the same key traces nothing. :class:`OracleForms` is the
``MemoryModel(forms=...)`` source that fits or loads them.

What the oracle cannot give, and so what stays of the hand replay (the memory model adds it
to the fitted peaks, :meth:`~orchmllm.sim.memory.MemoryModel.phase_peaks`):

- the attention kernels' workspaces: buffers a kernel allocates inside itself, which no
  tensor the tracker sees holds (the CPU flash kernel's per-thread blocks, measured against
  the allocator in ``tests/test_memory_measured.py``; CUDA's FlashAttention-2 and
  memory-efficient backward accumulators, from the kernels' sources);
- the orchestrator's exchange (the moves' send and receive buffers): its all-to-alls deliver
  nothing on the fake process group, so the oracle runs the step from the rank's own items
  on; the replay's ``move`` gives what a move adds;
- the previous step's ``LLMBatch``, alive in the trainer's loop until the backward returns
  (the oracle measures a step on its own): the replay's ``previous_batch``;
- what differs on CUDA: the oracle runs the CPU's ops. AdamW is traced as the device runs it
  (``foreach``: CUDA's multi-tensor step holds a whole group's temporaries), but CUDA's
  LayerNorm statistics (fp32 where the CPU keeps the input's dtype) and the batch's copy to
  the device inside the step are not in the forms, nor added (the replay has them);
- gloo's own reduce-scatter buffers (real gloo ranks only; NCCL and the fake group have none)
  and the allocator's rounding and fragmentation (the tracker counts tensors): neither is in
  the replay either; ``reserve_bytes`` stands for them.

The moves and the previous batch come from the replay's modules, so they need the
architecture's replay; an architecture without one (a padded encoder with its own front end)
gets its step from the fitted forms alone, and the memory model says so if asked for them.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from scipy.optimize import linprog

from orchmllm.config import ModelConfig, TrainRecipe, load_config
from orchmllm.schema import LLM
from orchmllm.sim.memory import MemoryModel
from orchmllm.sim.memory_forms import (
    SCHEMA,
    LinearForm,
    MemoryForms,
    load_forms,
    store_forms,
)
from orchmllm.sim.replay_env import DEVICES
from orchmllm.train.memory_oracle import (
    PHASES,
    PhasePeaks,
    RankBatch,
    step_peaks_many,
    symmetric_batch,
    with_layers,
)

# The per-rank features the forms may use (MemoryModel.rank_features names them "<module>.<f>").
# The oracle's step has no moves, so the sampled, gathered and encoded-elsewhere counts are the
# rank's own; the workspaces are the kernels' (added apart, the tracker does not see them).
# Left out: item counts (a step holds a few bytes per item, its length) and the longest item
# (what grows with it is the attention kernels' workspaces, which the tracker does not see and
# the memory model adds apart): a coefficient on either lets a form reach a traced shape by
# what does not carry over to other shapes (python -m orchmllm.train.memory_fit shows the
# held-out error; it was larger with them).
ENCODER_FEATURES = ("rows", "input", "raw")
LLM_FEATURES = ("tokens", "text", "chunk", "chunk2")
TOLERANCE = 0.005  # every traced shape within this of its peak


@dataclass(frozen=True)
class DesignRange:
    """The shapes a fit traces: up to ``items`` items per encoder of up to ``raw_rows`` raw
    rows each, up to ``sequences`` sequences of up to ``text`` text tokens each (default:
    three quarters of the loss chunk, so a rank's tokens reach the second and third chunks).
    Tracing cost does not grow with the sizes (fake tensors): cover the sizes you plan for.
    ``design`` shapes are fitted, ``held_out`` fresh ones checked; while one is off by more
    than ``target``, they join the design and new ones are drawn, ``rounds`` times at most."""

    items: int = 3
    raw_rows: int = 1024
    sequences: int = 3
    text: int | None = None
    design: int = 16
    held_out: int = 6
    target: float = 0.05
    rounds: int = 2

    def __post_init__(self) -> None:
        for name in ("items", "raw_rows", "sequences", "design"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        for name in ("held_out", "rounds", "target"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")


def fit_features(config: ModelConfig) -> list[str]:
    """The features the forms of ``config`` may use."""
    names = [f"{n}.{f}" for n in config.encoders for f in ENCODER_FEATURES]
    return names + [f"{LLM}.{f}" for f in LLM_FEATURES]


def design(
    config: ModelConfig, recipe: TrainRecipe, rng: DesignRange, *, seed: int, count: int
) -> list[tuple[dict[str, tuple[int, ...]], tuple[int, ...]]]:
    """``count`` rank shapes (raw rows of each encoder's items, text tokens of each
    sequence), deterministic in ``seed``. The first of seed 0 are the corners (a short text
    alone, each encoder alone at its largest, everything at its largest), so every feature is
    varied on its own; the rest are drawn uniformly."""
    gen = np.random.default_rng(seed)
    text = rng.text or max(4, 3 * recipe.loss_chunk // 4)
    div = {n: e.rate.divisor for n, e in config.encoders.items()}

    def top(name: str) -> tuple[int, ...]:
        return (rng.raw_rows // div[name] * div[name] or div[name],) * rng.items

    shapes = []
    if seed == 0:
        none = {n: () for n in config.encoders}
        shapes.append((none, (4,)))
        shapes += [({**none, n: top(n)}, (4,)) for n in config.encoders]
        shapes.append(({n: top(n) for n in config.encoders}, (text,) * rng.sequences))
    while len(shapes) < count:
        items = {
            n: tuple(int(r) * d for r in gen.integers(1, max(2, rng.raw_rows // d + 1),
                                                       gen.integers(0, rng.items + 1)))
            for n, d in div.items()
        }  # fmt: skip
        seqs = tuple(int(t) for t in gen.integers(4, text + 1, gen.integers(1, rng.sequences + 1)))
        shapes.append((items, seqs))
    return shapes[:count]


def shape_features(
    config: ModelConfig, recipe: TrainRecipe, shapes: Sequence[tuple[Mapping, tuple]]
) -> tuple[list[RankBatch], dict[str, np.ndarray]]:
    """The oracle's rank batches of ``shapes`` and their per-rank features (every one of
    ``rank_features``; one rank holding each shape, nothing moved: what the oracle runs)."""
    memory = MemoryModel(device="cpu")
    batches, rows = [], []
    for items, text in shapes:
        batch, layout = symmetric_batch(1, items, text)
        batches.append(RankBatch.of_layout(config, batch, layout, 0))
        rows.append(memory.rank_features(config, recipe, batch, layout))
    return batches, {k: np.array([r[k][0] for r in rows]) for k in rows[0]}


def fit_envelope(
    features: Mapping[str, np.ndarray], peaks: np.ndarray, *, tol: float = TOLERANCE
) -> tuple[LinearForm, ...]:
    """The largest of a few linear forms (non-negative coefficients) below every peak, each
    touching the shape covered worst so far, until every shape is within ``tol``."""
    names = [k for k, v in features.items() if np.any(v)]
    y = np.asarray(peaks, dtype=np.float64)
    x = np.column_stack([np.ones_like(y), *(features[k] for k in names)])
    scale = x.max(0)
    z = x / scale
    bounds = [(0, None)] * z.shape[1]
    forms: list[np.ndarray] = []
    for _ in range(len(y)):
        got = np.max([z @ f for f in forms], 0) if forms else np.zeros_like(y)
        short = got < y * (1 - tol)
        if not short.any():
            break
        i = int(np.argmin(got / y))
        touch = _lp(-z[i], z, y, bounds)
        reach = z[i] @ touch
        if reach <= got[i]:
            break  # no form below the other peaks reaches it: the best the features allow
        # cover the rest as well as a form through that shape's reach can
        cover = _lp(-(z[short] / y[short, None]).sum(0), np.vstack([z, -z[i]]),
                    np.append(y, -reach * (1 - 1e-9)), bounds)  # fmt: skip
        forms.append(cover)
    out = []
    for f in forms:
        coef = f[1:] / scale[1:]
        terms = {k: float(c) for k, c in zip(names, coef, strict=True) if c}
        out.append(LinearForm(float(f[0] * scale[0]), terms))
    return tuple(out)


def _lp(c, a_ub, b_ub, bounds) -> np.ndarray:
    r = linprog(c, A_ub=a_ub, b_ub=b_ub, bounds=bounds, method="highs")
    if not r.success:
        raise RuntimeError(f"fitting the memory forms: the linear program failed ({r.message})")
    return r.x


def forms_key(config: ModelConfig, recipe: TrainRecipe, shard_group: int, device: str) -> str:
    """The cache key of the forms of this set-up (hex SHA-256)."""
    text = repr((SCHEMA, repr(config), repr(recipe), shard_group, device, torch.__version__))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass
class Fit:
    """A fit's forms and what it traced: the held-out shapes' oracle peaks and predictions."""

    forms: MemoryForms
    held_out: list[tuple[PhasePeaks, dict[str, float]]]


def fit_forms(
    config: ModelConfig,
    recipe: TrainRecipe,
    shard_group: int,
    *,
    device: str = "cpu",
    ranges: DesignRange = DesignRange(),
) -> Fit:
    """Trace the oracle at ``ranges``' design (one process, fake tensors and a fake group of
    ``shard_group`` ranks), fit each phase, and check the forms on fresh held-out shapes;
    while one is off by more than ``ranges.target``, the held-out shapes join the design
    and new ones are drawn (``ranges.rounds`` times at most). The reported error is of the
    last held-out shapes, which no fit has seen."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    key = forms_key(config, recipe, shard_group, device)
    # AdamW as the device runs it: CUDA's multi-tensor step, the CPU's single-tensor loop
    trace = functools.partial(_trace, config, recipe, shard_group, foreach=device == "cuda")
    traced, feats = trace(design(config, recipe, ranges, seed=0, count=ranges.design))
    for round_ in range(ranges.rounds + 1):
        phases = {
            ph: fit_envelope({k: feats[k] for k in fit_features(config)},
                             np.array([t.peaks[ph] for t in traced]))
            for ph in PHASES
        }  # fmt: skip
        forms = MemoryForms(key, traced[0].static, phases)
        if not ranges.held_out:
            return Fit(forms, [])
        shapes = design(config, recipe, ranges, seed=1 + round_, count=ranges.held_out)
        new, new_feats = trace(shapes)
        predicted = forms.peaks(new_feats)
        held = [(t, {ph: float(predicted[ph][i]) for ph in PHASES}) for i, t in enumerate(new)]
        worst = {ph: max(abs(p[ph] / t.peaks[ph] - 1) for t, p in held) for ph in PHASES}
        if max(worst.values()) <= ranges.target or round_ == ranges.rounds:
            return Fit(dataclasses.replace(forms, held_out=worst), held)
        traced += new
        feats = {k: np.concatenate([v, new_feats[k]]) for k, v in feats.items()}
    raise AssertionError("unreachable")


def _trace(
    config, recipe, shard_group, shapes, *, foreach: bool
) -> tuple[list[PhasePeaks], dict[str, np.ndarray]]:
    batches, feats = shape_features(config, recipe, shapes)
    return step_peaks_many(config, recipe, shard_group, batches, foreach=foreach), feats


class OracleForms:
    """``MemoryModel(forms=OracleForms())``: the fitted forms of a set-up (config, recipe,
    shard group, device), loaded from the cache (``cache``, else
    :func:`orchmllm.sim.memory_forms.cache_dir`) or traced, fitted and stored. ``traced``
    lists the keys this source traced (a cached key is not traced again)."""

    def __init__(
        self, *, cache: str | os.PathLike | None = None, ranges: DesignRange = DesignRange()
    ) -> None:
        self.cache, self.ranges = cache, ranges
        self.traced: list[str] = []
        self._loaded: dict[str, MemoryForms] = {}

    def __call__(
        self, config: ModelConfig, recipe: TrainRecipe, shard_group: int, device: str
    ) -> MemoryForms:
        key = forms_key(config, recipe, shard_group, device)
        if key not in self._loaded:
            forms = load_forms(key, self.cache)
            if forms is None:
                forms = fit_forms(
                    config, recipe, shard_group, device=device, ranges=self.ranges
                ).forms
                store_forms(forms, self.cache)
                self.traced.append(key)
            self._loaded[key] = forms
        return self._loaded[key]


def held_out_table(fit: Fit) -> str:
    """The held-out shapes' oracle and fitted peaks per phase (MB) and their ratio."""
    lines = [f"{'shape':>5} {'phase':<10}{'oracle MB':>12}{'fitted MB':>12}{'ratio':>8}"]
    for i, (traced, predicted) in enumerate(fit.held_out):
        for ph in PHASES:
            m, p = traced.peaks[ph], predicted[ph]
            lines.append(f"{i:>5} {ph:<10}{m / 1e6:>12.2f}{p / 1e6:>12.2f}{p / m:>8.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """``python -m orchmllm.train.memory_fit``: fit a config's forms and print their error on
    held-out shapes (nothing cached)."""
    p = argparse.ArgumentParser(
        prog="python -m orchmllm.train.memory_fit", description=main.__doc__
    )
    p.add_argument("--config", required=True)
    p.add_argument("--world-size", type=int, default=8, help="the shard group (fake ranks)")
    p.add_argument("--layers", type=int, default=0, help="blocks per module (0: the config's)")
    p.add_argument("--raw-rows", type=int, default=DesignRange.raw_rows,
                   help="the largest item's raw rows in the design")  # fmt: skip
    p.add_argument("--device", choices=DEVICES, default="cpu", help="the device planned for")
    args = p.parse_args(argv)
    for name in ("world_size", "raw_rows"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.layers < 0:
        p.error(f"--layers must be >= 0, got {args.layers}")
    cfg = load_config(args.config)
    model = with_layers(cfg.model, args.layers) if args.layers else cfg.model
    fit = fit_forms(model, cfg.recipe, args.world_size, device=args.device,
                    ranges=DesignRange(raw_rows=args.raw_rows))  # fmt: skip
    print(f"{args.config}, {args.world_size} ranks, {args.device}: forms per phase "
          + ", ".join(f"{ph} {len(fs)}" for ph, fs in fit.forms.phases.items()))  # fmt: skip
    print(held_out_table(fit))


if __name__ == "__main__":
    main()
