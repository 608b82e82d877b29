#!/usr/bin/env bash
# The GPU kit: on a machine with an NVIDIA GPU and the CUDA toolkit (gRPC not needed):
#   1. configures a gRPC-free build (-DNORMGRAD_WITH_GRPC=OFF) and builds the kernels, the
#      backends, the backend tests and normgrad-gpu-bench;
#   2. runs the backend suite against the CUDA backend on the real driver (CPU reference oracle);
#   3. runs normgrad-gpu-bench (copy bandwidth, each kernel's bandwidth and fraction of it, L2
#      flushed before every run; 1x896 to 16384x4096, f32 and bf16);
#   4. runs normgrad-pipeline-bench (the CUDA backend's chunk pipeline against one piece per
#      chunk, a 64 MiB chunk staged and registered, f32 and bf16);
#   5. where `import torch` works, PyTorch's RMSNorm backward on the same shapes (eager,
#      torch.compile, torch.nn.functional.rms_norm where present), as ratios, and the targets.
# Results: <out>/bench.json, <out>/bench.txt, <out>/pipeline.txt, <out>/summary.json,
# <out>/summary.txt.
#
#   bash tests/gpu/device_check.sh [--smoke] [--build-dir DIR] [--out DIR] [--iters N] [--no-build]
#
# --smoke: tiny shapes and a short test filter, for proving the flow on the emulated driver
# (NORMGRAD_CUDA_DRIVER=<libnormgrad_emulated_cuda.so>); PyTorch then runs on the CPU.
# Each step has its own time limit; the whole run is meant to take a few minutes.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BUILD_DIR="${ROOT}/build-gpu"
OUT_DIR=""
SMOKE=0
BUILD=1
ITERS=20

