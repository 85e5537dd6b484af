"""Cluster-scale simulator: what post-balancing does at thousands of GPUs, without GPUs.

The same planner the training uses (``orchmllm.balance``, ``orchmllm.placement``) lays out a
sampled global batch; a compute model calibrated on measured H100 blocks, a communication
model of the paper's cluster and a memory proxy turn the layout into a step time, an MFU and
a peak memory. ``benchmarks/reproduce_paper.py`` sweeps it against the paper's section 8.
"""
