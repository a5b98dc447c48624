"""Child processes that end with the process that started them, however it ends (a SIGKILL included).

Linux's parent-death signal (prctl PR_SET_PDEATHSIG) makes the kernel signal a child when the thread that started it
ends. Set in the child itself (here, between fork and exec, or first thing in its main), and then the parent is
checked once: it may have gone before the signal was asked for. Elsewhere these are no-ops; the core's own parent
watch (engine/core_process.py) still ends it there.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1

# Resolved in the parent: a child between fork and exec should not dlopen (another thread may have held the loader's
# lock when it forked).
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def set_parent_death_signal(signum: int) -> bool:
    """Asks the kernel to send ``signum`` to this process when its parent ends; False where it cannot."""
    return _prctl is not None and _prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0


def end_with_parent(parent_pid: int, signum: int = signal.SIGKILL) -> None:
    """This process gets ``signum`` when its parent ends; if the parent ``parent_pid`` is already gone, it gets it
    now. Call it first thing in a child (after installing a handler for ``signum``, if it has one)."""
    set_parent_death_signal(signum)
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signum)


def ending_with_parent(signum: int = signal.SIGKILL):
    """A ``subprocess.Popen`` ``preexec_fn``: the child gets ``signum`` when the thread that started it ends (start
    children from a thread that lives as long as they should). For ``serval serve`` children SIGTERM (they stop in
    order, their own children with them); else SIGKILL."""
    parent_pid = os.getpid()

    def in_child() -> None:
        end_with_parent(parent_pid, signum)

    return in_child
