#!/usr/bin/env bash
# One-call check of the GPU path, for the day a GPU machine is lent (docs/gpu-and-clusters.md, "GPU check"):
#   bash scripts/gpu-check.sh [--dry] [--wheels DIR] [OUT]
# Runs the study of config/gpu-check.yaml (single device, DDP, ZeRO-3, TP on a locally built
# Pythia-1B-shaped model in bf16 over every visible GPU; no hub) and writes OUT (default
# gpu-check-result/): the record <date>-<device>.json and .md (scripts/gpu-summary.py: tokens/s, MFU,
# allocator peak and bytes per category vs the memory model, loss vs single device with its tolerance,
# the planner's step time before and after calibration) and the tables it read.
# Needs the project's dependencies: `pip install -e .`, or on a machine with no package index whose
# Python holds torch, --wheels DIR (made by scripts/gpu-check-wheels.sh) installs the rest into a
# temporary folder first. <= 8 min on one H100 or H200.
# --dry: the same DAG and summary with tiny shapes on 2 CPU processes (CI runs it so it does not rot).
set -euo pipefail
cd "$(dirname "$0")/.."
configs=(config/gpu-check.yaml)
results=results-gpu-check
dry=false
while [ $# -gt 0 ]; do
  case "$1" in
    --dry) dry=true; shift ;;
    --wheels) wheels="$2"; shift 2 ;;
    *) break ;;
  esac
done
out="${1:-gpu-check-result}"
started=$(date +%s)
if [ -n "${wheels:-}" ]; then
  site=$(mktemp -d -t shardlab-site.XXXX)
  python3 -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheels"/*.whl
  # The rules start `python -m shardlab` and `python -m snakemake`: the project from its source tree,
  # the wheels ahead of the machine's packages, and `python` where the machine has only python3.
  mkdir -p "$site/bin"
  [ -x "$(command -v python)" ] || ln -s "$(command -v python3)" "$site/bin/python"
  export PYTHONPATH="$site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PATH="$site/bin:$PATH"
fi
if $dry; then
  configs+=(config/gpu-check-dry.yaml)
  results=results-gpu-check-dry
  export DS_ACCELERATOR=cpu
elif ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu-check: no CUDA device visible (use --dry for the CPU code path)" >&2
  exit 2
fi
python -c "import torch, deepspeed, snakemake, shardlab; print('gpu-check: torch', torch.__version__, '| CUDA',
           torch.version.cuda, '| deepspeed', deepspeed.__version__, '| snakemake', snakemake.__version__)"
# Only what the summary reads (rule runs_tables: the runs, ranks, parity and environment tables): no
# collective benchmark, planner or report, which the check does not need and device time is short.
python -m snakemake runs_tables --cores all --configfile "${configs[@]}"
python scripts/gpu-summary.py "$results" "$out"
echo "gpu-check: $(( $(date +%s) - started )) s; results in $out/"
