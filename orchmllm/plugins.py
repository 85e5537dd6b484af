"""Plugins: a user's own modality, encoder architecture, data task, policy or model adapter,
in a file of their own, loaded before a run's config is checked.

A plugin is a Python module name (``my_project.imu``) or the path of a ``.py`` file
(``plugins/imu.py``). Importing it registers what it defines through the public registries
(``orchmllm.register_modality``, ``register_architecture``, ``register_task``,
``register_policy``); the trainer loads the ``--plugin`` ones and a config's ``plugins:`` list
on every rank, before the config is built. Loading is idempotent: a plugin imported once (by
name, or by its file's resolved path) is not run again.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Iterable
from types import ModuleType

__all__ = ["load_plugin", "load_plugins"]


def _module_name(path: str) -> str:
    """The module name of a plugin file: the same in every process that loads that file (so
    its classes pickle between ranks), unique per resolved path."""
    stem = os.path.splitext(os.path.basename(path))[0]
    digest = hashlib.sha256(path.encode()).hexdigest()[:12]
    return f"orchmllm_plugin_{digest}_{stem}"


def load_plugin(plugin: str) -> ModuleType:
    """Import one plugin: a module name, or a ``.py`` file's path.

    Args:
        plugin: ``package.module`` or ``path/to/file.py`` (relative to the working directory).

    Returns:
        The plugin's module.

    Raises:
        ValueError: ``plugin`` is not a non-empty string, names no file or module, or its
            import fails (the message names the plugin and the cause).
    """
    if not isinstance(plugin, str) or not plugin:
        raise ValueError(f"plugin must be a module name or a .py path, got {plugin!r}")
    if plugin.endswith(".py") or os.sep in plugin:
        path = os.path.realpath(plugin)
        if not os.path.isfile(path):
            raise ValueError(f"plugin {plugin!r}: no such file (from {os.getcwd()})")
        name = _module_name(path)
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            del sys.modules[name]
            raise ValueError(f"plugin {plugin!r} failed to load: {exc!r}") from exc
        return module
    try:
        return importlib.import_module(plugin)
    except ModuleNotFoundError as exc:
        if exc.name is not None and plugin.startswith(exc.name):
            raise ValueError(
                f"plugin {plugin!r}: no module named {exc.name!r} (a module on PYTHONPATH or a "
                ".py file's path)"
            ) from None
        raise ValueError(f"plugin {plugin!r} failed to load: {exc!r}") from exc
    except Exception as exc:
        raise ValueError(f"plugin {plugin!r} failed to load: {exc!r}") from exc


def load_plugins(plugins: Iterable[str] | None) -> list[ModuleType]:
    """Import every plugin of ``plugins`` in order (:func:`load_plugin`).

    Args:
        plugins: module names or ``.py`` paths (None: none).

    Returns:
        Their modules, in order.

    Raises:
        ValueError: ``plugins`` is a string rather than a list of them, or one fails.
    """
    if isinstance(plugins, str):
        raise ValueError(f"plugins must be a list of module names or paths, got {plugins!r}")
    return [load_plugin(p) for p in plugins or ()]
