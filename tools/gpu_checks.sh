#!/usr/bin/env bash
# The GPU checks on a lent device machine, from the kit tools/gpu_kit.sh packs here. Run from the
# repository root on the device (docs/benchmarks.md, "Checks on a lent GPU machine"):
#   bash tools/gpu_checks.sh stash DIR       once per part, in the call that carries it (carry: DIR):
#                                             copies the part out of the working tree to $STASH
#   bash tools/gpu_checks.sh run [STEP ...]  unpacks and installs the kit (once), then the steps:
#     env       nvidia-smi, glibc, the onnxruntime build, a CUDA EP session that runs
#     tests     the test files that need CUDA: graph replay against the plain path, CUDA shared
#               memory across processes, device batches, the memory probes
#     devbatch  tools/bench_device_batches.py on vision: ms per batch on the host and in device
#               memory, with and without graphs, each size repeated and the sizes alternating
#     selftest  tools/gpu_selftest.py --require-gpu on the kit's models (probes, parity, memory)
#     bench     edge-batcher bench per model on the CUDA EP: the raw ceiling with and without CUDA
#               graphs, and the daemon's in-process ratio to it
#     pa        perf_analyzer against vision on the CUDA EP: HTTP and gRPC, each with binary
#               tensors, system shared memory and CUDA shared memory, concurrency 4 and 16
#     profile   where the daemon's threads are under perf_analyzer, per variant of VARIANTS
#               (default http+cudashm): a `py-spy dump --native` and a 6 s record per thread
#   (no STEP: all but profile, in that order). Each step's output is kept in $OUT/STEP.log and its
#   last lines printed; a failing step does not stop the next; the exit status is 1 if any failed.
# Nothing is installed system-wide: the kit goes into a venv under $STASH that sees the image's
# packages, with onnxruntime-gpu in place of the image's CPU build.
set -uo pipefail
cd "$(dirname "$0")/.."
stash=${STASH:-/tmp/eb-gpu}
out=${OUT:-$stash/out}
system_python=${PYTHON:-python3}
python=$stash/venv/bin/python

stash_part() {
  mkdir -p "$stash/parts"
  cp "$1"/part-* "$stash/parts/"
  ls -l "$stash/parts"
}

