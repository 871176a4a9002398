"""The rank server (`shardlab.runner.rank_server`): a rank forked from the preloaded server measures what
a rank torchrun starts measures, exits as it exited, gets its own environment, folder and stdio, and
dies with its client; a server serves only launches whose import-time settings and code it shares."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from shardlab.runner import rank_server

# A module the server's children run from the test's folder: `python -m probe MODE`.
PROBE = textwrap.dedent("""
    import os, signal, sys, time
    mode = sys.argv[1]
    print(f"cwd={os.getcwd()} value={os.environ.get('PROBE_VALUE')} argv={sys.argv[1:]}", flush=True)
    if mode == "exit3":
        sys.exit(3)
    if mode == "raise":
        raise ValueError("from the rank")
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "sigterm":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
    if mode in ("sleep", "sigterm"):
        open("pid", "w").write(str(os.getpid()))
        time.sleep(60)
""")


@pytest.fixture(scope="module")
def server():
    return rank_server.server_for(dict(os.environ, PYTHONUNBUFFERED="1"))


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    return tmp_path


def client(server, folder, *args, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-S", "-I", str(rank_server.CLIENT), str(server), "probe", *args],
                            cwd=folder, env=dict(os.environ, PROBE_VALUE="mine"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


def _wait_for_pid(folder) -> int:
    deadline = time.monotonic() + 30
    while not (folder / "pid").exists() or not (folder / "pid").read_text():
        assert time.monotonic() < deadline, "the rank never started"
        time.sleep(0.05)
    return int((folder / "pid").read_text())


def _gone(pid: int, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("mode, code, stderr", [("ok", 0, ""), ("exit3", 3, ""), ("raise", 1, "ValueError: from the rank"),
                                                ("kill", -signal.SIGKILL, "")])
def test_the_client_exits_as_its_rank_exited_with_the_rank_s_environment_folder_and_output(
        server, folder, mode, code, stderr):
    proc = client(server, folder, mode, "--flag")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert out.splitlines()[0] == f"cwd={folder} value=mine argv=['{mode}', '--flag']"
    assert stderr in err


def test_a_rank_dies_with_its_client(server, folder):
    """torchrun SIGKILLs a rank that ignores SIGTERM: the forked process must not outlive it."""
    proc = client(server, folder, "sleep", str(folder))
    pid = _wait_for_pid(folder)
    assert pid != proc.pid  # the rank is the server's child, not the client...
    assert rank_server.forked_ranks(str(folder)) == {pid: ["probe", "sleep", str(folder)]}  # ...found by its argv
    proc.kill()
    proc.wait(timeout=10)
    assert _gone(pid), "the forked rank outlived its client"


def test_sigterm_to_the_client_reaches_the_rank(server, folder):
    proc = client(server, folder, "sigterm")
    _wait_for_pid(folder)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 7  # the rank's own handler ran and chose the exit code


def test_without_a_server_the_client_runs_the_module_itself(folder):
    proc = client(folder / "no-server.sock", folder, "exit3")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 3 and out.startswith(f"cwd={folder} value=mine")


def test_a_server_serves_only_launches_with_its_import_time_settings():
    base = dict(os.environ, OMP_NUM_THREADS="1")
    key = rank_server.server_key(base)
    per_launch = dict(base, MASTER_PORT="29511", SHARDLAB_LAUNCH_T0="1.5", TORCHELASTIC_ERROR_FILE="/x/error.json")
    assert rank_server.server_key(per_launch) == key  # read after the fork
    for name, value in [("ATEN_CPU_CAPABILITY", "default"), ("OMP_NUM_THREADS", "2"), ("PYTHONPATH", "/elsewhere")]:
        assert rank_server.server_key(dict(base, **{name: value})) != key, name  # read while importing


def test_a_server_that_cannot_start_is_given_up_at_once(tmp_path):
    """Its imports fail (here a broken `torch` first on the path): the launcher hears so when the server
    exits, not at the start timeout, and its ranks then start as torchrun starts them."""
    (tmp_path / "torch.py").write_text("raise ImportError('broken on purpose')\n")
    started = time.monotonic()
    assert rank_server.server_for(dict(os.environ, PYTHONPATH=str(tmp_path)), timeout_s=120) is None
    assert time.monotonic() - started < 60


def test_an_edited_source_file_makes_a_new_server(tmp_path):
    source = rank_server.CLIENT.with_name("faults.py")
    stat = source.stat()
    key = rank_server.server_key(dict(os.environ))
    try:
        os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
        assert rank_server.server_key(dict(os.environ)) != key
    finally:
        os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert rank_server.server_key(dict(os.environ)) == key


@pytest.mark.torchrun
@pytest.mark.parametrize("strategy", ["tp_sp", "zero3"])
def test_forked_ranks_measure_what_torchrun_ranks_measure(strategy, run_once, run_strategy):
    """The same run started both ways: the same losses (bits), model-state and activation bytes per rank
    and per module; only the process RSS differs (a forked rank counts only the library pages it touched)."""
    forked, forked_steps = run_once(strategy)
    plain, plain_steps = run_strategy(strategy, {"launch": {"rank_server": False}})
    assert forked["status"] == plain["status"] == "ok", (forked["reason"], plain["reason"])
    assert (forked["environment"]["rank_server"], plain["environment"]["rank_server"]) == (True, False)
    assert [s["loss"] for s in forked_steps] == [s["loss"] for s in plain_steps]
    for mine, theirs in zip(forked["ranks"], plain["ranks"], strict=True):
        assert (mine["peak_kind"], theirs["peak_kind"]) == ("forked_process_rss", "process_rss")
        assert {k: v for k, v in mine.items() if not k.startswith("peak")} == \
            {k: v for k, v in theirs.items() if not k.startswith("peak")}
