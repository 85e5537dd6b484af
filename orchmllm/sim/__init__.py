"""Cluster-scale simulator: what post-balancing does at thousands of GPUs, without GPUs.

The same planner the training uses (``orchmllm.balance``, ``orchmllm.planner.placement``) lays out a
sampled global batch; a compute model calibrated on measured H100 blocks (recompute charged
under activation checkpointing), a communication model of the paper's cluster from the H100's
published link speeds and a memory model that replays the trainer's step under the run's training
recipe (``orchmllm.sim.memory``) turn the layout into a step time, an MFU and a peak memory per
phase. Items longer than a rank may be split over a context-parallel group
(``orchmllm.sim.context_parallel``: the pieces' compute, gathers and memory). No constant is
fitted to a paper result, nor the memory model to a measurement.
``benchmarks/reproduce_paper.py`` sweeps it against the paper's section 8.
"""
