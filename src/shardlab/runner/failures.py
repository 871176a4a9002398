"""Why a run failed: the root cause, from torchrun's structured error files, and the printed output
only for what leaves no error file.

Each rank's entry point is decorated with `record` (below: torch's `@record`), so an exception that
escapes a rank is written by torch's ErrorHandler (torch/distributed/elastic/multiprocessing/errors/
error_handler.py) as JSON to the file torchrun names in the rank's TORCHELASTIC_ERROR_FILE,
<log dir>/<run id>_*/attempt_<n>/<local rank>/error.json:

    {"message": {"message": "<exception type>: <str(exception)>",
                 "extraInfo": {"py_callstack": "<traceback.format_exc()>", "timestamp": "<int seconds>",
                               "rank": <global rank>, "time": <float seconds>}}}

(`rank` and `time` are added here: torch's file names neither the global rank nor the time to better
than a second). torchrun's own `@record` copies the first rank's file (smallest timestamp) to the
agent's TORCHELASTIC_ERROR_FILE, or writes its own failure there (e.g. a rendezvous error).

When one rank dies, the others soon fail too, with errors that only say their peer went away
(gloo: `RuntimeError ... Connection closed/reset by peer`; NCCL: `DistBackendError`,
communicator aborted). Those are consequences, never the cause. The cause is, in this order:
the earliest error a rank raised itself, else a rank that torchrun saw die by a signal other than
its own SIGTERM to the survivors (SIGKILL is most often the kernel's out-of-memory killer; a signal
leaves no error file, so this one comes from torchrun's printed report), else a collective that
outwaited the process-group timeout (a peer hung: it raised nothing), else the earliest
peer-disconnect error, else torchrun's own error.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import time
import traceback
from pathlib import Path

from shardlab.errors import Interrupted
from shardlab.runner.process import AGENT_ERROR_FILE, RANK_LOG_DIR, Outcome

PEER_LOST = re.compile(r"closed by peer|reset by peer|broken pipe|remote worker|communicator was aborted|"
                       r"connection refused|NCCL error", re.IGNORECASE)
# A collective that waited past the process-group timeout: a peer hung (or is gone and nobody said).
COLLECTIVE_TIMEOUT = re.compile(r"timed out waiting|timeout after|watchdog caught collective operation timeout|"
                                r"operation timed out", re.IGNORECASE)
PEER_TYPES = {"DistBackendError", "DistNetworkError"}
OOM_TYPES = {"OutOfMemoryError", "MemoryError"}
# One failure in torchrun's printed ChildFailedError report: the only record of a rank killed by a signal.
TORCHRUN_FAILURE = re.compile(r"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)")
OOM_SIGNALS = {signal.SIGKILL}
TRACEBACK_TAIL_CHARS = 2000


# --- the ranks' side: torch's @record, with the global rank and the time in the file ----------------
def record(entry_point):
    """torch's `@record` (torch.distributed.elastic.multiprocessing.errors) for a rank's entry point.
    torch is imported at the first call, not at decoration: the launcher imports this module too."""

    @functools.wraps(entry_point)
    def recorded(*args, **kwargs):
        from torch.distributed.elastic.multiprocessing.errors import record as torch_record

        return torch_record(entry_point, error_handler=_ranked_error_handler())(*args, **kwargs)

    return recorded


def _ranked_error_handler():
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    class RankedErrorHandler(ErrorHandler):
        """torch's error file, with the global rank and the time to the microsecond in `extraInfo`, written
        whole or not at all: a rank stopped by the agent while writing it (its peers' failure stops them all)
        would otherwise leave a partial file, which torchrun's agent then fails to parse, losing the root
        cause (seen on a 4-rank run whose rank 1 was killed)."""

        def record_exception(self, e: BaseException) -> None:
            path = self._get_error_file_path()
            if not path:
                return
            info = {"py_callstack": traceback.format_exc(), "timestamp": str(int(time.time())),
                    "rank": int(os.environ.get("RANK", 0)), "time": time.time()}
            partial = f"{path}.partial"
            Path(partial).write_text(json.dumps({"message": {"message": f"{type(e).__name__}: {e}", "extraInfo": info}}))
            os.replace(partial, path)  # atomic: the agent reads a whole file or none

    return RankedErrorHandler()


# --- the launcher's side: reading the files ---------------------------------------------------------
def parse_error_file(data: dict, rank: int | None) -> dict:
    """One error file -> {rank, type, message, time, oom, traceback}. `rank`: where the file does not
    say (torch's plain @record), the rank its folder names."""
    message = data.get("message")
    if isinstance(message, dict):
        text, info = message.get("message", ""), message.get("extraInfo", {})
    else:  # torch's other format: {"message": "<text>", "timestamp": ...}
        text, info = str(message or ""), {"timestamp": data.get("timestamp", 0)}
    type_, _, said = text.partition(": ")
    callstack = info.get("py_callstack") or ""
    return {"rank": info.get("rank", rank), "type": type_, "message": said,
            "time": float(info.get("time", info.get("timestamp", 0))), "oom": is_out_of_memory(type_, said),
            "traceback": callstack[-TRACEBACK_TAIL_CHARS:]}


def is_out_of_memory(type_: str, message: str) -> bool:
    return type_ in OOM_TYPES or "out of memory" in message.lower()


def is_peer_loss(error: dict) -> bool:
    return error["type"] in PEER_TYPES or bool(PEER_LOST.search(error.get("message") or ""))


def is_collective_timeout(error: dict) -> bool:
    return bool(COLLECTIVE_TIMEOUT.search(error.get("message") or ""))


def rank_errors(run_dir: Path) -> list[dict]:
    """Every rank's error file under the run's torchrun log folder. A file that is not whole JSON was
    being written when the run's ranks were stopped (a peer's failure stops them all): it says nothing."""
    errors = []
    for path in sorted((run_dir / RANK_LOG_DIR).glob("*/attempt_*/*/error.json")):
        try:
            errors.append(parse_error_file(json.loads(path.read_text()), int(path.parent.name)))
        except json.JSONDecodeError:
            continue
    return errors


def agent_error(run_dir: Path) -> list[dict]:
    """torchrun's own error file, when no rank left one (else it is only a copy of a rank's)."""
    path = run_dir / AGENT_ERROR_FILE
    if not path.exists():
        return []
    return [parse_error_file(json.loads(path.read_text()), None)]


def signal_deaths(log: str) -> list[dict]:
    """Ranks torchrun reports dead by a signal, except the SIGTERM it sends the survivors."""
    deaths = {}
    for rank, code in TORCHRUN_FAILURE.findall(log):
        code = int(code)
        if code < 0 and -code != signal.SIGTERM:
            deaths[int(rank)] = signal.Signals(-code)
    return [{"rank": rank, "signal": sig.name, "oom": sig in OOM_SIGNALS} for rank, sig in sorted(deaths.items())]


def failures(run_dir: Path, log: str) -> list[dict]:
    """Every failure seen, root cause first (see the module docstring for the order)."""
    errors = sorted(rank_errors(run_dir), key=lambda e: (e["time"], e["rank"]))
    timeouts = [dict(e, cause="collective timeout") for e in errors if is_collective_timeout(e)]
    peer = [dict(e, cause="peer lost") for e in errors if is_peer_loss(e) and not is_collective_timeout(e)]
    own = [dict(e, cause="error") for e in errors if not is_peer_loss(e) and not is_collective_timeout(e)]
    deaths = [dict(d, cause="signal") for d in signal_deaths(log)]
    agent = [] if errors else [dict(e, cause="error") for e in agent_error(run_dir)]
    return own + deaths + timeouts + peer + agent


def describe(failure: dict) -> str:
    if failure["cause"] == "collective timeout":
        return (f"rank {failure['rank']}: collective timed out (launch.collective_timeout_s): a peer hung or "
                f"vanished; {failure['message'].strip().splitlines()[0][:300] if failure.get('message') else ''}")
    if failure["cause"] == "signal":
        why = " (most often the kernel's out-of-memory killer)" if failure["oom"] else ""
        return f"rank {failure['rank']}: killed by {failure['signal']}{why}"
    who = "torchrun" if failure["rank"] is None else f"rank {failure['rank']}"  # None: the agent's own error
    first_line = (failure.get("message") or "").strip().splitlines()
    return f"{who}: {failure['type']}: {first_line[0][:400] if first_line else ''}".rstrip(": ")


def last_error_line(log: str, returncode: int | None) -> str:
    """The printed output's last line naming an error: the reason when nothing wrote an error file."""
    lines = log.strip().splitlines()
    tail = next((line for line in reversed(lines) if "Error" in line), lines[-1] if lines else "no output")
    return f"exit code {returncode}: {tail[:500]}"


def failure_outcome(outcome: Outcome, timeout_setting: str = "launch.timeout_s") -> dict:
    """{status, reason, failures[, traceback]} of a launch that did not finish. `timeout_setting`: the
    config field whose deadline stopped it, for the reason."""
    log = outcome.log.read_text(errors="replace") if outcome.log.exists() else ""
    seen = failures(outcome.run_dir, log)
    if outcome.stopped == "timeout":
        status = "failed"
        reason = f"timed out after {outcome.timeout_s:g} s ({timeout_setting}); the run was stopped"
    elif outcome.stopped:
        status, reason = "failed", f"interrupted by {outcome.stopped} (the job was cancelled); the run was stopped"
    elif seen:
        status = "oom" if seen[0].get("oom") else "failed"
        reason = describe(seen[0])
    else:
        status, reason = "failed", last_error_line(log, outcome.returncode)
    result = {"status": status, "reason": reason, "failures": [describe(f) for f in seen]}
    if seen and seen[0].get("traceback") and not outcome.stopped:
        result["traceback"] = seen[0]["traceback"]  # where the root cause was raised
    return result


def launch_failure(outcome: Outcome, output: Path, timeout_setting: str) -> str | None:
    """None when a launch finished and wrote `output`, else why not (one line, for a table's reason).
    Raises process.Interrupted when the launcher itself was interrupted: the job must fail."""
    if outcome.interrupted:
        raise Interrupted(signal.Signals[outcome.stopped])
    if outcome.finished and output.exists():
        return None
    if outcome.finished:
        return f"torchrun finished but wrote no {output.name}"
    return failure_outcome(outcome, timeout_setting)["reason"]
