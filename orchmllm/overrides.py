"""Config keys as command-line options: ``--section.key=value`` read by the key's type.

The run config's dataclasses are the schema: a dotted key is walked through them to its field,
and the command line's text is read as that field's type. So a knob is written once, as a
field; its option follows. Torch-free, below :mod:`orchmllm.config`, which lays the values on
a config file (``load_config(path, overrides)``).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping
from typing import Any

import yaml

from orchmllm.models.spec import ARCHS, EncoderConfig

__all__ = ["closest", "override_value"]


def closest(value: str, valid: list[str]) -> str:
    """ "did you mean ..." for ``value`` among ``valid`` (or the valid list when none is close)."""
    close = difflib.get_close_matches(value, valid, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"{hint}(valid: {sorted(valid)})"


def _unwrap(hint: Any) -> tuple[Any, bool]:
    """``X | None`` -> (X, True); anything else -> (itself, False)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        return rest[0], len(rest) < len(typing.get_args(hint))
    return hint, False


def _schema(cls: type) -> dict[str, Any]:
    """A section's keys and their types; an encoder's are those of every architecture (its
    ``arch`` picks one when the config is built, which then names a key it lacks)."""
    if cls is EncoderConfig:
        keys = {"arch": str}
        for arch in ARCHS.values():
            keys.update(_schema(arch))
        return keys
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def _key_type(key: str, schema: type) -> Any:
    """The type of config key ``key`` (dotted), walking the dataclasses from ``schema``; a
    mapping's keys are free (the built config checks them)."""
    hint: Any = schema
    parts = key.split(".")
    for i, part in enumerate(parts):
        hint, _ = _unwrap(hint)
        here = ".".join(parts[:i])
        if dataclasses.is_dataclass(hint):
            keys = _schema(hint)
            if part not in keys:
                valid = [f"{here}.{k}" if here else k for k in keys]
                typed = ".".join(parts[: i + 1])
                raise ValueError(f"has no such key; {closest(typed, valid)}")
            hint = keys[part]
        elif typing.get_origin(hint) is Mapping:
            hint = typing.get_args(hint)[1]
        else:
            raise ValueError(f"{here} is a single value, it has no key {part!r}")
    return hint


_BOOLS = {"true": True, "yes": True, "on": True, "1": True,
          "false": False, "no": False, "off": False, "0": False}  # fmt: skip


def _parse(text: str, hint: Any) -> Any:
    """``text`` read as a value of type ``hint``; ValueError saying what it must be."""
    hint, optional = _unwrap(hint)
    if optional and text.strip().lower() in ("null", "none", "~"):
        return None
    if hint is bool:
        if text.strip().lower() not in _BOOLS:
            raise ValueError("must be true or false")
        return _BOOLS[text.strip().lower()]
    if hint in (int, float):
        try:
            return hint(text)
        except ValueError:
            raise ValueError(f"must be {'an integer' if hint is int else 'a number'}") from None
    if hint is str:
        return text
    origin = typing.get_origin(hint)
    if origin in (list, tuple):
        items = yaml.safe_load(text) if text.lstrip().startswith("[") else text.split(",")
        if not isinstance(items, list):
            raise ValueError("must be a list: [a, b] or a,b")
        item = (typing.get_args(hint) or (str,))[0]
        return [_parse(str(x), item) for x in items]
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        value = text
    if value is not None and not isinstance(value, Mapping):  # a section: null drops it
        raise ValueError("must be a mapping: {key: value, ...} (or null)")
    return value


def override_value(key: str, text: str, schema: type) -> Any:
    """The value of config key ``key`` (dotted: ``train.steps``, ``model.llm.layers``,
    ``balance.policies.llm``) that command-line text ``text`` gives, read by the key's type
    in the dataclasses from ``schema`` (``orchmllm.config.RunConfig`` for a run config): a
    number, a bool (true/false, yes/no, on/off, 1/0), a string, null for an optional key, a
    list (``[a, b]`` or ``a,b``), a mapping or a section as YAML
    (``{vqa: 2}``, merged key by key into the file's as under ``base:``; null drops a section
    such as an encoder). This is the one place a key becomes a command-line option; the
    built config still checks the value's range.

    Raises:
        ValueError: an unknown key (naming the closest ones) or a value of the wrong type,
            naming the key and the value.
    """
    try:
        return _parse(text, _key_type(key, schema))
    except ValueError as exc:
        raise ValueError(f"config key {key!r} (given {text!r}) {exc}") from None
