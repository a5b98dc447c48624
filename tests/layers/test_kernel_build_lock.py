"""A CPU kernel build that was killed leaves torch's "lock" file behind; the next load must not wait on it forever."""

import subprocess
import sys

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
