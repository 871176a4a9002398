#!/usr/bin/env bash
# Run every parity test (pytest -m parity) under each of torch's CPU kernel paths and report, per
# path, the largest deviation from the reference next to its tolerance (shardlab.tables.parity). This is
# how to see another CPU's rounding without owning one. Usage:
#   bash scripts/parity-across-cpus.sh [CAPABILITY ...]     (default: "default" and this CPU's own)
set -euo pipefail
cd "$(dirname "$0")/.."
export DS_ACCELERATOR=cpu
paths=("$@")
[ ${#paths[@]} -gt 0 ] || paths=(default native)
out=$(mktemp -d)
status=0
for cap in "${paths[@]}"; do
  echo "== ATEN_CPU_CAPABILITY=$cap"
  log="$out/$cap.jsonl"
  if [ "$cap" = native ]; then unset ATEN_CPU_CAPABILITY; else export ATEN_CPU_CAPABILITY=$cap; fi
  SHARDLAB_PARITY_LOG="$log" python -m pytest -q -p no:cacheprovider -m parity || status=1
done
python - "$out" "${paths[@]}" <<'PY'
import json, sys
from pathlib import Path
out, paths = Path(sys.argv[1]), sys.argv[2:]
for cap in paths:
    worst = {}  # (test file, kind of check) -> the row closest to (or furthest past) its tolerance
    for line in (out / f"{cap}.jsonl").read_text().splitlines():
        row = json.loads(line)
        key = (row["test"].split("::")[0].rsplit("/", 1)[-1], row["check"].split(":")[0])
        if key not in worst or row["deviation"] / row["tolerance"] > worst[key]["deviation"] / worst[key]["tolerance"]:
            worst[key] = row
    print(f"\nATEN_CPU_CAPABILITY={cap}: largest deviation per test file and kind of check")
    for (test, check), row in sorted(worst.items()):
        ratio = row["deviation"] / row["tolerance"]
        note = "  <- a can-fail test: must exceed" if ratio > 1 else ""
        print(f"  {test:<28} {check:<10} {row['deviation']:9.3g} / tolerance {row['tolerance']:9.3g} = {ratio:8.4f}{note}")
PY
exit $status
