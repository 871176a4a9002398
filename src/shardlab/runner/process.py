"""Run torchrun as a process tree the launcher owns: output teed to the console and the log, a
deadline that holds even when the run prints nothing, and on every way out (finished, timed out,
SIGTERM/SIGINT to the launcher, an exception in the launcher) nothing of the run left running.

torchrun starts its ranks in sessions of their own, so killing torchrun's process group misses
them; and once torchrun is gone they are re-parented to init and no longer its children. The
tree is therefore found twice: the launcher's descendants, and every process whose command line
names the attempt folder (each rank gets `--out <attempt>`), which also finds orphans.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil

GRACE_S = 5.0  # between SIGTERM and SIGKILL: lets ranks flush their error files and logs


class Interrupted(Exception):
    """The launcher received SIGTERM or SIGINT (e.g. Snakemake cancelling the job)."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


def _raise_interrupted(signum, frame):
    raise Interrupted(signum)


def run_processes(tag: str) -> list[psutil.Process]:
    """Every live process whose command line contains `tag` (the attempt folder), except this one."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if proc.pid != psutil.Process().pid and any(tag in arg for arg in cmdline):
            found.append(proc)
    return found


def terminate_tree(root: subprocess.Popen, tag: str, grace_s: float = GRACE_S) -> list[int]:
    """SIGTERM the whole run (root, its descendants, any process naming `tag`), wait `grace_s`, then
    SIGKILL what is left. Returns the pids that had to be killed."""
    procs = {p.pid: p for p in run_processes(tag)}
    try:
        parent = psutil.Process(root.pid)
        procs.update({p.pid: p for p in [parent, *parent.children(recursive=True)]})
    except psutil.NoSuchProcess:
        pass
    for proc in procs.values():
        _signal(proc, signal.SIGTERM)
    _, alive = psutil.wait_procs(list(procs.values()), timeout=grace_s)
    alive += [p for p in run_processes(tag) if p.pid not in procs]  # started while we waited
    for proc in alive:
        _signal(proc, signal.SIGKILL)
    psutil.wait_procs(alive, timeout=grace_s)
    root.poll()
    return [p.pid for p in alive]


def _signal(proc: psutil.Process, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass


def console(text: str) -> None:
    """Print, best effort: the console may be gone (a `| tee` killed by the same Ctrl-C), and losing
    it must not lose the run's log or its recorded outcome."""
    try:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        sys.stdout.flush()
    except (BrokenPipeError, OSError):
        pass


def _tee(stream, log) -> None:
    for line in stream:
        log.write(line)  # the log first: it is the record
        log.flush()
        console(line)


def run_logged(cmd: list[str], log_path: Path, env: dict, timeout_s: float, tag: str) -> tuple[int | None, str | None]:
    """Run `cmd`, teeing its output (decoded as UTF-8, bad bytes replaced) to the console and to
    `log_path`. Returns (exit code, why it was stopped: None, 'timeout' or the signal's name).
    Raises nothing on a timeout or a signal: the tree is gone when this returns."""
    stopped = None
    with log_path.open("w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
                                encoding="utf-8", errors="replace", start_new_session=True)
        handlers = {sig: signal.signal(sig, _raise_interrupted) for sig in (signal.SIGTERM, signal.SIGINT)}
        reader = threading.Thread(target=_tee, args=(proc.stdout, log), daemon=True)
        reader.start()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stopped = "timeout"
        except Interrupted as err:
            stopped = signal.Signals(err.signum).name
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            terminate_tree(proc, tag)  # also on an exception of our own; a no-op for a finished run
            reader.join(timeout=GRACE_S)
    return proc.returncode, stopped
