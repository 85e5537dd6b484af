"""OrchMLLM: post-balancing of variable-length mini-batches for data-parallel MLLM training.

``balance`` and the cost models need only numpy and the C++ core. The distributed parts
(``Rearrangement``, ``BatchDispatcher``, ``Orchestrator``, ``BalancedDataLoader``) import torch,
so they load on first use: ``import orchmllm`` stays cheap for planning-only users.
"""

from importlib import import_module
from typing import Any

from orchmllm.balance import POLICIES, Assignment, balance
from orchmllm.cost import CostModel

_LAZY = {
    "Rearrangement": "orchmllm.plan",
    "EncoderPhase": "orchmllm.orchestrator",
    "StepPlan": "orchmllm.orchestrator",
    "local_metadata": "orchmllm.orchestrator",
    "plan_step": "orchmllm.orchestrator",
    "BatchDispatcher": "orchmllm.dispatcher",
    "Orchestrator": "orchmllm.orchestrator",
    "LocalBatch": "orchmllm.orchestrator",
    "LLMBatch": "orchmllm.orchestrator",
    "BalancedDataLoader": "orchmllm.data.loader",
    "LoaderOptions": "orchmllm.data.loader",
    "PlannedBatch": "orchmllm.data.loader",
    "BalancedCollator": "orchmllm.data.collate",
    "orchestrated_loader": "orchmllm.data.orchestrated",
}

__all__ = ["POLICIES", "Assignment", "CostModel", "balance", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'orchmllm' has no attribute {name!r}")
