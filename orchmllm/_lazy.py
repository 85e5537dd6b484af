"""Names a package loads on first use, so importing it stays cheap.

``import orchmllm`` must not import torch (planning-only users and the simulator run without
it), and ``import orchmllm.data`` or ``orchmllm.models`` must not load the loader or the
modules behind their torch-free parts. Each such package lists its lazy names in a table
(name -> the module that defines it) and takes its module ``__getattr__`` and ``__dir__``
from :func:`lazy_names`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any

__all__ = ["lazy_names"]


def lazy_names(
    package: str, table: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of ``package`` for the names of ``table``
    (name -> a module path, or a module name inside ``package``), imported on first use."""

    def __getattr__(name: str) -> Any:
        if name in table:
            module = table[name] if "." in table[name] else f"{package}.{table[name]}"
            return getattr(import_module(module), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        """The public names, lazy ones included, so ``dir()``, ``help()`` and completion see
        them."""
        return sorted(set(vars(sys.modules[package])) | set(table))

    return __getattr__, __dir__
