#!/usr/bin/env bash
# Soak test (not part of CI): one normgrad-server under mixed load for a chosen duration.
#
#   scripts/soak.sh [--duration 10m] [--workers 4] [--report-every 30s] [--max-heap-growth-mib 16]
#                   [-- SERVER FLAGS...]
#
# Builds normgrad-server and normgrad-soak (tests/soak/) in $BUILD_DIR (default build), starts
# the server on 127.0.0.1 with the CPU backend (pass e.g. `-- --backend=cuda` to change that),
# and runs normgrad-soak against it: large and small RmsNormBackward batches (every response
# checked against the reference), EmitPtx, cancelled streams and malformed streams. Prints the
# server's RSS every --report-every, then requests by kind and outcome, the wrong-gradient count
# and RSS after warm-up versus at the end; also, with the workers paused and the server idle,
# its heap in use (the metrics endpoint's normgrad_process_heap_in_use_bytes) at each report.
# Exits non-zero on any wrong gradient, any unexpected outcome, idle heap growth past
# --max-heap-growth-mib (default 16) after warm-up, or a server that dies. docs/testing.md has a 10-minute run's figures.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
duration=10m
workers=4
report_every=30s
max_heap_growth_mib=16
server_flags=()
while [ $# -gt 0 ]; do
  case "$1" in
    --duration) duration=$2; shift 2 ;;
    --duration=*) duration=${1#*=}; shift ;;
    --workers) workers=$2; shift 2 ;;
    --workers=*) workers=${1#*=}; shift ;;
    --report-every) report_every=$2; shift 2 ;;
    --report-every=*) report_every=${1#*=}; shift ;;
    --max-heap-growth-mib) max_heap_growth_mib=$2; shift 2 ;;
    --max-heap-growth-mib=*) max_heap_growth_mib=${1#*=}; shift ;;
    --) shift; server_flags=("$@"); break ;;
    *) echo "usage: scripts/soak.sh [--duration 10m] [--workers 4] [--report-every 30s] [--max-heap-growth-mib 16] [-- server flags]" >&2
       exit 2 ;;
  esac
done

if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-RelWithDebInfo}"
fi
cmake --build "$BUILD_DIR" -j"$(nproc)" --target normgrad-server normgrad-soak

log=$(mktemp)
"$BUILD_DIR/bin/normgrad-server" --listen=127.0.0.1:0 --metrics-listen=127.0.0.1:0 \
  --backend=cpu --max-streams=16 --max-inflight-bytes=$((256 << 20)) \
  --stream-idle-timeout=30s --shutdown-grace=5s "${server_flags[@]}" >"$log" 2>&1 &
server_pid=$!
cleanup() {
  kill -TERM "$server_pid" 2>/dev/null || true
  wait "$server_pid" 2>/dev/null || true
  rm -f "$log"
}
trap cleanup EXIT

port=
for _ in $(seq 1 600); do
  port=$(sed -n 's/.*ready grpc=[^ ]*:\([0-9][0-9]*\).*/\1/p' "$log" | head -n 1)
  metrics_port=$(sed -n 's/.* metrics=[^ ]*:\([0-9][0-9]*\).*/\1/p' "$log" | head -n 1)
  [ -n "$port" ] && break
  kill -0 "$server_pid" 2>/dev/null || { cat "$log" >&2; exit 1; }
  sleep 0.2
done
[ -n "$port" ] || { echo "soak: the server printed no ready line" >&2; cat "$log" >&2; exit 1; }
echo "soak: $(head -n 1 "$log") pid=$server_pid"

rc=0
"$BUILD_DIR/bin/normgrad-soak" --port="$port" --metrics-port="${metrics_port:-0}" \
  --server-pid="$server_pid" --duration="$duration" --workers="$workers" \
  --report-every="$report_every" --max-heap-growth-mib="$max_heap_growth_mib" || rc=$?
if ! kill -0 "$server_pid" 2>/dev/null; then
  echo "soak: the server died during the run" >&2
  cat "$log" >&2
  rc=1
fi
echo "soak: $( [ $rc -eq 0 ] && echo PASSED || echo FAILED )"
exit $rc
