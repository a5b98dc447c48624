"""C++ kernels for the CPU (``csrc/``), built on first use with torch's extension builder and cached per CPU kind.

Built with ``-march=native``: the compiler picks AVX2 or AVX-512 for the machine it runs on. If the build fails
(no compiler), ``load()`` says why once and returns None, and callers use their PyTorch path. Callers ask
``for_device``, the one place that decides whether a tensor's op takes a kernel (tests/layers/test_attention_backends.py
checks that no other module asks ``load`` itself).
``SERVAL_CPU_ISA=avx2`` builds the AVX2 paths instead (``-march=x86-64-v3``: AVX2, FMA, F16C) on a machine that
has AVX-512, so that the paths of AVX2-only CPUs are tested and measured everywhere.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)
SOURCES = [Path(__file__).parent / "csrc" / name for name in
           ("bindings.cpp", "paged_attention.cpp", "panel_linear.cpp", "fused_ops.cpp", "bf16_rows.cpp",
            "int8_linear.cpp", "bf16_dot_linear.cpp", "moe_experts.cpp", "decoder_layers.cpp",
            "block_repack.cpp")]
HEADERS = [Path(__file__).parent / "csrc" / name
           for name in ("vec_math.h", "scratch.h", "block_formats.h", "kernels.h", "thread_pool.h")]
# -fopenmp: without it ATen's parallel_for (a header template) compiles to a serial loop.
CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp"]
ISA_CFLAGS = {"native": CFLAGS, "avx2": ["-O3", "-march=x86-64-v3", "-mtune=native", "-fopenmp"]}
_state: dict[str, ModuleType | None] = {}
PROGRESS_INTERVAL = 30.0  # seconds between a build's "still building" lines


def load() -> ModuleType | None:
    """The compiled kernels, or None where they cannot be built (or SERVAL_CPU_KERNELS=0)."""
    if "module" in _state:
        return _state["module"]
    module = None
    if os.environ.get("SERVAL_CPU_KERNELS", "1") != "0":
        try:
            module = _build()
        except Exception as exc:  # noqa: BLE001 - any build failure means: use the PyTorch path
            logger.warning("CPU kernels not built (%s); using the PyTorch attention path", exc)
    _state["module"] = module
    return module


def for_device(device: torch.device) -> ModuleType | None:
    """The kernels for tensors on ``device``: the loaded module on the CPU; None on other devices, where the kernels
    cannot be built, or with SERVAL_CPU_KERNELS=0 (the caller then takes its PyTorch path)."""
    return load() if device.type == "cpu" else None


def _build() -> ModuleType:
    try:  # the ninja wheel's binary, for a venv that is not activated
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    # Named by CPU kind and a hash of sources and flags: checkouts of other versions never rebuild over it.
    isa = os.environ.get("SERVAL_CPU_ISA", "native")
    if isa not in ISA_CFLAGS:
        raise ValueError(f"SERVAL_CPU_ISA={isa!r}: expected one of {sorted(ISA_CFLAGS)}")
    cflags = ISA_CFLAGS[isa]
    # torch's version too: a cached build is loaded without asking torch's builder (below), so an upgrade of torch
    # (its C++ ABI) must name another build.
    text = b"".join(s.read_bytes() for s in SOURCES + HEADERS) + " ".join(cflags + [torch.__version__]).encode()
    digest = hashlib.sha256(text).hexdigest()[:10]
    kind = torch.backends.cpu.get_cpu_capability().lower() if isa == "native" else isa
    name = f"serval_cpu_kernels_{kind}_{digest}"
    build_dir = build_directory(name)
    build_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive(build_dir / "serval.lock"):
        # torch's own "lock" file outlives a builder that was killed, and then every later load waits on it forever.
        # Every Serval builder holds serval.lock (which the kernel releases when its holder dies), so a "lock" file
        # seen here was left by a dead one.
        stale = build_dir / "lock"
        if stale.exists():
            logger.warning("removing %s, left by a CPU kernel build that was killed", stale)
            stale.unlink(missing_ok=True)
        built = build_dir / f"{name}.so"
        if built.is_file():
            # The name holds the hash of sources, flags and torch's version: the file there is this very build. It
            # is imported directly: torch's builder would compile it all again for a checkout at another path (its
            # build.ninja names the sources by absolute path), which four worktrees sharing a machine did in turn.
            logger.info("loading the CPU kernels (cached: %s)", name)
            try:
                return _import_built(name, built)
            except ImportError as exc:  # e.g. a build killed while linking left half a file
                logger.warning("the cached CPU kernels %s do not load (%s); building them again", built, exc)
        # A real build takes minutes on a busy small machine: said at WARNING, so that no start is silent that long.
        logger.warning("building the CPU kernels (%s; once per machine) ...", name)
        start = time.monotonic()
        with _Progress(start):
            module = _load_extension(name, cflags, build_dir)
        logger.warning("built the CPU kernels in %.0f s", time.monotonic() - start)
        return module


def _import_built(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_extension(name: str, cflags: list[str], build_dir: Path) -> ModuleType:
    from torch.utils.cpp_extension import load as load_extension

    return load_extension(name=name, sources=[str(s) for s in SOURCES], extra_cflags=cflags,
                          extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)


class _Progress:
    """While a build runs: "still building the CPU kernels, N s" every ``PROGRESS_INTERVAL`` seconds."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="serval-kernel-build-progress", daemon=True)

    def _run(self) -> None:
        while not self.done.wait(PROGRESS_INTERVAL):
            logger.warning("still building the CPU kernels, %.0f s", time.monotonic() - self.start)

    def __enter__(self) -> _Progress:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()


def build_directory(name: str) -> Path:
    """Where the kernels named ``name`` are built: under TORCH_EXTENSIONS_DIR if set, else torch's cache folder (the
    folder torch.utils.cpp_extension.get_default_build_root names; that module is imported only to build, as it
    imports setuptools: 0.1-0.2 s of every start)."""
    from torch import _appdirs

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.realpath(_appdirs.user_cache_dir("torch_extensions"))
    return Path(root) / f"py{sys.version_info.major}{sys.version_info.minor}" / name


class _exclusive:
    """An flock on ``path`` for a with-block: one builder at a time, released by the kernel if its holder dies.

    The holder writes its pid into the file, so that a process that must wait can say for whom."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        self.file = open(self.path, "a+")  # noqa: SIM115 - closed in __exit__
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.seek(0)
            holder = self.file.read().strip() or "unknown"
            logger.warning("waiting for another build of the CPU kernels (pid %s) ...", holder)
            start = time.monotonic()
            fcntl.flock(self.file, fcntl.LOCK_EX)
            logger.warning("the other build of the CPU kernels ended after %.0f s of waiting", time.monotonic() - start)
        self.file.truncate(0)
        self.file.write(str(os.getpid()))
        self.file.flush()

    def __exit__(self, *exc):
        self.file.truncate(0)
        fcntl.flock(self.file, fcntl.LOCK_UN)
        self.file.close()
