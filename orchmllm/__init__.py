"""OrchMLLM: post-balancing of variable-length mini-batches for data-parallel MLLM training."""
