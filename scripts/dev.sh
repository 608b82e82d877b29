#!/usr/bin/env bash
# One entry point for people, CI and the container build, so they cannot drift.
#
#   scripts/dev.sh deps     install the Debian/Ubuntu packages the build needs (apt-get; sudo if not root)
#   scripts/dev.sh build    deps + configure + build into build/ (binaries in build/bin/)
#   scripts/dev.sh test     build + run every ctest label that CI runs
#   scripts/dev.sh run [server flags...]   build + run the server (CPU backend when no GPU)
#
# Environment: BUILD_DIR (default build), BUILD_TYPE (default RelWithDebInfo),
# NORMGRAD_SKIP_DEPS=1 skips the package step (for images that already have them).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
BUILD_DIR=${BUILD_DIR:-build}
BUILD_TYPE=${BUILD_TYPE:-RelWithDebInfo}

# Packages: build toolchain, gRPC/protobuf/abseil, SIMD, HTTP, tests, and the tools tests call.
PACKAGES=(
  build-essential cmake ninja-build pkg-config git ca-certificates
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libabsl-dev
  libhwy-dev libcpp-httplib-dev libssl-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  python3 python3-numpy python3-yaml openssl
)

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

deps() {
  [ "${NORMGRAD_SKIP_DEPS:-0}" = 1 ] && return 0
  local missing=()
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "[dev.sh] installing: ${missing[*]}"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
  fi
}

configure() {
  cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE="$BUILD_TYPE" "$@"
}

build() {
  deps
  configure "$@"
  cmake --build "$BUILD_DIR" -j"$(nproc)"
}

cmd=${1:-build}
shift || true
case "$cmd" in
  deps) deps ;;
  build) build "$@" ;;
  test)
    build
    (cd "$BUILD_DIR" && ctest --output-on-failure -j"$(nproc)" --timeout 900)
    ;;
  run)
    build
    if [ -x "$BUILD_DIR/bin/normgrad-server" ]; then
      exec "$BUILD_DIR/bin/normgrad-server" "$@"
    else
      exec "$BUILD_DIR/bin/normgrad-ptx" --kernel batched_rms_norm_backward --hidden-dim 896 "$@"
    fi
    ;;
  *) echo "usage: scripts/dev.sh deps|build|test|run [args...]" >&2; exit 2 ;;
esac
