#!/usr/bin/env bash
# Regenerates docs/readme_loads.png, the README's plot: per-rank load of every phase before and
# after balancing, last step of a 10-step run of the tiny config on 4 CPU processes (gloo, 2 nodes
# of 2 ranks), --balance full. Also leaves the other plots and the summary in $OUT (default a
# temporary directory). Takes about a minute on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=4 -m orchmllm.train \
    --config configs/tiny.yaml --balance full --seed 0 --quiet \
    --metrics "$OUT/metrics.jsonl" --metrics-per-rank --data-dir "$OUT/data"
python -m orchmllm.train.report "$OUT/metrics.jsonl" --out "$OUT/report"
cp "$OUT/report/loads.png" docs/readme_loads.png
echo "wrote docs/readme_loads.png (metrics and report in $OUT)"
