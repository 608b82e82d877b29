#!/usr/bin/env bash
# One entry point for people, CI and the container build, so they cannot drift.
#
#   scripts/dev.sh deps     install the Debian/Ubuntu packages the build needs (apt-get; sudo if not root)
#   scripts/dev.sh build    deps + configure + build into build/ (binaries in build/bin/)
#   scripts/dev.sh test     what CI runs (.ci/run), in stages (docs/testing.md):
#                           main  build + every ctest label in build/
#                           asan  the suite under AddressSanitizer+UndefinedBehaviorSanitizer (build-asan/)
#                           tsan  ThreadSanitizer (build-tsan/): our concurrent parts, any report fails; then
#                                 the tests that cross gRPC, where a race between two accesses of our
#                                 code fails (gRPC itself is uninstrumented; docs/testing.md)
#                           fuzz  libFuzzer targets (clang, build-fuzz/): seed corpora, then a fixed input count each
#                           container  the Dockerfile built with podman and the image checked from outside
#                                 (scripts/container_check.sh, build-container/; its podman and base
#                                 images are prepared in the background from the start)
#                           at the end, whatever the outcome: each stage's time and test count and
#                           the 15 slowest tests (scripts/ci_summary.py, from build-ci/)
#   scripts/dev.sh run [server flags...]   build the server and CLI only (build-run/) + run the
#                           server (CPU backend when no GPU)
#
# Environment: BUILD_DIR (default build), BUILD_TYPE (default Release; RelWithDebInfo for a
# debugger), NORMGRAD_WERROR (default ON: our targets compile with -Werror),
# NORMGRAD_SKIP_DEPS=1 skips the package step (for images that already have them).
# test only: NORMGRAD_CI_STAGES (default "main asan tsan fuzz container"), ASAN_BUILD_DIR, TSAN_BUILD_DIR,
# FUZZ_BUILD_DIR, FUZZ_SECONDS (default 0: a fixed seed and input count per target; e.g.
# FUZZ_SECONDS=3600 NORMGRAD_CI_STAGES=fuzz for a long fuzzing run by time).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
BUILD_DIR=${BUILD_DIR:-build}
# Release (-O3): what the server runs, and the tree where CI sees -O3's warnings.
BUILD_TYPE=${BUILD_TYPE:-Release}

# Packages: build toolchain, gRPC/protobuf/abseil, SIMD, HTTP and Prometheus metrics, tests, and
# the tools tests call.
PACKAGES=(
  build-essential cmake ninja-build pkg-config git ca-certificates
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libabsl-dev
  libhwy-dev libcpp-httplib-dev prometheus-cpp-dev libssl-dev libdnnl-dev
  libcli11-dev nlohmann-json3-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  python3 python3-numpy python3-yaml openssl
  python3-dev pybind11-dev python3-torch
  python3-pip python3-setuptools python3-wheel python3-venv
  clang-14 libclang-rt-14-dev
)

# What only the tests, benchmarks and Python package need (the Dockerfile's build stage and
# `dev.sh run` leave them out).
TEST_ONLY_PACKAGES="python3-torch python3-dev pybind11-dev python3-numpy python3-yaml python3-pip python3-setuptools python3-wheel python3-venv clang-14 libclang-rt-14-dev libgtest-dev libgmock-dev libbenchmark-dev libdnnl-dev"

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

# NORMGRAD_DEPS_EXCLUDE: packages of PACKAGES that deps leaves out (the Dockerfile's build
# stage, which builds no tests, benchmarks or Python package, leaves out their tools).
deps() {
  [ "${NORMGRAD_SKIP_DEPS:-0}" = 1 ] && return 0
  local missing=()
  for p in "${PACKAGES[@]}"; do
    case " ${NORMGRAD_DEPS_EXCLUDE:-} " in *" $p "*) continue ;; esac
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "[dev.sh] installing: ${missing[*]}"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
  fi
}

# Our own targets compile with -Werror here and in CI (NORMGRAD_WERROR=OFF turns it off; a
# plain cmake configure has it off, so a user's other compiler is not stopped by a new warning).
configure() {
  cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE="$BUILD_TYPE" \
    -DNORMGRAD_WERROR="${NORMGRAD_WERROR:-ON}" "$@"
}

build() {
  deps
  configure "$@"
  cmake --build "$BUILD_DIR" -j"$(nproc)"
}

# What the stages record for the summary at the end (scripts/ci_summary.py): stage times, each
# ctest run's JUnit report, the fuzzing runs' times, the container checks.
CI_SUMMARY_DIR=$(realpath -m "${CI_SUMMARY_DIR:-build-ci}")
CURRENT_STAGE=
CTEST_RUNS=0

