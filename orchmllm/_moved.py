"""Modules that moved: their 0.1.0 paths keep importing, with a warning naming the new place.

The package's top level once held every module; they now live in subpackages named for their
concern. ``import orchmllm.<old>`` (or ``from orchmllm.<old> import x``) still works: it gives
the module at its new place, the same object (nothing is imported twice), and a
``DeprecationWarning`` that names the place to import it from. An old path that is also a
public name of the package (``orchmllm.balance``, the function) raises an error naming the
module's place instead: importing it would rebind that name to the module.
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
    "data": ("recipe", "workload_facts", "workloads"),
    "sim": ("plan_memory",),
    "train": ("checkpoint", "dirlock", "host_memory", "launch", "memory_oracle", "phase_memory",
              "preempt", "progress", "report", "tracking"),
}  # fmt: skip
#: Old module path -> new one.
MOVED = {f"orchmllm.{m}": f"orchmllm.{pkg}.{m}" for pkg, ms in _MOVED_INTO.items() for m in ms}
MOVED |= {  # the reference encoders, now one folder per architecture
    "orchmllm.models.vision": "orchmllm.models.vit.module",
    "orchmllm.models.audio": "orchmllm.models.whisper.module",
}
# The encoders' modules, each into its architecture's folder (orchmllm.models.spec).
MOVED |= {
    "orchmllm.models.vision": "orchmllm.models.vit.module",
    "orchmllm.models.audio": "orchmllm.models.whisper.module",
}


class _MovedModules(MetaPathFinder, Loader):
    """``import orchmllm.<old>`` of a module that moved gives the module at its new place (the
    same object, so nothing is imported twice), with a DeprecationWarning naming that place."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        if name not in MOVED:
            return None
        package, _, child = name.rpartition(".")
        taken = getattr(sys.modules.get(package), child, None)
        if taken is not None and not isinstance(taken, ModuleType):
            # importing would rebind the package's public name (orchmllm.balance, the
            # function) to the module: refuse, naming the module's place
            raise ModuleNotFoundError(
                f"{name} is a function now; its module moved to {MOVED[name]}: import it "
                "from there",
                name=name,
            )
        return spec_from_loader(name, self)

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
