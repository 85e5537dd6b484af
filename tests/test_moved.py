"""orchmllm._moved: a module's 0.1.0 path still imports, as the same object, with a warning
naming its new place; nothing in the repository uses an old path."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

import orchmllm
from orchmllm._moved import MOVED

ROOT = Path(__file__).resolve().parents[1]


SHADOWED = {"orchmllm.balance"}  # also the package's public function


@pytest.mark.parametrize("old", sorted(set(MOVED) - SHADOWED))
def test_an_old_path_gives_the_moved_module_and_names_its_place(old):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {MOVED[old]}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED[old])
    assert Path(module.__file__).parent.name == MOVED[old].split(".")[-2]


def test_an_old_path_that_is_a_public_function_refuses_and_keeps_the_function():
    with pytest.raises(ModuleNotFoundError, match="moved to orchmllm.planner.balance"):
        from orchmllm.balance import balance  # noqa: F401
    orchmllm = importlib.import_module("orchmllm")
    assert orchmllm.balance([3, 2, 1], 2).loads.max() == 3  # still the function


def test_from_an_old_path_imports_its_names():
    sys.modules.pop("orchmllm.step_plan", None)
    with pytest.warns(DeprecationWarning, match="orchmllm.planner.step_plan"):
        from orchmllm.step_plan import plan_step
    assert plan_step is importlib.import_module("orchmllm").plan_step


def test_every_old_path_has_moved_and_nothing_here_imports_one():
    for old, new in MOVED.items():
        assert not (ROOT / Path(*old.split("."))).with_suffix(".py").exists(), old
        assert (ROOT / Path(*new.split("."))).with_suffix(".py").exists(), new
    users = []
    for folder in ("orchmllm", "tests", "benchmarks", "examples"):
        for path in (ROOT / folder).rglob("*.py"):
            if path == Path(__file__).resolve():
                continue  # imports old paths on purpose
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module:
                    # `from orchmllm import balance` is the public function, not a module
                    public = set(orchmllm.__all__) if node.module == "orchmllm" else set()
                    names = [node.module]
                    names += [f"{node.module}.{a.name}" for a in node.names if a.name not in public]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                else:
                    continue
                users += [f"{path.relative_to(ROOT)}: {n}" for n in names if n in MOVED]
    assert users == [], users
