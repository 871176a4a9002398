"""The rank server's process (`python -m shardlab.runner.fork_server SOCKET`, started by
`rank_server.server_for`): imports torch, transformers' GPT-NeoX and the worker once, then forks one
child per client request, which becomes the rank: the client's stdio, environment, folder and argv,
its module run as `python -m` runs it. How launches use it, and what keeps ranks isolated:
`shardlab.runner.rank_server`.
"""

from __future__ import annotations

import fcntl
import importlib
import json
import os
import runpy
import select
import signal
import socket
import sys
import time
import traceback
import warnings
from pathlib import Path

from shardlab.runner.metrics import FORKED_MARK
from shardlab.runner.rank_server import IDLE_S, START_TIMEOUT_S, import_settings, ping, registry


def preload_modules() -> list[str]:
    """What the server imports before it forks: torch, transformers' GPT-NeoX, the worker and every
    registered strategy's module (none of which imports DeepSpeed before a ZeRO run builds it)."""
    from shardlab.strategies import REGISTRY

    return ["torch", "torch.distributed", "torch.distributed.run", "transformers.models.gpt_neox.modeling_gpt_neox",
            "shardlab.runner.agent", "shardlab.runner.worker",
            *sorted({spec.target.split(":")[0] for spec in REGISTRY.values()})]


def _read_request(conn: socket.socket) -> tuple[dict | None, list[int]]:
    """(request, its three stdio fds); (None, []) for a ping or a client gone before it asked."""
    conn.settimeout(5.0)  # a client that connects and says nothing must not stall the server
    try:
        data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    except OSError:
        return None, []
    if len(data) < 8:
        return None, list(fds)
    size, body = int.from_bytes(data[:8], "big"), data[8:]
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            return None, list(fds)
        body += chunk
    conn.settimeout(None)
    return (json.loads(body) if size else None), list(fds)


def _become_rank(request: dict, stdio: list[int], inherited: list) -> None:
    """In the forked child: take the rank's stdio, environment and folder, run its module, exit."""
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for obj in inherited:  # the listener, the wake-up pipe, the lock, other ranks' connections
        os.close(obj) if isinstance(obj, int) else obj.close()
    for target, fd in enumerate(stdio):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"], **{FORKED_MARK: "1"})
    os.chdir(request["cwd"])
    sys.path[0] = request["cwd"]  # as `python -m` puts it
    sys.argv = [request["module"], *request["argv"]]
    # The module was preloaded, so runpy warns that it runs a second copy as __main__: that is the point.
    warnings.filterwarnings("ignore", "'.*' found in sys.modules after import of package", RuntimeWarning)
    code = 0
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, then exit 1
        traceback.print_exc()
        code = 1
    exit_now(code)


def exit_now(code: int) -> None:
    """Flush and leave without tearing the interpreter down. In a forked rank the teardown can hang
    (freeing a gloo process group joins its worker thread); a plain process just saves the time."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


class Server:
    """One listener, one connection per live rank; single-threaded so that it can fork at any time."""

    def __init__(self, path: Path, lock):
        self.path = path
        self.lock = lock  # held for the server's life; a rank must not inherit it
        self.ranks: dict[int, socket.socket] = {}  # pid -> its client's connection

    def serve(self) -> None:
        listener = socket.socket(socket.AF_UNIX)
        self.path.unlink(missing_ok=True)  # a server that died without cleaning up
        listener.bind(str(self.path))
        listener.listen(64)
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a rank exited: the wake-up pipe says so
        print(f"[rank-server] {os.getpid()} serving {self.path}", flush=True)
        idle_since = time.time()
        while True:
            timeout = None if self.ranks else max(0.0, IDLE_S - (time.time() - idle_since))
            ready, _, _ = select.select([listener, wake_r, *self.ranks.values()], [], [], timeout)
            if not ready and not self.ranks:
                break
            for obj in ready:
                if obj is listener:
                    self._accept(listener, [listener, wake_r, wake_w, self.lock])
                elif obj is wake_r:
                    os.read(wake_r, 4096)
                else:
                    self._client_gone(obj)
            self._reap()
            if self.ranks or ready:
                idle_since = time.time()
        self.path.unlink(missing_ok=True)  # from here a launcher starts a new server
        print(f"[rank-server] {os.getpid()} idle for {IDLE_S:.0f} s: exiting", flush=True)
        exit_now(0)  # at once, releasing the lock for that new server

    def _accept(self, listener: socket.socket, own: list) -> None:
        conn, _ = listener.accept()
        request, stdio = _read_request(conn)
        if request is None or len(stdio) != 3:
            for fd in stdio:
                os.close(fd)
            conn.sendall(b"ok\n" if request is None else b"error: expected three stdio descriptors\n")
            conn.close()
            return
        pid = os.fork()
        if pid == 0:
            try:
                _become_rank(request, stdio, [*own, *self.ranks.values(), conn])
            finally:  # never back into the server's loop
                os._exit(1)
        for fd in stdio:
            os.close(fd)
        self.ranks[pid] = conn
        try:
            conn.sendall(f"{pid}\n".encode())
        except OSError:  # the client is gone already: so is its rank
            os.kill(pid, signal.SIGKILL)
        (registry() / f"{pid}.json").write_text(json.dumps({"argv": [request["module"], *request["argv"]],
                                                              "server": str(self.path)}))

    def _client_gone(self, conn: socket.socket) -> None:
        """The client never writes after its request: readable means it died, and its rank goes too."""
        try:
            if conn.recv(1):
                return
        except OSError:
            pass
        pid = next(p for p, c in self.ranks.items() if c is conn)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _reap(self) -> None:
        while self.ranks:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.ranks.pop(pid, None)
            (registry() / f"{pid}.json").unlink(missing_ok=True)
            if conn is not None:
                try:
                    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass
                conn.close()


def take_lock(path: Path):
    """The server's lock file, locked; None when another server serves (or is starting to serve) `path`.
    Waits while an idle server that holds it is exiting."""
    lock = open(path.with_suffix(".lock"), "w")
    deadline = time.time() + START_TIMEOUT_S
    while time.time() < deadline:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return lock
        except BlockingIOError:
            if ping(path):
                break
            time.sleep(0.1)
    lock.close()
    return None


def main(argv: list[str]) -> None:
    path = Path(argv[0])
    lock = take_lock(path)
    if lock is None:
        return
    started = time.time()
    modules = preload_modules()
    for module in modules:
        importlib.import_module(module)
    print(f"[rank-server] {os.getpid()} imported {len(modules)} modules in {time.time() - started:.1f} s, for "
          f"{' '.join(f'{k}={v}' for k, v in import_settings(dict(os.environ)))}", flush=True)
    Server(path, lock).serve()


if __name__ == "__main__":
    main(sys.argv[1:])
