"""Data: the multimodal example schema, synthetic workloads, and the balanced loader.

The synthetic generator's names are loaded on first use, so importing the schema (as the
orchestrator does) does not import HF ``datasets``.
"""

from typing import Any

from orchmllm.data.schema import (
    AUDIO,
    IMAGE,
    TASKS,
    TEXT,
    EncodingRates,
    ExampleMeta,
    example_metadata,
    validate_example,
)

_SYNTHETIC = ("SyntheticConfig", "as_example", "build_dataset", "generate_example")

__all__ = [
    "AUDIO",
    "IMAGE",
    "TASKS",
    "TEXT",
    "EncodingRates",
    "ExampleMeta",
    "example_metadata",
    "validate_example",
    *_SYNTHETIC,
]


def __getattr__(name: str) -> Any:
    if name in _SYNTHETIC:
        from orchmllm.data import synthetic

        return getattr(synthetic, name)
    raise AttributeError(f"module 'orchmllm.data' has no attribute {name!r}")