# ctest with the summary lines on the log (the whole output stays on it too); each run's JUnit
# report goes to the summary folder under the current stage's name.
run_ctest() {
  local dir=$1
  shift
  local junit=()
  if [ -n "$CURRENT_STAGE" ]; then
    CTEST_RUNS=$((CTEST_RUNS + 1))
    junit=(--output-junit "$CI_SUMMARY_DIR/ctest-$CURRENT_STAGE-$CTEST_RUNS.xml")
  fi
  (cd "$dir" && ctest --output-on-failure -j"$(nproc)" --timeout 900 "${junit[@]}" "$@")
}

# Sanitizer reports fail the run: -fno-sanitize-recover=all (CMakeLists.txt) plus these.
export ASAN_OPTIONS=${ASAN_OPTIONS:-halt_on_error=1:detect_leaks=1:abort_on_error=0:strict_string_checks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
# Leaks in libraries that are not ours and are not leaks (each entry says why): tests/lsan.supp.
export LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$ROOT/tests/lsan.supp:print_suppressions=0}

stage_main() {
  build
  run_ctest "$BUILD_DIR"
}

# The whole suite under ASan+UBSan, -O1 for speed; benchmarks are not built. -g1: line tables
# and inlined frames, what the reports print, at about two thirds of -g's compile time (the
# tree's compile time is most of the stage).
stage_asan() {
  local dir=${ASAN_BUILD_DIR:-build-asan}
  cmake -S "$ROOT" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g1" \
    -DNORMGRAD_SANITIZE=address,undefined -DNORMGRAD_BUILD_BENCHMARKS=OFF
  cmake --build "$dir" -j"$(nproc)"
  run_ctest "$dir"
}

# Two parts (docs/testing.md):
# 1. Our concurrent parts, every handoff one of our own locks: the thread pool (thread_pool_test),
#    admission and the service's metrics (service_concurrency_test), the metrics registry
#    (metrics_test), the module cache under concurrent first use, the CPU backend, the emulated
#    driver's streams. No suppressions: any report fails.
# 2. The tests that cross gRPC (the service with many streams, hostile clients, the client library
#    against a server and against a scripted one for its retries), with Debian's abseil
#    synchronization library rebuilt with TSan (scripts/tsan_abseil.sh) so that gRPC's locks are
#    visible. gRPC itself stays uninstrumented, so tests/tsan/triage.py fails on every report
#    between two accesses of our code and counts the reports with an access inside gRPC.
#    When the abseil source cannot be fetched: skipped with a warning, and fails under CI=true
#    (CI must not pass with half the stage silently gone); NORMGRAD_TSAN_GRPC=0 skips it on purpose.
TSAN_TARGETS=(thread_pool_test service_concurrency_test metrics_test module_cache_test
  cpu_backend_test ptxsim_emulated_driver_test)
TSAN_GRPC_TARGETS=(backward_service_test backward_errors_test admission_and_shutdown_test
  emit_ptx_service_test server_info_and_metrics_test shared_memory_service_test
  hostile_clients_test client_server_test client_scripted_server_test fairness_test)
stage_tsan() {
  local dir=${TSAN_BUILD_DIR:-build-tsan}
  # -g1: line tables and inlined frames, what reports and tests/tsan/triage.py read, at about
  # two thirds of -g's compile time.
  cmake -S "$ROOT" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g1" \
    -DNORMGRAD_SANITIZE=thread -DNORMGRAD_BUILD_BENCHMARKS=OFF -DNORMGRAD_BUILD_PYTHON=OFF
  cmake --build "$dir" -j"$(nproc)" --target "${TSAN_TARGETS[@]}"
  TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1" \
    run_ctest "$dir" -R "^(Concurrent[A-Za-z]*Test|ModuleCacheTest|CpuBackendTest|ThreadPoolTest|EmulatedDriverTest)\\."

  if [ "${NORMGRAD_TSAN_GRPC:-1}" = 0 ]; then
    echo "[dev.sh] tsan: NORMGRAD_TSAN_GRPC=0, the tests that cross gRPC are not run under TSan"
    return 0
  fi
  local abs_dir
  abs_dir=$(realpath -m "$dir")
  if ! bash "$ROOT/scripts/tsan_abseil.sh" "$abs_dir/abseil-tsan"; then
    if [ "${CI:-}" = true ]; then
      echo "[dev.sh] tsan: FAILED: could not rebuild abseil with -fsanitize=thread (above), so" \
        "the tests that cross gRPC cannot run under TSan (CI=true; NORMGRAD_TSAN_GRPC=0 skips" \
        "them on purpose)" >&2
      return 1
    fi
    echo "[dev.sh] tsan: WARNING: could not rebuild abseil with -fsanitize=thread (above);" \
      "the tests that cross gRPC were NOT run under TSan" >&2
    return 0
  fi
  cmake --build "$dir" -j"$(nproc)" --target "${TSAN_GRPC_TARGETS[@]}"
  local logs="$abs_dir/tsan-reports"
  rm -rf "$logs"
  mkdir -p "$logs"
  LD_LIBRARY_PATH="$abs_dir/abseil-tsan/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    TSAN_OPTIONS="halt_on_error=0:exitcode=0:ignore_noninstrumented_modules=1:log_path=$logs/report" \
    run_ctest "$dir" -R '^(Service[A-Za-z]*Test|HostileClientTest|(Client|Secure|Cli|Load)ServerTest|ClientProtocolTest|SharedMemoryTest|UnixSocketTest|FairnessTest|EmitPtxWorkersTest)\.'
  python3 "$ROOT/tests/tsan/triage.py" "$ROOT" "$logs"
}

