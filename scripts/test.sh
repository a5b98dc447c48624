#!/usr/bin/env bash
# Sets up (scripts/setup.sh), lints, and runs the whole test suite. CI runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check serval tests
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
