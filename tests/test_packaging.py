"""The package as users install it: a wheel built from the repository holds every data file the code reads,
so the planner answers from an installed copy with no source tree around (here: the wheel unpacked into a
folder put first on the path, run from a directory outside the repository)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from helpers import REPO


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out, source = tmp_path_factory.mktemp("wheel"), tmp_path_factory.mktemp("source")
    # A clean copy of what the wheel is built from: no build/ folder of an earlier build can leak files in.
    shutil.copytree(REPO / "src", source / "src", ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out),
                            str(source)], capture_output=True, text=True)
    if build.returncode:
        pytest.skip(f"cannot build a wheel here: {build.stderr.strip().splitlines()[-1:]}")
    return next(out.glob("shardlab-*.whl"))


def test_the_wheel_holds_the_data_files_the_code_reads(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for data in ("costs/hardware.yaml", "costs/models.yaml", "costs/published.yaml", "costs/stacks.yaml"):
        assert f"shardlab/{data}" in names, data


def test_the_planner_answers_from_an_installed_wheel(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = dict(os.environ, PYTHONPATH=str(site))
    where = subprocess.run([sys.executable, "-c", "import shardlab; print(shardlab.__file__)"], cwd=tmp_path,
                           env=env, capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(site)), where  # the installed copy, not the checkout
    result = subprocess.run([sys.executable, "-m", "shardlab", "plan", "evaluate", "--model", "llama3-405b",
                             "--hardware", "H100-80GB SXM", "--nodes", "2048", "--global-batch", "2048",
                             "--seq-len", "8192", "--plan", "dp=128,tp=8,pp=16,sp=true,zero=1,framework=mcore"],
                            cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "tokens/s" in result.stdout