# libFuzzer targets (tests/fuzz/): replay the committed seeds (ctest -L fuzz), then fuzz each for
# FUZZ_SECONDS. A crash, a hang past -timeout or memory past -rss_limit_mb fails the stage; the
# inputs found land in $dir/fuzz-corpus/<target>/ and the final cov:/ft:/exec/s on the log.
# CI fuzzes a fixed number of inputs from a fixed seed, so a run is reproducible (the same build
# explores the same inputs); each count takes well under a minute on 2 cores. FUZZ_SECONDS > 0 fuzzes by time instead.
FUZZ_TARGETS=(backward_sequence_fuzzer npy_fuzzer ptx_parser_fuzzer preload_fuzzer emit_ptx_fuzzer
  client_args_fuzzer)
declare -A FUZZ_RUNS=([backward_sequence_fuzzer]=3000000 [npy_fuzzer]=5000000
  [ptx_parser_fuzzer]=300000 [preload_fuzzer]=300000 [emit_ptx_fuzzer]=500000
  [client_args_fuzzer]=1000000)
# -O2 for the fuzzing speed, line tables only (-gline-tables-only: file:line and inlined frames
# in a crash's stack, at about half the compile time of -g).
stage_fuzz() {
  local dir=${FUZZ_BUILD_DIR:-build-fuzz}
  CC=clang-14 CXX=clang++-14 cmake -S "$ROOT" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -gline-tables-only" \
    -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O2 -gline-tables-only" \
    -DCMAKE_C_FLAGS=-fsanitize=fuzzer-no-link -DCMAKE_CXX_FLAGS=-fsanitize=fuzzer-no-link \
    -DNORMGRAD_SANITIZE=address,undefined -DNORMGRAD_FUZZ=ON -DNORMGRAD_BUILD_BENCHMARKS=OFF
  cmake --build "$dir" -j"$(nproc)" --target "${FUZZ_TARGETS[@]}"
  run_ctest "$dir" -L fuzz
  for t in "${FUZZ_TARGETS[@]}"; do
    mkdir -p "$dir/fuzz-corpus/$t"
    local budget status
    if [ "${FUZZ_SECONDS:-0}" -gt 0 ]; then
      budget=(-max_total_time="$FUZZ_SECONDS")
    else
      budget=(-runs="${FUZZ_RUNS[$t]}" -seed=1 -max_total_time=300)
    fi
    echo "[dev.sh] fuzzing $t: ${budget[*]}"
    local fuzz_start=$SECONDS
    set +e
    "$dir/bin/$t" "${budget[@]}" -rss_limit_mb=2048 -timeout=10 \
      -print_final_stats=1 -artifact_prefix="$dir/fuzz-corpus/$t-" \
      "$dir/fuzz-corpus/$t" "$ROOT/tests/fuzz/corpus/$t" > "$dir/fuzz-$t.log" 2>&1
    status=$?
    set -e
    printf '%s\t%d\n' "fuzzing $t (${budget[*]})" $((SECONDS - fuzz_start)) >> "$CI_SUMMARY_DIR/timed-fuzz.tsv"
    grep -E "^#[0-9]+[[:space:]]+(INITED|DONE)|^stat::|ERROR|SUMMARY|Test unit written" \
      "$dir/fuzz-$t.log" || true
    [ "$status" -eq 0 ] || { echo "[dev.sh] $t failed (exit $status); see $dir/fuzz-$t.log" >&2; return 1; }
  done
}

