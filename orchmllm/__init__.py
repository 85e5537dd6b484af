"""OrchMLLM: post-balancing of variable-length mini-batches for data-parallel MLLM training."""

from orchmllm.balance import POLICIES, Assignment, balance
from orchmllm.cost import CostModel

__all__ = ["POLICIES", "Assignment", "CostModel", "balance"]
