"""The one command line: `shardlab --help` lists every command the workflow calls, and every command
answers a bad argument with exit 2 and one line naming it (no usage block, no traceback)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys

import pytest

from helpers import REPO, run_command
from shardlab.__main__ import COMMANDS, main

A100 = "A100-80GB SXM"
PLAN = ["--model", "pythia-1b", "--hardware", A100, "--nodes", "1", "--global-batch", "64", "--seq-len", "2048"]
# The only modules a process starts by name: the programs torchrun runs once per rank (and the agent
# that wraps torchrun). Everything a person or a rule runs is a `shardlab` command.
PER_RANK_PROGRAMS = {"__main__", "runner.worker", "runner.agent", "runner.fork_server", "runner.rank_client",
                     "bench.cost_grid", "bench.instrumentation", "bench.comm", "bench.inference",
                     "bench.parity_sensitivity", "bench.paired_timing"}


def run(capsys, *argv: str) -> tuple[int, str, str]:
    return run_command(capsys, main, *argv)


def assert_one_line_exit_2(code: int, out: str, err: str, names: str) -> None:
    assert code == 2 and not out, (code, out)
    assert err.count("\n") == 1 and "Traceback" not in err and names in err, err


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_names_an_unknown_flag_in_one_line(capsys, command):
    assert_one_line_exit_2(*run(capsys, command, "--no-such-flag"), "--no-such-flag")


@pytest.mark.parametrize("argv, names", [
    (["plan-zero", "--model", "pythia-6.9b", "--hardware", A100, "--gpus", "0"], "--gpus: 0 is not a count"),
    (["plan-zero", "--model", "pythia-6.9b", "--hardware", A100, "--gpus", "2", "--gpu-mem", "80XB"], "--gpu-mem"),
    (["plan-zero", "--model", "pythia-6.9b", "--hardware", A100, "--gpus", "2", "--what-if", "hbm=2"], "hbm"),
    (["check-config", "no/such/config.yaml"], "no such file: no/such/config.yaml"),
    (["plan-export", "--config", "no/such.yaml", "--experiment", "e", "--world-size", "2"], "no such file"),
    (["plan-export", "--config", "config/test.yaml", "--experiment", "e", "--world-size", "3", "--gpus-per-node", "2"],
     "--world-size: 3 devices are not whole nodes"),
    (["share-run"], "required: source, out, experiment"),
    (["launch", "share"], "required"),
    (["tables", "runs", "--out-dir", "x", "--summaries", "no/such/summary.json"], "no such file"),
    (["tables", "runs", "--out-dir", "x", "--workers", "0"], "--workers: 0"),
    (["bench-comm", "--settings", "{", "--bench-out", "a", "--fit-out", "b"], "--settings: not JSON"),
    (["parity-sensitivity", "--dtypes", "fp16"], "fp16: not a dtype"),
    (["nope"], "unknown command 'nope'"),
    (["plan", "search", *PLAN, "--plan", "dp=8"], "--plan: does not apply to plan search"),
    (["plan", "search", *PLAN, "--plans", "README.md"], "--plans: does not apply to plan search"),
    (["plan", "evaluate", *PLAN, "--top", "3"], "--top: does not apply to plan evaluate"),
    (["plan", "evaluate", *PLAN, "--no", "cp", "--fix", "tp=2"], "--fix, --no: do not apply to plan evaluate"),
    (["plan", "evaluate", *PLAN, "--cp", "1,2"], "--cp: does not apply"),
    (["plan", "evaluate", *PLAN, "--nodes", "0"], "--nodes: 0 is not a count"),
])
def test_a_bad_argument_exits_2_with_one_line_naming_it(capsys, monkeypatch, argv, names):
    monkeypatch.chdir(REPO)
    assert_one_line_exit_2(*run(capsys, *argv), names)


def test_a_flag_at_its_default_is_not_refused_in_the_other_mode(capsys):
    """The refusal compares with the default, so it must not fire on what the user did not set."""
    code, out, _ = run(capsys, "plan", "evaluate", *PLAN, "--plan", "dp=8,zero=1,framework=mcore")
    assert code == 0 and "MFU" in out


def test_a_bad_config_exits_2_in_one_line(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((REPO / "config/test.yaml").read_text() + "\nno_such_setting: 1\n")
    code, out, err = run(capsys, "check-config", str(bad))
    assert code == 2 and not out and err.count("\n") == 1 and "no_such_setting" in err, err


def test_the_installed_entry_point_exits_2_in_one_line():
    """The same through a real process (the dispatcher, not only the parsers)."""
    proc = subprocess.run([sys.executable, "-m", "shardlab", "plan-zero", "--model", "pythia-6.9b", "--hardware", A100,
                           "--gpus", "0"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert_one_line_exit_2(proc.returncode, proc.stdout, proc.stderr, "--gpus")


def test_help_lists_every_command_and_the_workflow_calls_only_commands(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0 and set(re.findall(r"^  (\S+)", out, re.M)) == set(COMMANDS)
    rules = "\n".join(p.read_text() for p in (REPO / "workflow").rglob("*.smk")) + (REPO / "Snakefile").read_text()
    called = set(re.findall(r"\"python -m shardlab ([a-z-]+)", rules))
    assert called and called <= set(COMMANDS), called - set(COMMANDS)
    assert not re.findall(r"python -m shardlab\.\w", rules), "a rule runs a module instead of a shardlab command"


def test_only_per_rank_programs_have_a_main_guard():
    """`python -m shardlab.<module>` is not a second command line: only what a launch starts (torchrun's
    agent, the rank server and its clients, and each rank's program) has an entry point of its own."""
    src = REPO / "src" / "shardlab"
    guarded = set()
    for path in src.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
                guarded.add(".".join(path.relative_to(src).with_suffix("").parts))
    assert guarded == PER_RANK_PROGRAMS
