#!/usr/bin/env bash
# One-call check of the GPU path, for the day a GPU machine is lent (docs/gpu-and-clusters.md, "GPU check"):
#   bash scripts/gpu-check.sh [--dry] [OUT]
# Runs the study of config/gpu-check.yaml (single device, DDP, ZeRO-3, TP on a locally built
# Pythia-1B-shaped model in bf16 over every visible GPU; no hub) and writes OUT (default
# gpu-check-result/): summary.md and summary.json (tokens/s, MFU vs the bf16 peak, allocator peak and
# model-state bytes vs the memory model, loss vs single device with its tolerance) and the tables.
# Installs nothing beyond the project (`pip install -e .` done); <= 8 min on one H200.
# --dry: the same DAG and summary with tiny shapes on 2 CPU processes (CI runs it so it does not rot).
set -euo pipefail
cd "$(dirname "$0")/.."
configs=(config/gpu-check.yaml)
results=results-gpu-check
if [ "${1:-}" = "--dry" ]; then
  shift
  configs+=(config/gpu-check-dry.yaml)
  results=results-gpu-check-dry
  export DS_ACCELERATOR=cpu
elif ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu-check: no CUDA device visible (use --dry for the CPU code path)" >&2
  exit 2
fi
out="${1:-gpu-check-result}"
started=$(date +%s)
# Only what the summary reads (rule runs_tables: the runs, ranks, parity and environment tables): no
# collective benchmark, planner or report, which the check does not need and device time is short.
snakemake runs_tables --cores all --configfile "${configs[@]}"
python scripts/gpu-summary.py "$results" "$out"
echo "gpu-check: $(( $(date +%s) - started )) s; results in $out/"
