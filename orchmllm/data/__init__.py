"""Data: the multimodal example schema, synthetic workloads, and the balanced loader.

The synthetic generator's and the loader's names are loaded on first use, so importing the
schema (as the orchestrator does) imports neither HF ``datasets`` nor torch.
"""

from orchmllm._lazy import lazy_names
from orchmllm.data.recipe import TASKS
from orchmllm.schema import (
    AUDIO,
    IMAGE,
    MODALITIES,
    TEXT,
    EncodingRates,
    ExampleMeta,
    Modality,
    Rate,
    example_metadata,
    register_modality,
    validate_example,
)

_LAZY = {  # name -> the module of orchmllm.data that defines it, imported on first use
    "SyntheticConfig": "synthetic",
    "as_example": "synthetic",
    "build_dataset": "synthetic",
    "generate_example": "synthetic",
    "BalancedDataLoader": "loader",
    "accumulate": "accumulation",
    "LoaderOptions": "options",
    "SamplingOptions": "options",
    "PlanningOptions": "options",
    "PlannedBatch": "loader",
    "BalancedCollator": "collate",
    "StepInfo": "exchange",
    "PeerFailed": "exchange",
    "EpochMismatch": "exchange",
    "BalancePlanner": "planners",
    "orchestrated_loader": "orchestrated",
    "map_lengths": "lengths",
    "dataset_lengths": "lengths",
}

__all__ = [
    "AUDIO",
    "IMAGE",
    "MODALITIES",
    "TASKS",
    "TEXT",
    "EncodingRates",
    "ExampleMeta",
    "Modality",
    "Rate",
    "example_metadata",
    "register_modality",
    "validate_example",
    *_LAZY,
]

__getattr__, __dir__ = lazy_names(__name__, _LAZY)
