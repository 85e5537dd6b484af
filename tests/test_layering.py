"""The package is a stack of floors: a module imports only from its own floor or below.

1. schema and configs (torch-free); 2. planner (numpy + the C++ core, torch-free; the package
facade ``orchmllm`` itself only re-exports it eagerly); 2.5 the simulator (floors 1-2 only);
3. comm (torch.distributed: collectives, plan agreement, topology, dispatcher); 4. orchestrator
(execution); 5. data; 6. models; 7. train and reports; 8. integrations (adapters for other
stacks), which import the public API only: the facade ``orchmllm``, the modality table
``orchmllm.schema`` and themselves. The check is static (every ``import``
in a module, also inside functions, so a circle cannot hide behind a lazy import), and the
torch-free floors are imported for real in a process where ``import torch`` fails.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "orchmllm"

# Module (or package prefix) -> floor. A new module must be placed here.
FLOORS = {
    "orchmllm.schema": 1,
    "orchmllm._moved": 1,  # old module paths -> new ones (imports by name, at use)
    "orchmllm._lazy": 1,  # a package's names loaded on first use (by name, at use)
    "orchmllm.plugins": 1,  # imports a user's files, which register into the floors above
    "orchmllm.config": 2,  # checks policy and placement names in the planner's registry
    "orchmllm": 2,  # the facade: eager re-exports of the planner, lazy ones of the rest
    "orchmllm._core": 2,
    "orchmllm.planner": 2,
    "orchmllm.data.workloads": 2,
    "orchmllm.data.workload_facts": 2,
    "orchmllm.data.recipe": 2,
    "orchmllm.sim": 2.5,  # the simulator and its memory model
    # the memory model as a command: its --memory-source oracle fits the trainer's oracle
    "orchmllm.sim.plan_memory": 7,
    "orchmllm.compat": 3,
    "orchmllm.dist": 3,
    "orchmllm.testing": 3,
    "orchmllm.dist.orchestrator": 4,
    "orchmllm.dist.calibrator": 4,
    "orchmllm.data": 5,
    "orchmllm.models": 6,
    # each architecture's torch-free spec (config dataclass, parameter count) and the registry
    "orchmllm.models.spec": 2,
    "orchmllm.models.vit": 2,
    "orchmllm.models.whisper": 2,
    "orchmllm.models.vit.module": 6,  # its nn.Module
    "orchmllm.models.whisper.module": 6,
    "orchmllm.train": 7,  # the trainer and what only it uses (checkpoints, launch, reports)
    "orchmllm.provenance": 7,
    "orchmllm.integrations": 8,
}
# What an integration may import from the package: the public API, as an outside user would.
PUBLIC_API = ("orchmllm", "orchmllm.schema", "orchmllm.integrations")
TORCH_FREE_FLOOR = 2.5


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def floor_of(module: str) -> float:
    """The floor of ``module``: its own entry or its longest listed package prefix."""
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in FLOORS:
            return FLOORS[".".join(parts[:i])]
    raise AssertionError(f"{module} has no floor: add it to FLOORS in {__file__}")


def _imports(path: Path, module: str) -> set[str]:
    """Every orchmllm module ``path`` imports (relative imports resolved)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            found.add(base)
            # `from orchmllm.data import exchange` imports the submodule exchange
            found.update(f"{base}.{a.name}" for a in node.names if _is_module(f"{base}.{a.name}"))
    return {m for m in found if m == "orchmllm" or m.startswith("orchmllm.")}


def _is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (PACKAGE.parent / rel.with_suffix(".py")).exists() or (
        PACKAGE.parent / rel / "__init__.py"
    ).exists()


def import_graph() -> dict[str, set[str]]:
    graph = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        graph[module] = {m for m in _imports(path, module) if m != module}
    return graph


def test_every_module_has_a_floor_and_imports_none_above_it():
    upward = []
    for module, deps in import_graph().items():
        for dep in deps:
            if dep == "orchmllm._core":
                continue
            if floor_of(dep) > floor_of(module):
                upward.append(f"{module} (floor {floor_of(module)}) -> {dep} ({floor_of(dep)})")
    assert not upward, "imports that climb a floor:\n" + "\n".join(sorted(upward))


def test_integrations_import_only_the_public_api():
    private = [
        f"{module} -> {dep}"
        for module, deps in import_graph().items()
        if module.startswith("orchmllm.integrations")
        for dep in deps
        if dep not in PUBLIC_API and not dep.startswith("orchmllm.integrations.")
    ]
    assert not private, "integrations importing past the public API:\n" + "\n".join(private)


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for dep in sorted(graph.get(m, ())):
            if dep == "orchmllm":  # the facade's lazy names are not module-level imports
                continue
            if state.get(dep) == 1:
                cycle = stack[stack.index(dep) :] + [dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_one_place_opens_a_process_group():
    """``Topology`` owns the process groups: ``new_group`` is called once in the package, in
    orchmllm/dist/topology.py, so no module opens (and leaks) a group of its own."""
    calls = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if name == "new_group":
                    calls.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert len(calls) == 1 and calls[0].startswith("orchmllm/dist/topology.py:"), calls


def test_floor_table_rejects_an_unknown_module():
    with pytest.raises(AssertionError, match="no floor"):
        floor_of("json")


@pytest.mark.integration
def test_torch_free_floors_import_and_plan_without_torch(tmp_path):
    torch_free = sorted(m for m in import_graph() if floor_of(m) <= TORCH_FREE_FLOOR)
    script = textwrap.dedent(
        f"""
        import importlib, sys

        class NoTorch:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError("torch is blocked in this test")

        sys.meta_path.insert(0, NoTorch())
        for name in {torch_free!r}:
            importlib.import_module(name)
        import numpy as np
        from orchmllm import EncoderPhase, StepOptions, plan_step
        from orchmllm.schema import IMAGE, TEXT
        rows = np.array([[0, TEXT, 5, 4], [0, IMAGE, 8, 0], [0, TEXT, 30, 29]] * 1)
        phases = (EncoderPhase("vision", IMAGE, "image_patches", 2, 3),)
        plan = plan_step(rows, np.zeros(3, np.int64), StepOptions(phases), num_ranks=2)
        assert plan.seq_len.tolist() == [39], plan.seq_len
        assert "torch" not in sys.modules
        print("ok", len({torch_free!r}))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=PACKAGE.parent,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok")
