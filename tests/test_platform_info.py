"""The engine's CPU threads (issue 51, part 5): as many as the process may use (its affinity, its cgroup's CPU quota,
v2 or v1), never the machine's core count; OMP_NUM_THREADS when set; and threads that wait without spinning, set
before libgomp loads in the engine core's process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from serval import platform_info
from serval.engine.workers import threads_per_rank, use_threads
from serval.platform_info import cgroup_cpu_quota, plan_threads, wait_environment

REPO = Path(__file__).resolve().parent.parent


def _cgroup(tmp_path: Path, own: str, files: dict[str, str]) -> tuple[Path, Path]:
    """A fake /sys/fs/cgroup (files by path under it) and /proc/self/cgroup (``own``)."""
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text + "\n")
    root.mkdir(exist_ok=True)
    proc = tmp_path / "proc_self_cgroup"
    proc.write_text(own)
    return root, proc


def test_a_v2_quota_of_one_and_a_half_cpus_gives_two_threads_on_a_larger_affinity(tmp_path):
    root, proc = _cgroup(tmp_path, "0::/\n", {"cpu.max": "150000 100000"})
    quota = cgroup_cpu_quota(root, proc)
    assert quota == 1.5
    assert plan_threads({}, affinity=8, quota=quota).threads == 2


def test_the_tightest_quota_along_the_cgroups_path_counts(tmp_path):
    root, proc = _cgroup(tmp_path, "0::/kubepods/pod1/box\n", {
        "kubepods/cpu.max": "400000 100000", "kubepods/pod1/cpu.max": "100000 50000",
        "kubepods/pod1/box/cpu.max": "max 100000"})
    assert cgroup_cpu_quota(root, proc) == 2.0


def test_no_limit_is_no_quota(tmp_path):
    root, proc = _cgroup(tmp_path, "0::/\n", {"cpu.max": "max 100000"})
    assert cgroup_cpu_quota(root, proc) is None
    assert cgroup_cpu_quota(tmp_path / "nothing", tmp_path / "no_proc_file") is None
    assert plan_threads({}, affinity=3, quota=None).threads == 3


def test_a_v1_quota_is_read_where_the_container_mounts_its_own_cgroup_as_the_root(tmp_path):
    """Docker on cgroup v1: /proc/self/cgroup names the host's path, the mount shows the container's cgroup."""
    root, proc = _cgroup(tmp_path, "5:cpuacct,cpu:/docker/abc\n4:memory:/docker/abc\n0::/\n", {
        "cpu,cpuacct/cpu.cfs_quota_us": "50000", "cpu,cpuacct/cpu.cfs_period_us": "100000"})
    assert cgroup_cpu_quota(root, proc) == 0.5
    assert plan_threads({}, affinity=2, quota=0.5).threads == 1
    root, proc = _cgroup(tmp_path / "unlimited", "2:cpu:/\n", {
        "cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"})
    assert cgroup_cpu_quota(root, proc) is None


def test_the_affinity_bounds_the_threads_below_a_larger_quota():
    assert plan_threads({}, affinity=1, quota=4.0).threads == 1


def test_omp_num_threads_when_set_is_taken_as_it_is():
    assert plan_threads({"OMP_NUM_THREADS": "6"}, affinity=2, quota=1.0).threads == 6
    assert plan_threads({"OMP_NUM_THREADS": "3,1"}, affinity=8, quota=None).threads == 3
    assert plan_threads({"OMP_NUM_THREADS": "many"}, affinity=2, quota=None).threads == 2  # not a number: ignored


def test_this_process_s_readers_are_used_by_default(tmp_path, monkeypatch):
    root, proc = _cgroup(tmp_path, "0::/\n", {"cpu.max": "300000 100000"})
    monkeypatch.setattr(platform_info, "CGROUP_ROOT", root)
    monkeypatch.setattr(platform_info, "PROC_CGROUP", proc)
    monkeypatch.setattr(platform_info.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    monkeypatch.setattr(platform_info.os, "cpu_count", lambda: 64)
    plan = plan_threads({})
    assert (plan.threads, plan.affinity, plan.quota) == (3, 8, 3.0)


def test_the_start_up_line_says_the_threads_and_why():
    line = plan_threads({"OMP_WAIT_POLICY": "passive"}, affinity=4, quota=1.5, waits_too_late=False).describe()
    assert line == ("threads: 2 (affinity 4 CPUs, cgroup quota 1.5 CPUs, OMP_NUM_THREADS unset); waits: passive "
                    "(OMP_WAIT_POLICY=passive); the kernels' own workers spin while none of their threads waits for a "
                    "core, else sleep (thread_pool.h)")
    spin = plan_threads({"OMP_WAIT_POLICY": "passive", "GOMP_SPINCOUNT": "1000"}, affinity=2, quota=None,
                        waits_too_late=False)
    assert "waits: spin 1000 times, then sleep (GOMP_SPINCOUNT=1000);" in spin.describe()
    late = plan_threads({"OMP_WAIT_POLICY": "passive"}, affinity=2, quota=None, waits_too_late=True)
    assert late.waits_too_late and "torch was imported before serval" in late.describe()


def test_model_parallel_ranks_share_the_usable_cpus():
    assert threads_per_rank(2, plan_threads({}, affinity=8, quota=3.0)) == 1
    assert threads_per_rank(2, plan_threads({}, affinity=8, quota=None)) == 4
    assert threads_per_rank(2, plan_threads({"OMP_NUM_THREADS": "3"}, affinity=8, quota=None)) == 3


def test_the_worker_runs_with_the_threads_chosen(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setattr("serval.engine.workers.plan_threads", lambda: plan_threads({}, affinity=1, quota=None))
    try:
        assert use_threads(1).threads == 1
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_a_wait_policy_the_user_chose_is_kept():
    assert wait_environment({}) == {"GOMP_SPINCOUNT": "1000"}
    assert wait_environment({"OMP_WAIT_POLICY": "active"}) == {}
    assert wait_environment({"GOMP_SPINCOUNT": "1000"}) == {}


@pytest.mark.parametrize(("given", "spin_count"), [(None, "1000"), ("active", "30000000000"), ("passive", "0")])
def test_the_engine_core_process_s_threads_spin_briefly_unless_told(given, spin_count):
    """The core's process (`python -m serval.engine.core_process`) imports its module first; libgomp, loaded with
    torch, reports the spin count it took (OMP_DISPLAY_ENV=verbose; its default, unset, is 300000 spins)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")}
    env.update({"OMP_DISPLAY_ENV": "verbose", "PYTHONPATH": str(REPO)}, **({"OMP_WAIT_POLICY": given} if given else {}))
    done = subprocess.run([sys.executable, "-c", "import serval.engine.core_process, torch; torch.ones(64).sum()"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    counts = re.findall(r"GOMP_SPINCOUNT = '(\d+)'", done.stderr)
    assert counts and set(counts) == {spin_count}  # every libgomp loaded (torch's, and any a library bundles)
