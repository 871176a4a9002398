#!/usr/bin/env bash
# Rehearse the GPU check's software on this machine before a GPU is lent (docs/gpu-and-clusters.md,
# "GPU check"): a virtual environment shaped like the lent machine's image (Python 3.12, PyTorch
# 2.11.0 built for CUDA 13.0, the image's transformers and numpy; no Snakemake, DeepSpeed, jsonschema
# or pydantic), then `gpu-check.sh --dry --wheels DIR` in it, as the lent machine would run it but on
# 2 CPU processes. What it cannot show: anything CUDA does.
#   bash scripts/gpu-check-rehearsal.sh [WHEELS=.whl] [VENV=/tmp/shardlab-image]
# Needs python3.12 and a package index (about 4.6 GB, most of it CUDA libraries that stay unused).
set -euo pipefail
cd "$(dirname "$0")/.."
wheels="${1:-.whl}"
venv="${2:-/tmp/shardlab-image}"
[ -d "$wheels" ] || bash scripts/gpu-check-wheels.sh "$wheels"
if [ ! -x "$venv/bin/python" ]; then
  python3.12 -m venv "$venv"
  # The image's versions where the device notes give them, the rest as the index has them.
  "$venv/bin/python" -m pip install --quiet torch==2.11.0 transformers==5.17.0 numpy==2.5.2 safetensors==0.8.0 \
    tokenizers==0.23.2 huggingface_hub==1.33.0 accelerate==1.15.0 pandas pyarrow pyyaml psutil jinja2 requests \
    tabulate packaging py-cpuinfo msgpack einops ninja nvidia-ml-py regex tqdm
  # What those pulled in that the image does not hold: the wheelhouse must bring it.
  "$venv/bin/python" -m pip uninstall --quiet --yes pydantic pydantic-core annotated-types typing-inspection tzdata
fi
PATH="$venv/bin:$PATH" bash scripts/gpu-check.sh --dry --wheels "$wheels" "$(mktemp -d)/gpu-check-rehearsal"
