#!/usr/bin/env bash
# Runs benchmarks/bench_gpu.py from this checkout and writes its report (report.md, report.json, server.log) into
# OUT_DIR; the other arguments go to the script (--streams, --tokens, --skip, --engine-arg, ...).
#   benchmarks/bench_gpu.sh OUT_DIR [bench_gpu.py flags]
# The python is $PYTHON if set, else this checkout's .venv, else python3 (a GPU machine's own torch).
set -euo pipefail
if [ $# -lt 1 ]; then
    echo "usage: $0 OUT_DIR [bench_gpu.py flags]" >&2
    exit 2
fi
out=$1
shift
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-}
if [ -z "$python" ]; then
    if [ -x "$repo/.venv/bin/python" ]; then python=$repo/.venv/bin/python; else python=python3; fi
fi
mkdir -p "$out"
cd "$repo"
PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" exec "$python" benchmarks/bench_gpu.py --out "$out" "$@"
