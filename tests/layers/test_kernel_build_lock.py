"""A CPU kernel build that was killed leaves torch's "lock" file behind; the next load must not wait on it forever."""

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from serval.layers import cpu_kernels

LOAD = "from serval.layers import cpu_kernels; k = cpu_kernels.load(); assert k is not None; print(k.__name__)"


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no compiler for the CPU kernels here")
def test_a_lock_left_by_a_killed_build_is_removed_and_the_kernels_load():
    name = cpu_kernels.load().__name__
    stale = cpu_kernels.build_directory(name) / "lock"
    stale.write_text("")  # what torch's FileBaton leaves when its builder is SIGKILLed
    try:
        done = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True, timeout=300)
    finally:
        left = stale.exists()
        stale.unlink(missing_ok=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == name
    assert "left by a CPU kernel build that was killed" in done.stderr
    assert not left


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no compiler for the CPU kernels here")
def test_two_processes_loading_at_once_both_get_the_kernels(tmp_path):
    # Two ranks of a tensor-parallel launch start together; the second waits on the first's flock, not on a stale lock.
    procs = [subprocess.Popen([sys.executable, "-c", LOAD], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    assert {out.strip() for out, _ in outs} == {cpu_kernels.load().__name__}


LOAD_LOGGED = "import logging; logging.basicConfig(level=logging.INFO); " + LOAD


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no compiler for the CPU kernels here")
def test_a_cached_build_says_loading_not_building():
    done = subprocess.run([sys.executable, "-c", LOAD_LOGGED], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "loading the CPU kernels (cached" in done.stderr
    assert "building the CPU kernels" not in done.stderr


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no compiler for the CPU kernels here")
def test_a_start_that_waits_for_another_build_names_its_pid(tmp_path):
    # This test plays the other builder: it holds serval.lock with a pid in it, as a building process does.
    lock_path = cpu_kernels.build_directory(cpu_kernels.load().__name__) / "serval.lock"
    holder_pid = os.getpid()
    log = tmp_path / "stderr"
    with open(lock_path, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        lock.truncate(0)
        lock.write(str(holder_pid))
        lock.flush()
        with open(log, "w") as err:
            proc = subprocess.Popen([sys.executable, "-c", LOAD_LOGGED], stdout=subprocess.PIPE, stderr=err, text=True)
        deadline = time.monotonic() + 120
        while "waiting for another build" not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()  # it must wait while the lock is held
            time.sleep(0.2)
        fcntl.flock(lock, fcntl.LOCK_UN)
    out, _ = proc.communicate(timeout=300)
    stderr = log.read_text()
    assert proc.returncode == 0, stderr
    assert out.strip() == cpu_kernels.load().__name__
    assert f"waiting for another build of the CPU kernels (pid {holder_pid})" in stderr
    assert "loading the CPU kernels (cached" in stderr  # the other build was done: nothing to build after the wait


def test_the_build_folder_is_the_one_torchs_builder_names(monkeypatch):
    """build_directory finds a build where torch.utils.cpp_extension puts it, without importing that module (which
    imports setuptools at every start), with and without TORCH_EXTENSIONS_DIR."""
    from torch.utils.cpp_extension import get_default_build_root

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    tag = f"py{sys.version_info.major}{sys.version_info.minor}"
    assert cpu_kernels.build_directory("k") == Path(get_default_build_root()) / tag / "k"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/somewhere")
    assert cpu_kernels.build_directory("k") == Path("/somewhere") / tag / "k"


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no compiler for the CPU kernels here")
def test_finding_the_kernels_imports_no_builder():
    """A start that finds its built kernels imports neither torch's extension builder nor setuptools."""
    code = LOAD + "; import sys; print(sorted({'torch.utils.cpp_extension', 'setuptools'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[1] == "[]"