die() { echo "device_check: $*" >&2; exit 1; }
step() { echo; echo "== device_check: $* ($(date -u +%H:%M:%S))"; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --smoke) SMOKE=1 ;;
    --no-build) BUILD=0 ;;
    --build-dir) [[ $# -ge 2 ]] || die "--build-dir needs a directory"; BUILD_DIR="$2"; shift ;;
    --out) [[ $# -ge 2 ]] || die "--out needs a directory"; OUT_DIR="$2"; shift ;;
    --iters) [[ $# -ge 2 && "$2" =~ ^[1-9][0-9]*$ ]] || die "--iters needs a positive integer"
             ITERS="$2"; shift ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
  shift
done
[[ -n "${OUT_DIR}" ]] || OUT_DIR="${BUILD_DIR}/gpu-kit"
mkdir -p "${OUT_DIR}"

step "checking the machine"
for tool in cmake c++ timeout python3; do
  command -v "${tool}" >/dev/null 2>&1 || die "'${tool}' is not installed"
done
GENERATOR=()
if command -v ninja >/dev/null 2>&1; then GENERATOR=(-G Ninja); fi
CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
[[ -f "${CUDA_HOME}/include/cuda.h" ]] || die "no CUDA toolkit: ${CUDA_HOME}/include/cuda.h missing (set CUDA_HOME)"
if [[ -n "${NORMGRAD_CUDA_DRIVER:-}" ]]; then
  echo "driver library: ${NORMGRAD_CUDA_DRIVER} (from NORMGRAD_CUDA_DRIVER)"
else
  command -v nvidia-smi >/dev/null 2>&1 || die "no nvidia-smi: no NVIDIA driver on this machine"
  timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
    || die "nvidia-smi failed: the GPU or its driver is not usable"
fi
JOBS="$(nproc 2>/dev/null || echo 2)"

if [[ "${BUILD}" == 1 ]]; then
  step "configuring a gRPC-free build in ${BUILD_DIR}"
  timeout 300 cmake -S "${ROOT}" -B "${BUILD_DIR}" "${GENERATOR[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DNORMGRAD_WITH_GRPC=OFF -DNORMGRAD_BUILD_BENCHMARKS=OFF -DCUDA_HOME="${CUDA_HOME}" \
    > "${OUT_DIR}/configure.log" 2>&1 \
    || { tail -30 "${OUT_DIR}/configure.log" >&2; die "configure failed (log: ${OUT_DIR}/configure.log)"; }
  step "building backend_test, normgrad-gpu-bench and normgrad-pipeline-bench (${JOBS} jobs)"
  timeout 900 cmake --build "${BUILD_DIR}" --target backend_test normgrad_gpu_bench \
    normgrad_pipeline_bench -j "${JOBS}" \
    > "${OUT_DIR}/build.log" 2>&1 \
    || { tail -30 "${OUT_DIR}/build.log" >&2; die "build failed (log: ${OUT_DIR}/build.log)"; }
fi
BIN="${BUILD_DIR}/bin"
[[ -x "${BIN}/backend_test" && -x "${BIN}/normgrad-gpu-bench" && -x "${BIN}/normgrad-pipeline-bench" ]] \
  || die "${BIN} lacks backend_test, normgrad-gpu-bench or normgrad-pipeline-bench (build first, without --no-build)"

step "CUDA backend against the CPU reference on the driver"
FILTER="*"
if [[ "${SMOKE}" == 1 ]]; then
  # A few shapes: the emulated driver interprets every instruction.
  FILTER="*MatchesReference*/hidden1_*:*MatchesReference*/hidden896_*:Dtypes/*"
fi
if ! NORMGRAD_TEST_BACKEND=cuda timeout 300 "${BIN}/backend_test" --gtest_filter="${FILTER}" \
     --gtest_brief=1 > "${OUT_DIR}/backend_test.log" 2>&1; then
  tail -40 "${OUT_DIR}/backend_test.log" >&2
  die "the CUDA backend failed its tests on this driver (log: ${OUT_DIR}/backend_test.log)"
fi
tail -3 "${OUT_DIR}/backend_test.log"

step "kernel bandwidth against copy bandwidth"
BENCH_ARGS=(--json "${OUT_DIR}/bench.json" --iters "${ITERS}")
[[ "${SMOKE}" == 1 ]] && BENCH_ARGS+=(--smoke)
timeout 600 "${BIN}/normgrad-gpu-bench" "${BENCH_ARGS[@]}" | tee "${OUT_DIR}/bench.txt" \
  || die "normgrad-gpu-bench failed (exit ${PIPESTATUS[0]}; see above)"

step "the CUDA backend's chunk pipeline against one piece per chunk"
PIPE_ARGS=(--iters "${ITERS}")
[[ "${SMOKE}" == 1 ]] && PIPE_ARGS=(--smoke)
timeout 300 "${BIN}/normgrad-pipeline-bench" "${PIPE_ARGS[@]}" | tee "${OUT_DIR}/pipeline.txt" \
  || die "normgrad-pipeline-bench failed (exit ${PIPESTATUS[0]}; see above)"

step "PyTorch's RMSNorm backward on the same shapes"
TORCH_ARGS=(--kernels-json "${OUT_DIR}/bench.json" --out "${OUT_DIR}/summary.json" --iters "${ITERS}")
if [[ "${SMOKE}" == 1 ]]; then TORCH_ARGS+=(--allow-cpu); fi
TORCH_PY=""
for py in python3 /usr/bin/python3; do  # a python3 earlier on PATH may lack the system's torch
  if command -v "${py}" >/dev/null 2>&1 && timeout 60 "${py}" -c "import torch" >/dev/null 2>&1; then
    TORCH_PY="${py}"; break
  fi
done
if [[ -n "${TORCH_PY}" ]]; then
  timeout 600 "${TORCH_PY}" "${ROOT}/tests/gpu/torch_rmsnorm_bench.py" "${TORCH_ARGS[@]}" \
    | tee "${OUT_DIR}/summary.txt" || die "the PyTorch comparison failed (see above)"
else
  echo "python3 cannot import torch: no PyTorch comparison"
  timeout 60 python3 "${ROOT}/tests/gpu/torch_rmsnorm_bench.py" "${TORCH_ARGS[@]}" --no-torch \
    | tee "${OUT_DIR}/summary.txt" || die "summarizing ${OUT_DIR}/bench.json failed"
fi

step "done: ${OUT_DIR}/summary.json"
