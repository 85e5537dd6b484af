"""Live bytes over one training step, as linear forms in per-rank quantities.

The memory model (:mod:`orchmllm.sim.memory`) replays what the trainer allocates and frees in
a step (:mod:`orchmllm.sim.allocations` mirrors its code op by op) on a :class:`Trace`. A
size is a :data:`Form`: bytes as a linear combination of per-rank *features* (``"llm.tokens"``:
the LLM tokens on the rank, ``"1"``: a constant, ...), so one replay serves every rank and
every batch: a rank's live bytes at any moment are the moment's form evaluated on that rank's
features.

The trace keeps the live total and records a *moment* wherever the total may peak: just before
memory is freed after having grown (a local maximum), and at the end of each phase. A rank's
peak is the largest of its moments. Forms are kept sparse (dicts), evaluated at the end as one
matrix product.

Autograd is replayed with :class:`Storage` reference counts and :class:`Node` records: a node
keeps the storages its backward needs (what ``saved_tensors_hooks`` would see), and
:meth:`Trace.backward` runs the recorded nodes in reverse creation order, the order the
autograd engine uses on one device thread (a node's consumers were all created after it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

Form = dict[str, float]
ONE = "1"  # the constant feature


def form(**coefficients: float) -> Form:
    """A form from keyword coefficients (feature names with dots cannot be keywords: use a
    dict literal for those)."""
    return {k: float(v) for k, v in coefficients.items() if v}


def scaled(f: Mapping[str, float], by: float) -> Form:
    """``by * f``."""
    return {k: v * by for k, v in f.items() if v * by}


def added(*forms: Mapping[str, float]) -> Form:
    """The sum of ``forms``."""
    out: Form = {}
    for f in forms:
        for k, v in f.items():
            out[k] = out.get(k, 0.0) + v
    return {k: v for k, v in out.items() if v}


def const(nbytes: float) -> Form:
    return {ONE: float(nbytes)} if nbytes else {}


class Storage:
    """One allocation: its size and how many references keep it alive."""

    __slots__ = ("nbytes", "refs", "label")

    def __init__(self, nbytes: Form, label: str) -> None:
        self.nbytes, self.refs, self.label = nbytes, 1, label


@dataclass
class Node:
    """One autograd node: what it keeps for backward and what its backward does.

    ``run(trace)`` replays the backward itself (allocating the gradients it produces, freeing
    those it consumed); the trace then releases ``saved``.
    """

    label: str
    saved: list[Storage]
    run: Callable[[Trace], None]


@dataclass
class Moment:
    """The live bytes at one instant: which phase it belongs to and its form."""

    phase: str
    label: str
    level: Form


@dataclass
class Trace:
    """The live bytes of one rank above those at the step's start (see the module docstring).

    Attributes:
        phase: the phase moments are recorded under (``forward``, ``backward``, ``optimizer``).
        saving: whether operations record autograd nodes (off inside a checkpointed block's
            forward and in a frozen module).
    """

    phase: str = "forward"
    saving: bool = True
    level: Form = field(default_factory=dict)
    moments: list[Moment] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    _rising: bool = False
    _label: str = ""

    # -- raw accounting -------------------------------------------------------------------

    def _add(self, f: Mapping[str, float], sign: float) -> None:
        for k, v in f.items():
            self.level[k] = self.level.get(k, 0.0) + sign * v

    def grow(self, f: Mapping[str, float], label: str) -> None:
        self._add(f, 1.0)
        self._rising, self._label = True, label

    def shrink(self, f: Mapping[str, float]) -> None:
        if self._rising:
            self.mark(self._label)
        self._add(f, -1.0)
        self._rising = False

    def mark(self, label: str) -> None:
        """Record the current live bytes as a moment."""
        level = {k: v for k, v in self.level.items() if v}
        self.moments.append(Moment(self.phase, label, level))

    def enter(self, phase: str) -> None:
        """Close the current phase (its last level is a moment) and open ``phase``."""
        self.mark(f"end of {self.phase}")
        self._rising = False
        self.phase = phase

    # -- storages ----------------------------------------------------------------------------

    def new(self, nbytes: Form, label: str) -> Storage:
        """Allocate a storage (one reference: the caller's)."""
        self.grow(nbytes, label)
        return Storage(nbytes, label)

    def ref(self, s: Storage | None) -> Storage | None:
        if s is not None:
            s.refs += 1
        return s

    def drop(self, *storages: Storage | None) -> None:
        """Release one reference of each; a storage with none left is freed."""
        for s in storages:
            if s is None:
                continue
            s.refs -= 1
            if s.refs == 0:
                self.shrink(s.nbytes)
            elif s.refs < 0:
                raise RuntimeError(f"storage {s.label} released once too often")

    def transient(self, nbytes: Form, label: str) -> None:
        """A buffer allocated and freed within one call (a kernel's workspace)."""
        self.drop(self.new(nbytes, label))

    # -- autograd ----------------------------------------------------------------------------

    def node(
        self, label: str, saved: Iterable[Storage | None], run: Callable[[Trace], None]
    ) -> Node | None:
        """Record an autograd node keeping ``saved`` (each gains a reference), if saving."""
        if not self.saving:
            return None
        kept = [self.ref(s) for s in saved if s is not None]
        self.nodes.append(Node(label, kept, run))
        return self.nodes[-1]

    def release(self, node: Node, storage: Storage) -> None:
        """Release one of ``node``'s saved storages before the node ends."""
        node.saved.remove(storage)
        self.drop(storage)

    def backward(self, nodes: list[Node]) -> None:
        """Run ``nodes`` backward in reverse creation order, releasing what each saved."""
        for node in reversed(nodes):
            node.run(self)
            self.drop(*node.saved)


@dataclass(frozen=True)
class Moments:
    """The recorded moments as a matrix: ``coefficients[m, f]`` bytes per unit of feature
    ``features[f]`` at moment ``m``."""

    features: tuple[str, ...]
    phases: tuple[str, ...]
    labels: tuple[str, ...]
    coefficients: np.ndarray

    @classmethod
    def of(cls, moments: list[Moment]) -> Moments:
        names = sorted({k for m in moments for k in m.level})
        index = {n: i for i, n in enumerate(names)}
        coef = np.zeros((len(moments), len(names)))
        for row, m in enumerate(moments):
            for k, v in m.level.items():
                coef[row, index[k]] = v
        out = cls(
            tuple(names),
            tuple(m.phase for m in moments),
            tuple(m.label for m in moments),
            coef,
        )
        return out.pruned()

    def pruned(self) -> Moments:
        """Without the moments another moment of the same phase bounds for every rank (every
        feature is non-negative, so a coefficient-wise larger moment is larger everywhere)."""
        coef = self.coefficients
        keep = np.ones(len(coef), dtype=bool)
        phases = np.asarray(self.phases)
        for i in range(len(coef)):
            if not keep[i]:
                continue
            same = (phases == phases[i]) & keep
            same[i] = False
            below = same & np.all(coef <= coef[i] + 1e-9, axis=1)
            keep &= ~below
        idx = np.flatnonzero(keep)
        return Moments(
            self.features,
            tuple(self.phases[i] for i in idx),
            tuple(self.labels[i] for i in idx),
            coef[idx],
        )

    def evaluate(self, features: Mapping[str, np.ndarray]) -> np.ndarray:
        """Live bytes ``[ranks, moments]`` for per-rank feature values (``"1"`` implied)."""
        cols = []
        size = None
        for name in self.features:
            if name == ONE:
                cols.append(None)
                continue
            if name not in features:
                raise ValueError(f"features: no value for {name!r}")
            v = np.asarray(features[name], dtype=np.float64)
            size = v.shape if size is None else size
            cols.append(v)
        shape = size if size is not None else (1,)
        matrix = np.stack([np.ones(shape) if c is None else c for c in cols], axis=-1)
        return matrix @ self.coefficients.T

    def peaks(self, features: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Per phase, each rank's peak live bytes (0 where a phase recorded no moment)."""
        live = self.evaluate(features)
        phases = np.asarray(self.phases)
        out = {}
        for phase in dict.fromkeys(self.phases):
            out[phase] = np.maximum(live[..., phases == phase].max(axis=-1), 0.0)
        return out