# The Dockerfile built unmodified with podman and the image checked from outside: PID 1 and
# user, HEALTHCHECK, health/backward/cubin through the published port with the default CMD and
# with the Kubernetes args (read-only root, no capabilities), SIGTERM under load, no compiler,
# libraries, size (scripts/container_check.sh; it installs podman, runc and debootstrap itself).
# The stage's first part (podman installed, base images pulled or made with debootstrap) waits on
# downloads more than it computes, so `test` starts it in the background once deps is done
# (CONTAINER_PREPARE_ONLY, its log in the summary folder) and the stage waits for it here.
CONTAINER_PREPARE_PID=
start_container_prepare() {
  # No CONTAINER_CHECKS_FILE here: the stage checks the base images itself ("present"), so the
  # summary counts each check once.
  CONTAINER_BUILD_DIR=${CONTAINER_BUILD_DIR:-build-container} CONTAINER_PREPARE_ONLY=1 \
    bash "$ROOT/scripts/container_check.sh" > "$CI_SUMMARY_DIR/container-prepare.log" 2>&1 &
  CONTAINER_PREPARE_PID=$!
  echo "[dev.sh] container: preparing podman and the base images in the background (pid $CONTAINER_PREPARE_PID)"
}
stage_container() {
  if [ -n "$CONTAINER_PREPARE_PID" ]; then
    local status=0
    wait "$CONTAINER_PREPARE_PID" || status=$?
    CONTAINER_PREPARE_PID=
    cat "$CI_SUMMARY_DIR/container-prepare.log"
    [ "$status" -eq 0 ] || { echo "[dev.sh] container: preparation failed (exit $status)" >&2; return 1; }
  fi
  CONTAINER_BUILD_DIR=${CONTAINER_BUILD_DIR:-build-container} \
    CONTAINER_CHECKS_FILE="$CI_SUMMARY_DIR/checks-container.txt" bash "$ROOT/scripts/container_check.sh"
}

cmd=${1:-build}
shift || true
case "$cmd" in
  deps) deps ;;
  build) build "$@" ;;
  test)
    rm -rf "$CI_SUMMARY_DIR"
    mkdir -p "$CI_SUMMARY_DIR"
    # The summary is printed however the run ends; a stage still running at exit failed.
    finish() {
      local status=$?
      if [ -n "$CURRENT_STAGE" ]; then
        printf '%s\t%d\tFAILED\n' "$CURRENT_STAGE" $((SECONDS - stage_start)) >> "$CI_SUMMARY_DIR/stages.tsv"
      fi
      if [ -n "$CONTAINER_PREPARE_PID" ]; then kill "$CONTAINER_PREPARE_PID" 2> /dev/null || true; fi
      python3 "$ROOT/scripts/ci_summary.py" "$CI_SUMMARY_DIR" || true
      return $status
    }
    trap finish EXIT
    stage_start=$SECONDS
    CURRENT_STAGE=deps
    deps
    printf '%s\t%d\tpassed\n' deps $((SECONDS - stage_start)) >> "$CI_SUMMARY_DIR/stages.tsv"
    CURRENT_STAGE=
    case " ${NORMGRAD_CI_STAGES:-container} " in
      *" container "*) start_container_prepare ;;
    esac
    for stage in ${NORMGRAD_CI_STAGES:-main asan tsan fuzz container}; do
      stage_start=$SECONDS
      CURRENT_STAGE=$stage
      echo "[dev.sh] stage $stage"
      "stage_$stage"
      echo "[dev.sh] stage $stage passed in $((SECONDS - stage_start)) s"
      printf '%s\t%d\tpassed\n' "$stage" $((SECONDS - stage_start)) >> "$CI_SUMMARY_DIR/stages.tsv"
      CURRENT_STAGE=
    done
    ;;
  run)
    # Only what it runs: the server and the CLI (no tests, benchmarks or Python package, so not
    # their packages either), in a tree of its own so that build/'s configuration (tests on)
    # is never changed by it.
    NORMGRAD_DEPS_EXCLUDE=${NORMGRAD_DEPS_EXCLUDE:-$TEST_ONLY_PACKAGES} deps
    run_dir=${RUN_BUILD_DIR:-build-run}
    cmake -S "$ROOT" -B "$run_dir" -G Ninja -DCMAKE_BUILD_TYPE="$BUILD_TYPE" \
      -DNORMGRAD_BUILD_TESTS=OFF -DNORMGRAD_BUILD_BENCHMARKS=OFF -DNORMGRAD_BUILD_PYTHON=OFF
    # The target list read whole first: `grep -q` on the pipe would end ninja with SIGPIPE, which
    # pipefail turns into a failed test.
    run_targets=$(ninja -C "$run_dir" -t targets all)
    if grep -q '^bin/normgrad-server:' <<<"$run_targets"; then
      cmake --build "$run_dir" -j"$(nproc)" --target normgrad-server normgrad
      exec "$run_dir/bin/normgrad-server" "$@"
    else  # a tree without gRPC: the offline PTX emitter is what there is to run
      cmake --build "$run_dir" -j"$(nproc)" --target normgrad-ptx
      exec "$run_dir/bin/normgrad-ptx" --kernel batched_rms_norm_backward --hidden-dim 896 "$@"
    fi
    ;;
  *) echo "usage: scripts/dev.sh deps|build|test|run [args...]" >&2; exit 2 ;;
esac
