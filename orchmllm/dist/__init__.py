"""The distributed layer (torch.distributed): the one ``Topology`` that owns the process
groups, the collectives and plan agreement, the ``BatchDispatcher``, the MLLM Global
``Orchestrator`` that executes a step's plans, the learned-cost ``Calibrator``, the rebalanced
step's loss, and ``watch``, which names the missing rank when a collective fails.
"""
