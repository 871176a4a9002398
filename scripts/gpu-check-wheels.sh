#!/usr/bin/env bash
# A wheelhouse for running scripts/gpu-check.sh on a CUDA machine that cannot reach a package index
# but whose Python already holds torch (docs/gpu-and-clusters.md, "GPU check"):
#   bash scripts/gpu-check-wheels.sh [DIR] [PYTHON_VERSION]     # here, online; DIR defaults to .whl
#   bash scripts/gpu-check.sh --wheels DIR [OUT]                 # there, offline
# Takes every pin of scripts/gpu-check-wheels.txt as a binary wheel for that Python (default 3.12) on
# manylinux x86-64; a pin published only as source (DeepSpeed, connection_pool) is built here into a
# pure-Python wheel, and refused if the build is not one. Nothing else: the machine's own torch stays.
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-.whl}"
python_version="${2:-3.12}"
platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
  platforms+=(--platform "${tag}_x86_64")
done
mkdir -p "$dir"
grep -v '^#' scripts/gpu-check-wheels.txt | while read -r pin; do
  [ -n "$pin" ] || continue
  if ! python -m pip download --quiet --no-deps --only-binary=:all: --python-version "$python_version" \
      --implementation cp "${platforms[@]}" -d "$dir" "$pin" 2>/dev/null; then
    # Built in an isolated environment: no torch there, so DeepSpeed compiles none of its ops.
    python -m pip wheel --quiet --no-deps -w "$dir" "$pin"
  fi
done
impure=$(find "$dir" -type f -name '*.whl' ! -name '*-none-any.whl' ! -name "*-cp${python_version/./}-*manylinux*x86_64*.whl" \
  ! -name '*-abi3-*manylinux*x86_64*.whl')
if [ -n "$impure" ]; then
  echo "gpu-check-wheels: not for Python $python_version on manylinux x86-64: $impure" >&2
  exit 1
fi
echo "gpu-check-wheels: $(find "$dir" -type f -name '*.whl' | wc -l) wheels, $(du -sh "$dir" | cut -f1), in $dir/"
