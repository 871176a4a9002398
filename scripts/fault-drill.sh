#!/usr/bin/env bash
# The fault drill: run the checkpoint/restart/resume tests (tests/test_resume.py, real torchrun, gloo
# on CPU) and tabulate every injected fault: which strategy, how it was recovered, the outcome, the
# restarts, the step it resumed from, the steps redone (at most training.checkpoint_every) and the wall
# time. The figures in docs/workflow.md, "Faults and resume", come from here. Usage:
#   bash scripts/fault-drill.sh [extra pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
export DS_ACCELERATOR=cpu
log=$(mktemp)
status=0
SHARDLAB_FAULT_LOG="$log" python -m pytest -q -p no:cacheprovider tests/test_resume.py "$@" || status=1
python - "$log" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
print(f"\n{len(rows)} faults injected; {sum(r['status'] == 'ok' for r in rows)} survived (the run finished)\n")
print("| strategy | family | fault | recovery | outcome | restarts | resumed from | steps redone | wall s |")
print("|---|---|---|---|---|---|---|---|---|")
for r in rows:
    lost = "" if r["steps_lost"] is None else r["steps_lost"]
    resumed = ", ".join(map(str, r["resumed_from"])) or "-"
    print(f"| {r['strategy']} | {r['family']} | {r['fault']} | {r['recovery']} | {r['status']} | {r['restarts']} "
          f"| {resumed} | {lost} | {r['wall_s']} |")
PY
exit $status
