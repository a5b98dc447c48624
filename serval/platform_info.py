"""What the engine runs on, in one line for logs and benchmark reports: CPU model, vector ISA, native bf16; and the
CPU threads it runs with (``plan_threads``): as many as the process may use, waiting without spinning."""

from __future__ import annotations

import math
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

# ATen's CPU capabilities on x86, narrowest first, with the /proc/cpuinfo flags each needs (as ATen checks them).
_CAPABILITY_FLAGS = (("DEFAULT", set()), ("AVX2", {"avx2", "fma"}),
                     ("AVX512", {"avx512f", "avx512vl", "avx512bw", "avx512dq", "fma"}))


def cpu_capability() -> str:
    """``torch.backends.cpu.get_cpu_capability()`` on x86, read without importing torch (the server's process has
    no torch): the widest of DEFAULT, AVX2 and AVX512 the CPU has, lowered by ATEN_CPU_CAPABILITY as ATen lowers
    it. tests/test_config.py checks that both agree."""
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    names = [name for name, needs in _CAPABILITY_FLAGS if needs <= flags]
    asked = os.environ.get("ATEN_CPU_CAPABILITY", "").upper()
    if asked in names:  # ATen takes a capability the CPU has, never a wider one
        return asked
    return names[-1]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe_hardware() -> str:
    """E.g. 'AMD EPYC, capability AVX512, native bf16: yes, 2 threads, torch 2.13.0+cpu'."""
    import torch

    bf16 = "yes" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "no"
    text = (f"{cpu_model()}, capability {torch.backends.cpu.get_cpu_capability()}, native bf16: {bf16}, "
            f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    if torch.cuda.is_available():
        text += f", GPU {torch.cuda.get_device_name()}"
    return text


# -- threads ------------------------------------------------------------------------------------------------------
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")

# How OpenMP threads (libgomp: PyTorch's intra-op threads, and those of Serval's C++ kernels other than the block
# linears and attention, which have threads of their own: KERNEL_WORKER_WAITS) wait for work and at barriers.
# libgomp's default spins 300,000 times before it sleeps, which pays only when every thread has a core to itself: a
# thread spinning for a partner that has no core holds the core the partner needs. Measured on 2 cores (AMD EPYC,
# AVX512), the machine shared with other engineers' builds throughout (load average 7-9), one stream in-process, 64
# tokens, 2 threads, tok/s, range (median) of 4-8 runs; the default / a bounded spin (GOMP_SPINCOUNT=1000 and 10000) /
# passive:
#   with a busy neighbor:  default 2.2-8.9 (3.1);  spin 1000: 34-43 (39),  10000: 6.5-24;  passive 31-106 (78)
#   no neighbor:           default 4.2-25 (7.8);   spin 1000: 27-31 (29),  10000: 7.9-19;  passive 43-98 (61)
#   no neighbor, batch 8:  default 7.0-7.3;        spin 1000: 53-70;                       passive 69-87
# Passive was the fastest there. On the same machine idle but for the server (a later sitting), a short spin pays: a
# sleeping thread's wake-up at each of a decode step's ~100 parallel regions cost a 1B Q4_K_M's one stream 12%.
# benchmarks/bench_neighbor.py (serve, 1B Q4_K_M, 8 requests of 64 tokens, one round each, tok/s alone / with one
# busy neighbor): passive 23.7 / 14.1 (one stream), 58.7 / 34.9 (decode-heavy); GOMP_SPINCOUNT=1000 26.6 / 13.6,
# 60.8 / 34.0; 10000 27.0 / 8.7, 61.5 / 27.3. So a spin of 1000 (a few microseconds): most of the wake-ups saved
# alone, almost nothing lost beside a neighbor (0.51x alone where 10000 fell to 0.32x). libgomp reads these once,
# when it loads with torch, so they are set in the environment before that: by `import serval` in its own process,
# which the engine core's and the ranks' processes inherit and, fresh interpreters, also run first.
WAIT_POLICY = {"GOMP_SPINCOUNT": "1000"}
# The C++ kernels' linears and attention run on threads of their own (layers/csrc/thread_pool.h), which choose
# how to wait by what they measure: the wait policy above is torch's own ops'.
KERNEL_WORKER_WAITS = ("the kernels' own workers spin while none of their threads waits for a core, else sleep "
                       "(thread_pool.h)")
_WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def wait_environment(environ: dict | None = None) -> dict[str, str]:
    """The variables a process needs in its environment (before torch loads) for short-spin waits: none where the
    user chose a wait policy or spin count already."""
    environ = os.environ if environ is None else environ
    return {} if any(name in environ for name in _WAIT_VARIABLES) else dict(WAIT_POLICY)


def affinity_cpus() -> int:
    """CPUs this process may run on (its affinity mask, as `taskset` or a cpuset sets it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _quota_of(directory: Path) -> float | None:
    """The CPUs' worth of time one cgroup directory allows: cgroup v2's cpu.max ("max 100000", "150000 100000") or
    v1's cpu.cfs_quota_us / cpu.cfs_period_us (-1: no limit); None where it sets none."""
    text = _read(directory / "cpu.max")
    if text is not None:
        quota, _, period = text.partition(" ")
        if quota == "max":
            return None
    else:
        quota, period = _read(directory / "cpu.cfs_quota_us"), _read(directory / "cpu.cfs_period_us")
    try:
        quota_us, period_us = int(quota), int(period or 100000)
    except (TypeError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def cgroup_cpu_quota(root: Path | None = None, proc_cgroup: Path | None = None) -> float | None:
    """CPUs' worth of time per period this process's cgroups allow (a CFS quota: `docker --cpus`, a Kubernetes CPU
    limit), the tightest of its cgroup and the cgroups above it, in v2 or v1; None where no limit is set."""
    root, proc_cgroup = root or CGROUP_ROOT, proc_cgroup or PROC_CGROUP
    paths = {}  # hierarchy ("" for v2's, else v1's controllers) -> the process's cgroup path in it
    for line in (_read(proc_cgroup) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            paths[parts[1]] = parts[2]
    mounts = []  # (where the hierarchy is mounted, the process's path in it)
    if "" in paths:
        mounts += [(root, paths[""]), (root / "unified", paths[""])]
    for controllers, path in paths.items():
        if "cpu" in controllers.split(","):
            mounts += [(root / name, path) for name in (controllers, "cpu", "cpu,cpuacct", "cpuacct,cpu")]
    if not paths:  # no /proc/self/cgroup: the root's limit, either version
        mounts = [(root, "/"), (root / "cpu", "/")]
    quotas = []
    for mount, path in mounts:
        # A container's own cgroup is often mounted as the root, with the host's path in /proc/self/cgroup: every
        # directory from the path up to the mount is read, and those that exist count.
        directory = mount / path.strip("/")
        for folder in (directory, *directory.parents):
            if folder.is_relative_to(mount):
                quota = _quota_of(folder)
                if quota is not None:
                    quotas.append(quota)
    return min(quotas) if quotas else None


def _positive_int(text: str | None) -> int | None:
    """OMP_NUM_THREADS's first number (it may be a list, "4,2", one per nesting level), if it is a positive one."""
    try:
        value = int((text or "").split(",")[0])
    except ValueError:
        return None
    return value if value > 0 else None


@dataclass(frozen=True)
class ThreadPlan:
    """The CPU threads the engine runs with, and what they came from."""

    threads: int
    affinity: int  # CPUs the process may run on
    quota: float | None  # CPUs' worth of time the cgroup allows; None: no limit
    omp_num_threads: int | None  # set by the user: taken as it is
    waits: str  # how idle threads wait, and why
    waits_too_late: bool = False  # torch loaded before `import serval` could ask for short-spin waits

    def describe(self) -> str:
        """E.g. 'threads: 2 (affinity 2 CPUs, cgroup quota none, OMP_NUM_THREADS unset); waits: passive (...)'."""
        quota = "none" if self.quota is None else f"{self.quota:g} CPUs"
        omp = "unset" if self.omp_num_threads is None else str(self.omp_num_threads)
        return (f"threads: {self.threads} (affinity {self.affinity} CPUs, cgroup quota {quota}, OMP_NUM_THREADS "
                f"{omp}); waits: {self.waits}; {KERNEL_WORKER_WAITS}")


def plan_threads(environ: dict | None = None, affinity: int | None = None, quota: float | None = None,
                 waits_too_late: bool | None = None) -> ThreadPlan:
    """The engine's CPU threads: OMP_NUM_THREADS when set, else as many as the process may use: the CPUs of its
    affinity, no more than its cgroup's quota rounded up (1.5 CPUs of time: 2 threads), never the machine's core
    count. ``affinity`` and ``quota`` default to this process's; ``waits_too_late`` (default: as it was) says that
    torch, and with it libgomp, was loaded before `import serval` could set the wait policy."""
    environ = os.environ if environ is None else environ
    affinity = affinity_cpus() if affinity is None else affinity
    quota = cgroup_cpu_quota() if quota is None else quota
    omp = _positive_int(environ.get("OMP_NUM_THREADS"))
    usable = min(affinity, math.ceil(quota)) if quota else affinity
    policy, spin = environ.get("OMP_WAIT_POLICY"), environ.get("GOMP_SPINCOUNT")
    too_late = _waits_too_late if waits_too_late is None else waits_too_late
    if too_late:
        wait = ("libgomp's default, spin then sleep (torch was imported before serval: set GOMP_SPINCOUNT=1000 "
                "in the environment for a short spin)")
    elif spin:  # libgomp takes a spin count over the policy
        wait = f"spin {spin} times, then sleep (GOMP_SPINCOUNT={spin})"
    elif policy:
        wait = f"{policy.lower()} (OMP_WAIT_POLICY={policy})"
    else:
        wait = "libgomp's default, spin 300000 times, then sleep"
    return ThreadPlan(omp or max(1, usable), affinity, quota, omp, wait, too_late)


_waits_too_late = False  # set_wait_policy() found torch loaded and the policy unset
# What set_wait_policy() added to os.environ: a harness that starts other programs (a peer server, to compare with
# its own defaults) leaves these out of their environment.
WAITS_SET_BY_SERVAL: dict[str, str] = {}


def set_wait_policy() -> None:
    """Puts the wait policy in this process's environment (inherited by the processes it starts), unless the user
    chose one. Called by `import serval`: libgomp takes it only if torch is not loaded yet."""
    global _waits_too_late
    needed = wait_environment()
    _waits_too_late = bool(needed) and "torch" in sys.modules
    os.environ.update(needed)
    WAITS_SET_BY_SERVAL.update(needed)
