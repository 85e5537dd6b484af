"""Reproduce the OrchMLLM paper's section 8 at cluster scale with the simulator.

For MLLM-10B/18B/84B (configs/mllm-*.yaml, Table 1 shapes) and 64..2560 simulated H100s this
prints, next to the figures the paper's text reports and the ratio between them:

- Figure 8 decomposed: per model and scale, the largest mini-batch without balancing and with
  OrchMLLM (both from the simulator's memory model, never the paper's settings), the speed-up
  of balancing at the no-balancing mini-batch, the speed-up of the larger mini-batch balancing
  allows, and their product (the MFU ratio), beside the paper's; the same decomposition at the
  paper's mini-batches (65/40/15 -> 80/60/30); at least ``FIG8_STEPS`` sampled steps per seed;
- Figure 9 from the same cases: LLM tokens per second per GPU, none and full, at both
  mini-batch settings (the Megatron-LM baseline is not simulated: see the notes);
- sensitivity: Figure 8 at both settings as every length is scaled (0.5x-3x) and as the audio
  tasks' share of the mix changes, and the length scale at which Table 2's forward time equals
  the paper's (a derived figure; the workload stays the config's);
- Figure 10 (encoder-balancing ablation, 128 GPUs, the paper's ablation mini-batch 75/50/25):
  none, llm, disttrain and full, MFU and peak memory; out-of-memory cases are marked OOM and
  report no MFU;
- Figure 11 (tailored algorithms vs one algorithm for both encoders, 128 GPUs);
- Figure 12 (the all-to-all dispatcher vs an all-gather communicator, 128 GPUs): dispatch time,
  MFU, peak memory, and the largest mini-batch the all-gather fits;
- Figure 13 (inter-node volume per dispatcher with and without node-wise placement, 128 GPUs);
- Table 2 (dispatch overhead and forward time vs GPUs, MLLM-10B, mini-batch 60, one seed), with
  the planning time of the real C++ planner and placement solver measured at that scale;
- validation: for every ``gpu_step_*.json`` record of ``benchmarks/gpu_step.py --json`` under
  ``--gpu-results``, the same set-up (model shape and layer counts, emulated ranks, examples per
  rank, the very examples, modes) simulated, and simulated vs measured step time and speed-up,
  and per phase measured / simulated time (mean and slowest rank) on that identical work.

Every speed-up is a mean with its min-max over ``--seeds`` seeds (5; 2 with ``--quick``). The
paper's figures are images; only the numbers its text states are compared. Everything here is a
model: see orchmllm/sim for what it includes and what it leaves out. The parts are in
``benchmarks/paper_repro/``, one module per group of figures.

    python benchmarks/reproduce_paper.py [--quick] [--json PATH] [--out DIR] [--gpu-results DIR]
"""

import sys

from paper_repro.cli import main

if __name__ == "__main__":
    sys.exit(main())
