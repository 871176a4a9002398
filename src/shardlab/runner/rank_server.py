"""A rank server: ranks forked from a process that has already imported torch, transformers' GPT-NeoX
and the study's worker, so that a launch pays those imports once per server instead of once per rank.

On 2 cores a launch spent ~6.8 s of fixed cost, ~6 s of it interpreters importing torch and
transformers (the agent, then each rank; docs/measurements.md, "Launch cost"). With a server
(`shardlab.runner.fork_server`) the launcher's command is `rank_client.py`, a stdlib-only script,
asking for torchrun's agent; the agent starts `rank_client.py` per rank (`--no-python`), asking for the
rank's module. Each client hands the server its module, argv, environment, working folder and stdio
over a unix socket; the server forks, and the child takes them and runs the module as `python -m`
would. The client reports the child's exit status as its own and forwards SIGTERM/SIGINT to it; when
the client dies the server kills the child. So to torchrun, and to the launcher, each forked process
is one process that exits as it did.

What the fork shares is only imported code: the server never runs a torch operation (no thread pool,
no process group, no device), every rank gets its own environment (`os.environ`, which torch and
gloo read after the fork), and what torch reads at import is part of the server's key (SERVER_ENV:
`ATEN_CPU_CAPABILITY`, `OMP_NUM_THREADS`, ...; and the code of shardlab, torch and transformers), so
a run never lands in a server whose imports saw other settings or older code. A server exits after
`IDLE_S` without ranks. Used on CPU runs of one node (`launch.rank_server`); GPU runs start their
ranks as torchrun does.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

CLIENT = Path(__file__).with_name("rank_client.py")
IDLE_S = 300.0  # a server without ranks for this long exits (the next launch starts another, ~5 s)
START_TIMEOUT_S = 120.0  # the imports take ~5 s on a busy 2-core machine
# Environment variables read while importing torch, transformers or the worker: a server serves only
# launches that agree on them. Read after the fork (rendezvous, per-rank settings): not part of it.
SERVER_ENV = ("ATEN_", "OMP_", "MKL_", "KMP_", "GOMP_", "TORCH", "PYTORCH_", "PYTHON", "DS_", "CUDA_", "HF_",
              "TRANSFORMERS_", "TOKENIZERS_", "LD_")
# Set per launch by run_torchrun; and the inductor cache folder, which torch writes into the environment
# (its default) once a process asks for it, so that a launcher's own torch use would split the servers.
PER_LAUNCH_ENV = ("TORCHELASTIC_", "TORCHINDUCTOR_CACHE_DIR")


def state_dir() -> Path:
    """Sockets, locks, logs and the forked-rank registry, private to this user. Where the environment
    says (not `tempfile`'s per-process choice): every launcher of this user must find the same servers."""
    base = os.environ.get("XDG_RUNTIME_DIR") or os.environ.get("TMPDIR") or "/tmp"
    path = Path(base) / f"shardlab-ranks-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def _code_fingerprint() -> list:
    """Where shardlab is and its source files (name, mtime, size), and where torch and transformers are
    installed: another checkout, an edit or a reinstall makes a new server."""
    root = Path(__file__).resolve().parents[1]
    files = sorted(root.rglob("*.py"))
    stamps = [str(root), *((str(p.relative_to(root)), p.stat().st_mtime_ns, p.stat().st_size) for p in files)]
    for package in ("torch", "transformers"):
        spec = importlib.util.find_spec(package)
        origin = Path(spec.origin) if spec and spec.origin else None
        stamps.append((package, str(origin), origin.stat().st_mtime_ns if origin else None))
    return stamps


def import_settings(env: dict) -> list[tuple[str, str]]:
    """The variables of `env` that importing torch, transformers or the worker may read (SERVER_ENV)."""
    return sorted((k, v) for k, v in env.items() if k.startswith(SERVER_ENV) and not k.startswith(PER_LAUNCH_ENV))


def server_key(env: dict) -> str:
    """What a server's imports depend on: interpreter, code, and the import-time environment."""
    blob = json.dumps([sys.executable, import_settings(env), _code_fingerprint()])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def ping(path: Path) -> bool:
    """Whether a server answers at `path`."""
    try:
        with socket.socket(socket.AF_UNIX) as conn:
            conn.settimeout(5.0)
            conn.connect(str(path))
            conn.sendall((0).to_bytes(8, "big"))
            return conn.recv(3) == b"ok\n"
    except OSError:
        return False


def server_for(env: dict, timeout_s: float = START_TIMEOUT_S) -> Path | None:
    """The socket of a running server for launches with `env`, started (detached, in `env`) if there is
    none. None when it did not come up within `timeout_s`: the caller launches as torchrun does."""
    key = server_key(env)
    path = state_dir() / f"{key}.sock"
    if ping(path):
        return path
    with (state_dir() / f"{key}.log").open("a") as log:
        server = subprocess.Popen([sys.executable, "-m", "shardlab.runner.fork_server", str(path)], env=env, cwd="/",
                                  stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    deadline = time.time() + timeout_s
    while time.time() < deadline:  # a server already starting (another launcher's) answers too
        if ping(path):
            return path
        if server.poll():  # it failed (exit 0: another launcher's server holds the lock; wait for it)
            return None
        time.sleep(0.05)
    return None


# ---- the ranks a server forked, for `runner.process`: their command line is the server's ----

def registry() -> Path:
    """One file per forked process, `<pid>.json` with its argv, written and removed by its server."""
    path = state_dir() / "ranks"
    path.mkdir(exist_ok=True)
    return path


def forked_ranks(tag: str) -> dict[int, list[str]]:
    """{pid: [module, *argv]} of the live forked processes whose arguments name `tag` (a run folder)."""
    found = {}
    try:
        entries = list(registry().glob("*.json"))
    except OSError:  # no folder for servers here: none forked anything
        return found
    for entry in entries:
        try:
            argv = json.loads(entry.read_text())["argv"]
        except (OSError, ValueError, KeyError):
            continue  # being written or removed
        if any(tag in arg for arg in argv) and _alive(int(entry.stem)):
            found[int(entry.stem)] = argv
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
