"""OrchMLLM: post-balancing of variable-length mini-batches for data-parallel MLLM training.

The planner (``balance``, the cost models, ``Rearrangement`` and the step planner
``plan_step``) needs only numpy and the C++ core. The distributed parts (``BatchDispatcher``,
``Orchestrator``, ``BalancedDataLoader``, ...) import torch, so they load on first use:
``import orchmllm`` stays cheap and torch-free for planning-only users and the simulator.
"""

__version__ = "0.1.0"  # the one place it is set (pyproject.toml reads it)

try:
    import orchmllm._core  # noqa: F401  (the compiled planner; not in a fresh checkout)
except ImportError as exc:
    raise ImportError(
        "orchmllm._core, the compiled C++ planner, is not built for this Python: run "
        "`python setup.py build_ext --inplace` in the checkout's root (or `pip install -e .`)"
    ) from exc

from orchmllm import _moved  # noqa: F401  (old module paths keep importing)
from orchmllm._lazy import lazy_names
from orchmllm.planner.balance import Assignment, InfeasibleCapError, balance
from orchmllm.planner.cost import CostModel
from orchmllm.planner.measured_cost import COSTS
from orchmllm.planner.plan import Rearrangement
from orchmllm.planner.policies import POLICIES, PolicyInput, register_policy, unregister_policy
from orchmllm.planner.segments import local_metadata
from orchmllm.planner.step_options import EncoderPhase, ItemField, StepOptions
from orchmllm.planner.step_plan import StepPlan, plan_step

_LAZY = {
    "BatchDispatcher": "orchmllm.dist.dispatcher",
    "Orchestrator": "orchmllm.dist.orchestrator",
    "Calibrator": "orchmllm.dist.calibrator",
    "LocalBatch": "orchmllm.dist.orchestrator",
    "LLMBatch": "orchmllm.dist.orchestrator",
    "Encoded": "orchmllm.dist.orchestrator",
    "BalancedDataLoader": "orchmllm.data.loader",
    "accumulate": "orchmllm.data.accumulation",
    "LoaderOptions": "orchmllm.data.options",
    "SamplingOptions": "orchmllm.data.options",
    "PlanningOptions": "orchmllm.data.options",
    "PlannedBatch": "orchmllm.data.loader",
    "collate_layout": "orchmllm.data.planners",
    "BalancedCollator": "orchmllm.data.collate",
    "orchestrated_loader": "orchmllm.data.orchestrated",
    "global_num_items": "orchmllm.dist.loss",
    "token_log_probs": "orchmllm.dist.loss",
    "chunked_cross_entropy": "orchmllm.dist.loss",
    "TrainRecipe": "orchmllm.config",
    "Topology": "orchmllm.dist.topology",
    # the registries a plugin (orchmllm.plugins) extends, each read where it is used
    "Modality": "orchmllm.schema",
    "register_modality": "orchmllm.schema",
    "EncoderConfig": "orchmllm.models.spec",
    "register_architecture": "orchmllm.models.spec",
    "Task": "orchmllm.data.recipe",
    "TaskDraw": "orchmllm.data.recipe",
    "register_task": "orchmllm.data.recipe",
    "load_plugins": "orchmllm.plugins",
}

__all__ = [
    "COSTS",
    "POLICIES",
    "Assignment",
    "CostModel",
    "InfeasibleCapError",
    "PolicyInput",
    "Rearrangement",
    "EncoderPhase",
    "ItemField",
    "StepOptions",
    "StepPlan",
    "balance",
    "local_metadata",
    "plan_step",
    "register_policy",
    "unregister_policy",
    *_LAZY,
]

__getattr__, __dir__ = lazy_names(__name__, _LAZY)
