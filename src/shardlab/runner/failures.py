"""Why a run failed: the root cause, from the ranks' error files and torchrun's failure report.

When one rank dies, the others soon fail too, with errors that only say their peer went away
(gloo: `RuntimeError ... Connection closed/reset by peer`; NCCL: `DistBackendError`,
communicator aborted). Those are consequences, never the cause. The cause is, in this order:
the earliest error a rank raised itself (error_rank<N>.json, stamped with its time), else a rank
that torchrun saw die by a signal other than its own SIGTERM to the survivors (SIGKILL is most
often the kernel's out-of-memory killer), else a collective that outwaited the process-group
timeout (a peer hung: it raised nothing), else the earliest peer-disconnect error.
"""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

PEER_LOST = re.compile(r"closed by peer|reset by peer|broken pipe|remote worker|communicator was aborted|"
                       r"connection refused|NCCL error", re.IGNORECASE)
# A collective that waited past the process-group timeout: a peer hung (or is gone and nobody said).
COLLECTIVE_TIMEOUT = re.compile(r"timed out waiting|timeout after|watchdog caught collective operation timeout|"
                                r"operation timed out", re.IGNORECASE)
PEER_TYPES = {"DistBackendError", "DistNetworkError"}
# One failure in torchrun's ChildFailedError report (torch.distributed.elastic).
TORCHRUN_FAILURE = re.compile(r"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)")
OOM_SIGNALS = {signal.SIGKILL}


def is_peer_loss(error: dict) -> bool:
    return error["type"] in PEER_TYPES or bool(PEER_LOST.search(error.get("message") or ""))


def is_collective_timeout(error: dict) -> bool:
    return bool(COLLECTIVE_TIMEOUT.search(error.get("message") or ""))


def rank_errors(attempt: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(attempt.glob("error_rank*.json"))]


def signal_deaths(log: str) -> list[dict]:
    """Ranks torchrun reports dead by a signal, except the SIGTERM it sends the survivors."""
    deaths = {}
    for rank, code in TORCHRUN_FAILURE.findall(log):
        code = int(code)
        if code < 0 and -code != signal.SIGTERM:
            deaths[int(rank)] = signal.Signals(-code)
    return [{"rank": rank, "signal": sig.name, "oom": sig in OOM_SIGNALS} for rank, sig in sorted(deaths.items())]


def failures(attempt: Path, log: str) -> list[dict]:
    """Every failure seen, root cause first (see the module docstring for the order)."""
    errors = sorted(rank_errors(attempt), key=lambda e: e.get("time", float("inf")))
    timeouts = [dict(e, cause="collective timeout") for e in errors if is_collective_timeout(e)]
    peer = [dict(e, cause="peer lost") for e in errors if is_peer_loss(e) and not is_collective_timeout(e)]
    own = [dict(e, cause="error") for e in errors if not is_peer_loss(e) and not is_collective_timeout(e)]
    deaths = [dict(d, cause="signal") for d in signal_deaths(log)]
    return own + deaths + timeouts + peer


def describe(failure: dict) -> str:
    if failure["cause"] == "collective timeout":
        return (f"rank {failure['rank']}: collective timed out (launch.collective_timeout_s): a peer hung or "
                f"vanished; {failure['message'].strip().splitlines()[0][:300] if failure.get('message') else ''}")
    if failure["cause"] == "signal":
        why = " (most often the kernel's out-of-memory killer)" if failure["oom"] else ""
        return f"rank {failure['rank']}: killed by {failure['signal']}{why}"
    first_line = (failure.get("message") or "").strip().splitlines()
    return f"rank {failure['rank']}: {failure['type']}: {first_line[0][:400] if first_line else ''}".rstrip(": ")


def failure_outcome(attempt: Path, rc: int | None, stopped: str | None, timeout_s: float) -> dict:
    """{status, reason, failures} of a run that did not finish."""
    log = (attempt / "run.log").read_text(errors="replace") if (attempt / "run.log").exists() else ""
    seen = failures(attempt, log)
    if stopped == "timeout":
        status, reason = "failed", f"timed out after {timeout_s:g} s (launch.timeout_s); the run was stopped"
    elif stopped:
        status, reason = "failed", f"interrupted by {stopped} (the job was cancelled); the run was stopped"
    elif seen:
        status = "oom" if seen[0].get("oom") else "failed"
        reason = describe(seen[0])
    else:
        lines = log.strip().splitlines()
        tail = next((line for line in reversed(lines) if "Error" in line), lines[-1] if lines else "no output")
        status, reason = "failed", f"exit code {rc}: {tail[:500]}"
    return {"status": status, "reason": reason, "failures": [describe(f) for f in seen]}
