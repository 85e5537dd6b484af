"""Data: the multimodal example schema, synthetic workloads, and the balanced loader."""

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
from orchmllm.data.synthetic import SyntheticConfig, as_example, build_dataset, generate_example

__all__ = [
    "AUDIO",
    "IMAGE",
    "TASKS",
    "TEXT",
    "EncodingRates",
    "ExampleMeta",
    "SyntheticConfig",
    "as_example",
    "build_dataset",
    "example_metadata",
    "generate_example",
    "validate_example",
]