install_kit() {
  [ -f "$stash/installed" ] && return 0
  rm -rf "$stash/kit" "$stash/venv" "$stash/pa" "$stash/engines-cuda"
  cat "$stash"/parts/part-* | xz -d | tar -C "$stash" -xf - || { echo "kit: parts missing or broken"; return 1; }
  # A venv over the image's packages (numpy, onnx, cuda-bindings): what the kit adds comes first,
  # also in the daemons and tools the checks start with this interpreter.
  "$system_python" -m venv --system-site-packages --without-pip "$stash/venv" || return 1
  local site
  site=$("$stash/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  "$system_python" -m pip install --quiet --no-index --no-deps --target "$site" "$stash"/kit/wheels/*.whl || return 1
  cp -r "$stash"/kit/ort/. "$site/" || return 1  # onnxruntime-gpu, over the image's CPU build
  echo "$PWD" > "$site/edge_batcher_checkout.pth"
  # The image's python3 may itself be a venv (/opt/torch/.venv): its packages are not the system
  # site a venv sees; a .pth adds them after the kit's.
  "$system_python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' > "$site/image_site.pth"
  "$system_python" -m zipfile -e "$stash"/kit/perf_analyzer/*.whl "$stash/pa" &&
    chmod +x "$stash/pa/perf_analyzer/bin/perf_analyzer"
  "$stash/venv/bin/python" -c "
import sys; sys.path.insert(0, 'tools')
from pathlib import Path
from gpu_selftest import on_cuda_repository
on_cuda_repository(Path('$stash/kit/engines'), Path('$stash/engines-cuda'))" || return 1
  touch "$stash/installed"
}

step_env() {
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
  ldd --version | head -1
  nproc
  "$python" - <<'PY'
import numpy as np, onnxruntime as ort, onnx
from onnx import TensorProto, helper
print("onnxruntime", ort.__version__, ort.__file__, ort.get_available_providers())
graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
session = ort.InferenceSession(model.SerializeToString(), providers=["CUDAExecutionProvider"])
print("CUDA EP session:", session.get_providers(), session.run(None, {"x": np.array([-1, 2], np.float32)}))
assert session.get_providers()[0] == "CUDAExecutionProvider", "the CUDA EP did not load"
PY
}

step_tests() {
  "$python" -m pytest -q -p no:cacheprovider -rs tests/test_ort_graphs.py tests/test_cuda_shared_memory_gpu.py \
    tests/test_cuda_shared_memory.py tests/test_cuda_shared_memory_regions.py tests/scheduler/test_device_batch.py \
    tests/scheduler/test_host_staging.py \
    tests/trt/test_cuda_api.py tests/memory/test_memory_device.py tests/memory/test_memory_probe.py \
    tests/memory/test_memory_cuda.py
}

step_devbatch() {
  "$python" tools/bench_device_batches.py --models "$stash/engines-cuda" --model vision --runs 30
}

step_selftest() {
  "$python" tools/gpu_selftest.py --models "$stash/engines-cuda" --require-gpu
}

step_bench() {
  local status=0
  for model in vibration encoder vision minilm; do
    "$python" -m edge_batcher.cli bench --models "$stash/engines-cuda" --model "$model" --duration 1 --repeat 3 \
      --rate 50% || status=1
  done
  return $status
}

step_pa() {
  "$python" tools/bench_perf_analyzer.py --perf-analyzer "$stash/pa/perf_analyzer/bin/perf_analyzer" \
    --repo "$stash/engines-cuda" --model vision --concurrency 4 16 --rounds 2 --interval-ms 1000 \
    --variants http http+shm http+cudashm grpc grpc+shm grpc+cudashm
}

step_profile() {
  local spy status=0 variant
  spy=$(dirname "$python")/py-spy
  [ -x "$spy" ] || spy=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/bin/py-spy
  for variant in ${VARIANTS:-http+cudashm}; do
    profile_variant "$spy" "$variant" || status=1
  done
  return $status
}

# One variant under perf_analyzer (concurrency 16): a `py-spy dump --native` of the daemon and a
# 6 s record of its Python stacks per thread, in $OUT/profile-VARIANT-* ('+' spelt '-').
profile_variant() {
  local spy=$1 variant=$2 tag daemon bench
  tag=profile-${variant//+/-}
  "$python" tools/bench_perf_analyzer.py --perf-analyzer "$stash/pa/perf_analyzer/bin/perf_analyzer" \
    --repo "$stash/engines-cuda" --model vision --concurrency 16 --rounds 4 --interval-ms 1000 \
    --variants "$variant" > "$out/$tag-pa.log" 2>&1 &
  bench=$!
  daemon=
  for _ in $(seq 1 60); do daemon=$(pgrep -f "edge_batcher.cli serve" | head -1); [ -n "$daemon" ] && break; sleep 0.5; done
  [ -n "$daemon" ] || { echo "no daemon started"; wait $bench; return 1; }
  sleep 7  # past the daemon's warm-up, into perf_analyzer's windows
  "$spy" dump --native --pid "$daemon" > "$out/$tag-dump.txt" 2>&1
  "$spy" record --threads --rate 200 -d 6 --format raw -o "$out/$tag-record.txt" --pid "$daemon"
  wait $bench
  echo "== $variant"
  tail -3 "$out/$tag-pa.log"
  "$python" tools/profile_threads.py "$out/$tag-record.txt" | head -60
}

case "${1:-}" in
  stash)
    [ $# -eq 2 ] || { echo "usage: $0 stash DIR" >&2; exit 2; }
    stash_part "$2" ;;
  run)
    shift
    steps=("$@")
    [ ${#steps[@]} -eq 0 ] && steps=(env tests devbatch selftest bench pa)
    mkdir -p "$out"
    install_kit 2>&1 | tee "$out/install.log" | tail -5
    [ -f "$stash/installed" ] || { echo "install failed: $out/install.log"; exit 1; }
    failed=()
    for step in "${steps[@]}"; do
      declare -F "step_$step" >/dev/null || { echo "unknown step $step" >&2; exit 2; }
      echo "== $step"
      start=$SECONDS
      "step_$step" > "$out/$step.log" 2>&1
      status=$?
      tail -25 "$out/$step.log"
      echo "== $step: exit $status in $((SECONDS - start)) s"
      [ $status -eq 0 ] || failed+=("$step")
    done
    [ ${#failed[@]} -eq 0 ] || { echo "failed: ${failed[*]} (logs in $out)"; exit 1; } ;;
  *)
    sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'
    exit 2 ;;
esac
