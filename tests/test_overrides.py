"""orchmllm.overrides: a config key's command-line text is read by the key's type, and a bad
key or value is an error naming both."""

from __future__ import annotations

import dataclasses
import re

import pytest

from orchmllm.config import RunConfig
from orchmllm.overrides import override_value


def typed(key: str, text: str):
    """``text`` read as the run config's key ``key``."""
    return override_value(key, text, RunConfig)


@dataclasses.dataclass(frozen=True)
class _Inner:
    names: list[str] = dataclasses.field(default_factory=list)
    sizes: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class _Outer:
    inner: _Inner = dataclasses.field(default_factory=_Inner)


def test_an_override_is_read_by_its_keys_type():
    assert typed("train.steps", "3") == 3
    assert typed("train.lr", "3e-4") == 3e-4
    assert typed("model.llm.layers", "4") == 4  # a nested section
    assert typed("model.encoders.vision.patch", "7") == 7  # an encoder's own key
    for text, value in (("false", False), ("yes", True), ("0", False), ("On", True)):
        assert typed("train.sync_micro_steps", text) is value
    assert typed("balance.ranks_per_node", "null") is None  # an optional key
    assert typed("balance.policies.llm", "greedy") == "greedy"  # a mapping's key
    assert typed("balance.costs.llm.alpha", "2") == 2.0
    assert typed("data.tasks", "{vqa: {weight: 2}}") == {"vqa": {"weight": 2}}
    assert typed("model.encoders.audio", "null") is None  # drops the encoder
    assert override_value("inner.names", "a,b", _Outer) == ["a", "b"]  # lists
    assert override_value("inner.sizes", "[1, 2]", _Outer) == [1, 2]


@pytest.mark.parametrize(
    ("key", "text", "message"),
    [
        ("train.step", "3", "'train.step' (given '3') has no such key; did you mean 'train.steps'"),
        ("trian.steps", "3", "did you mean 'train'"),
        ("model.llm.hiden", "8", "did you mean 'model.llm.hidden'"),
        ("train.steps.x", "1", "train.steps is a single value, it has no key 'x'"),
        ("train.steps", "many", "'train.steps' (given 'many') must be an integer"),
        ("train.lr", "fast", "(given 'fast') must be a number"),
        ("train.sync_micro_steps", "maybe", "(given 'maybe') must be true or false"),
        ("data.tasks", "[1]", "(given '[1]') must be a mapping"),
    ],
)
def test_a_bad_override_names_the_key_and_the_value(key, text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        typed(key, text)
    with pytest.raises(ValueError, match=re.escape("must be an integer")):
        override_value("inner.sizes", "1,x", _Outer)
