"""One rank, as torchrun starts it when a rank server runs the ranks (`shardlab.runner.rank_server`):
`python -S -I rank_client.py SOCKET MODULE ARG...`.

Standard library only, run without site-packages, so it starts in tens of milliseconds. It hands the
server MODULE, its arguments, this process's environment, working folder and stdio, then stands for
the forked rank: SIGTERM/SIGINT go to the rank, and it exits as the rank exited (the same code, or
killed by the same signal). If the server is gone before it forks the rank, the rank runs here with
`python -m MODULE` instead, as it would without a server.
"""

import json
import os
import signal
import socket
import sys


def run_plain(module: str, args: list) -> None:
    os.execv(sys.executable, [sys.executable, "-m", module, *args])


def main(path: str, module: str, args: list) -> None:
    request = json.dumps({"module": module, "argv": args, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    conn = socket.socket(socket.AF_UNIX)
    try:
        conn.connect(path)
        socket.send_fds(conn, [len(request).to_bytes(8, "big") + request], [0, 1, 2])
    except OSError:
        run_plain(module, args)
    replies = conn.makefile("rb")
    line = replies.readline()
    if not line.strip().isdigit():  # the server went away before forking: nothing runs yet
        run_plain(module, args)
    pid = int(line)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: os.kill(pid, signum))
    line = replies.readline()
    code = int(line) if line.strip() else 1  # no status: the server died (and with it the rank's supervision)
    if code < 0:  # killed by a signal: so is this process, as torchrun must see it
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # the only two that have no handler to reset
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
