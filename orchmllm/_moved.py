"""Modules that moved: their 0.1.0 paths keep importing, with a warning naming the new place.

The package's top level once held every module; they now live in subpackages named for their
concern. ``import orchmllm.<old>`` (or ``from orchmllm.<old> import x``) still works: it gives
the module at its new place, the same object (nothing is imported twice), and a
``DeprecationWarning`` that names the place to import it from.
"""

from __future__ import annotations

import sys
import warnings
from importlib import import_module
from importlib.abc import Loader, MetaPathFinder
from importlib.machinery import ModuleSpec
from importlib.util import spec_from_loader
from types import ModuleType
from typing import Any

#: Subpackage -> the modules that moved into it from the package's top level (0.1.0's layout).
_MOVED_INTO = {
    "planner": ("balance", "cost", "exact", "measured_cost", "placement", "plan", "policies",
                "reference", "stats", "step_plan", "validate"),
    "dist": ("agreement", "calibrator", "comm", "dispatcher", "loss", "orchestrator",
             "topology", "watch"),
    "sim": ("plan_memory",),
}  # fmt: skip
MOVED = {f"orchmllm.{m}": f"orchmllm.{pkg}.{m}" for pkg, ms in _MOVED_INTO.items() for m in ms}
# The encoders' modules, each into its architecture's folder (orchmllm.models.spec).
MOVED |= {
    "orchmllm.models.vision": "orchmllm.models.vit.module",
    "orchmllm.models.audio": "orchmllm.models.whisper.module",
}


class _MovedModules(MetaPathFinder, Loader):
    """``import orchmllm.<old>`` of a module that moved gives the module at its new place (the
    same object, so nothing is imported twice), with a DeprecationWarning naming that place."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        return spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        warnings.warn(
            f"{spec.name} moved to {MOVED[spec.name]}; import it from there",
            DeprecationWarning,
            stacklevel=3,
        )
        return import_module(MOVED[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        pass  # imported already, at its new place


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.append(_MovedModules())
