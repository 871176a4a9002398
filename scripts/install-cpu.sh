#!/usr/bin/env bash
# Create .venv and install shardlab for CPU: the pinned CPU torch first (an unpinned torch would
# pull a multi-GB CUDA build), then the package with its science and test extras.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
python -m pip install --quiet torch==2.13.0
python -m pip install --quiet -e ".[science,test]"
# DeepSpeed's CPU accelerator compiles its shared-memory collective op the first time a process group
# starts (about 50 s on 2 cores); build it now, so that no run's measured set-up time includes a compile.
DS_ACCELERATOR=cpu python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
python -c "import torch, deepspeed, snakemake; print('installed: torch', torch.__version__, '| deepspeed', deepspeed.__version__)"
