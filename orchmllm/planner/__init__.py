"""The planner: which rank computes which item, torch-free (numpy and the C++ core).

``balance`` and its policies, the cost models (fixed and measured), node-wise placement, the
rearrangement plans, and the pure step planner ``plan_step`` that the orchestrator, the loader
and the simulator share. The public names are re-exported at ``orchmllm.*``.
"""
