"""Per-rank memory forms fitted to torch's own accounting of the step, and their cache.

:mod:`orchmllm.train.memory_fit` traces the memory oracle (:mod:`orchmllm.train.memory_oracle`:
torch's ``FSDPMemTracker`` on fake tensors and a fake process group) at a small design of
per-rank shapes and fits, per phase, a peak as the largest of a few linear forms in the
per-rank features the planner knows (:meth:`orchmllm.sim.memory.MemoryModel.rank_features`).
This module holds what the simulator needs of that, torch-free: the forms, their evaluation,
their JSON, and the cache they are stored in (one file per key; the key hashes the model
config, the recipe, the shard group, the device, the torch version and :data:`SCHEMA`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SCHEMA = 1  # bump when the fitted forms' meaning or layout changes: old cache files are unread
CACHE_ENV = "ORCHMLLM_CACHE_DIR"


@dataclass(frozen=True)
class LinearForm:
    """``const + sum(coef[f] * features[f])`` bytes."""

    const: float
    coef: Mapping[str, float] = field(default_factory=dict)

    def __call__(self, features: Mapping[str, np.ndarray]) -> np.ndarray:
        out = np.asarray(self.const, dtype=np.float64)
        for name, c in self.coef.items():
            if name not in features:
                raise KeyError(f"features: the fitted forms need {name!r}, which is missing")
            out = out + c * np.asarray(features[name], dtype=np.float64)
        return out


@dataclass(frozen=True)
class MemoryForms:
    """One set-up's fitted memory: per phase, the peak above ``static`` as the largest of
    its forms.

    Attributes:
        key: the cache key it was fitted for (:func:`orchmllm.train.memory_fit.forms_key`).
        static: bytes live when a step starts (the oracle's, not fitted: shapes do not change
            it).
        phases: phase -> its forms.
        held_out: phase -> the largest relative error on the held-out shapes of the fit.
    """

    key: str
    static: float
    phases: Mapping[str, tuple[LinearForm, ...]]
    held_out: Mapping[str, float] = field(default_factory=dict)

    def peaks(self, features: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Each rank's peak above :attr:`static` per phase."""
        return {
            ph: np.max(np.stack([np.broadcast_to(f(features), _shape(features)) for f in fs]), 0)
            for ph, fs in self.phases.items()
        }

    def to_json(self) -> str:
        return json.dumps(
            {
                "schema": SCHEMA,
                "key": self.key,
                "static": self.static,
                "phases": {
                    ph: [{"const": f.const, "coef": dict(f.coef)} for f in fs]
                    for ph, fs in self.phases.items()
                },
                "held_out": dict(self.held_out),
            },
            indent=1,
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> MemoryForms:
        raw = json.loads(text)
        if raw.get("schema") != SCHEMA:
            raise ValueError(f"memory forms: schema {raw.get('schema')!r}, this reads {SCHEMA}")
        phases = {
            ph: tuple(LinearForm(f["const"], f["coef"]) for f in fs)
            for ph, fs in raw["phases"].items()
        }
        return cls(raw["key"], raw["static"], phases, raw["held_out"])


def _shape(features: Mapping[str, np.ndarray]) -> tuple[int, ...]:
    return np.broadcast_shapes(*(np.shape(v) for v in features.values()))


def cache_dir(directory: str | os.PathLike | None = None) -> Path:
    """Where fitted forms are cached: ``directory``, else ``$ORCHMLLM_CACHE_DIR``'s
    ``memory_forms``, else ``~/.cache/orchmllm/memory_forms``."""
    if directory is not None:
        return Path(directory)
    root = os.environ.get(CACHE_ENV)
    base = Path(root) if root else Path.home() / ".cache" / "orchmllm"
    return base / "memory_forms"


def load_forms(key: str, directory: str | os.PathLike | None = None) -> MemoryForms | None:
    """The cached forms of ``key``, or None (none stored, or stored by another schema)."""
    path = cache_dir(directory) / f"{key}.json"
    if not path.is_file():
        return None
    try:
        forms = MemoryForms.from_json(path.read_text())
    except ValueError:
        return None
    return forms if forms.key == key else None


def store_forms(forms: MemoryForms, directory: str | os.PathLike | None = None) -> Path:
    """Write ``forms`` to the cache (atomically: a reader sees the old file or the new)."""
    d = cache_dir(directory)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{forms.key}.json"
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(forms.to_json())
    tmp.replace(path)
    return path
