#!/usr/bin/env bash
# The CI stage `container` (scripts/dev.sh): builds the Dockerfile, unmodified, into an image with
# podman and checks the image from outside (docs/testing.md, docs/operations.md "Running the image").
#
#   scripts/container_check.sh            work dir: $CONTAINER_BUILD_DIR, default build-container/
#
# 1. podman (with runc) and debootstrap are installed with apt-get when missing; podman gets a
#    private containers.conf (runc, cgroupfs, default ulimits within this shell's hard limits).
# 2. Base images: each FROM of the Dockerfile (debian:12, debian:12-slim, the CUDA image) is used
#    when present, pulled when a registry answers, and otherwise made here under the exact name
#    the Dockerfile uses: Debian from `debootstrap` with this machine's own apt sources (the
#    rootfs tarball is cached in the work dir), the CUDA image as a stand-in holding only what
#    the Dockerfile copies from it (include/ and nvJitLink), taken from the installed toolkit.
# 3. `podman build --format docker` (Docker's image format keeps HEALTHCHECK and STOPSIGNAL).
# 4. Checks, each printed as `[container] ok: ...`; the first failure ends the script non-zero.
#
# When podman cannot run containers at all, the script says so and exits 1 under CI=true
# (a skip would hide that the image was never checked); elsewhere it exits 0 after the warning.
# Environment: CONTAINER_PREPARE_ONLY=1 (steps 1-2 only, below), CONTAINER_IMAGE (default normgrad:ci), CONTAINER_MAX_IMAGE_MB (default 240; the
# image is 214 MB, and nvJitLink copied twice again would make it 313 MB). The image stays in
# podman's store for inspection (CONTAINERS_CONF=build-container/containers.conf podman run ...).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
WORK=$(realpath -m "${CONTAINER_BUILD_DIR:-build-container}")
IMAGE=${CONTAINER_IMAGE:-normgrad:ci}
MAX_IMAGE_MB=${CONTAINER_MAX_IMAGE_MB:-240}
START=$SECONDS
mkdir -p "$WORK"

# Debian's python3 (numpy, yaml); a python3 earlier on PATH may be another interpreter.
PY=/usr/bin/python3
say() { echo "[container] $*"; }
# CONTAINER_CHECKS_FILE (set by scripts/dev.sh): each passed check is also written there, a line
# each, for the run's summary.
ok() {
  echo "[container] ok: $*"
  if [ -n "${CONTAINER_CHECKS_FILE:-}" ]; then echo "$*" >> "$CONTAINER_CHECKS_FILE"; fi
}
fail() {
  echo "[container] FAIL: $*" >&2
  exit 1
}
as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}
# podman logs an error for every container with a HEALTHCHECK when systemd (its probe timer)
# is absent; the checks run the probe themselves, so those lines are dropped.
podman() {
  as_root env CONTAINERS_CONF="$WORK/containers.conf" podman "$@" 2> >(grep -v 'systemd connection' >&2)
}

# --- 1. packages and podman's configuration -----------------------------------------------
PACKAGES=(podman runc debootstrap netavark aardvark-dns uidmap fuse-overlayfs
  iptables python3 python3-numpy python3-yaml ca-certificates)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  say "installing: ${missing[*]}"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" > "$WORK/apt.log" 2>&1 || { tail -20 "$WORK/apt.log" >&2; fail "apt-get install failed"; }
fi

# podman's default ulimits (nofile, nproc) may exceed the hard limits of this shell, and then
# runc's setrlimit fails (no CAP_SYS_RESOURCE to raise them); crun refuses hybrid cgroup
# hierarchies, runc does not. podman also lowers its own (and so conmon's and runc's) nproc
# limit to kernel.pid_max, so the containers get at most that.
nofile=$(ulimit -Hn)
nproc=$(ulimit -Hu)
[ "$nofile" = unlimited ] && nofile=1048576
[ "$nproc" = unlimited ] && nproc=1048576
pid_max=$(cat /proc/sys/kernel/pid_max 2> /dev/null || echo "$nproc")
[ "$nproc" -le "$pid_max" ] || nproc=$pid_max
cat > "$WORK/containers.conf" <<EOF
[containers]
default_ulimits = ["nofile=${nofile}:${nofile}", "nproc=${nproc}:${nproc}"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF

podman_broken() {
  echo "[container] ==================================================================" >&2
  echo "[container] PODMAN CANNOT RUN HERE: $*" >&2
  echo "[container] The image was NOT built or checked." >&2
  echo "[container] ==================================================================" >&2
  if [ "${CI:-}" = true ]; then exit 1; fi
  exit 0
}
podman info > "$WORK/podman-info.txt" 2>&1 || podman_broken "podman info failed: $(tail -3 "$WORK/podman-info.txt")"

# --- 2. base images -------------------------------------------------------------------------
# FROM names, with ARG defaults substituted (FROM ${CUDA_IMAGE} AS cuda).
mapfile -t FROMS < <($PY - "$ROOT/Dockerfile" <<'EOF'
import re, sys
args, stages = {}, set()
for line in open(sys.argv[1]):
    m = re.match(r"\s*ARG\s+(\w+)=(\S+)", line)
    if m:
        args[m.group(1)] = m.group(2)
    m = re.match(r"\s*FROM\s+(\S+)(?:\s+AS\s+(\S+))?", line, re.I)
    if m:
        name = re.sub(r"\$\{?(\w+)\}?", lambda v: args.get(v.group(1), ""), m.group(1))
        if name not in stages and name != "scratch":
            print(name)
        if m.group(2):
            stages.add(m.group(2))
EOF
)
debian_rootfs() { # CODENAME [slim] -> path of a cached rootfs tarball made by debootstrap
  local codename=$1 tarball="$WORK/base/debian-$1-rootfs.tar" slim="$WORK/base/debian-$1-slim-rootfs.tar"
  if [ "${2:-}" = slim ]; then
    debian_rootfs "$codename" > /dev/null
    echo "$slim"
    return 0
  fi
  if [ -s "$tarball" ] && [ -s "$slim" ]; then
    echo "$tarball"
    return 0
  fi
  mkdir -p "$WORK/base"
  local mirror rootfs="$WORK/base/rootfs-$codename"
  mirror=$($PY "$ROOT/tests/container/apt_sources.py" mirror "$codename") ||
    fail "this machine's apt sources have no entry for $codename; cannot debootstrap"
  say "debootstrap $codename from this machine's apt source $mirror" >&2
  as_root rm -rf "$rootfs"
  local t=$SECONDS
  as_root debootstrap --variant=minbase "$codename" "$rootfs" "$mirror" > "$WORK/base/debootstrap.log" 2>&1 ||
    { tail -20 "$WORK/base/debootstrap.log" >&2; fail "debootstrap $codename failed"; }
  # The image's apt uses the machine's sources (updates and security included), as the
  # official image uses its own.
  $PY "$ROOT/tests/container/apt_sources.py" deb822 "$codename" |
    as_root tee "$rootfs/etc/apt/sources.list.d/debian.sources" > /dev/null
  as_root rm -f "$rootfs/etc/apt/sources.list"
  # apt as in the official images: no package cache or downloaded .debs left in layers, no
  # translations.
  printf '%s\n' 'DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };' \
    'APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };' \
    'Dir::Cache::pkgcache ""; Dir::Cache::srcpkgcache "";' | as_root tee "$rootfs/etc/apt/apt.conf.d/docker-clean" > /dev/null
  echo 'Acquire::Languages "none";' | as_root tee "$rootfs/etc/apt/apt.conf.d/docker-no-languages" > /dev/null
  as_root rm -rf "$rootfs/var/lib/apt/lists/"* "$rootfs/var/cache/apt/"*.bin "$rootfs/var/cache/apt/archives/"*.deb
  as_root tar -C "$rootfs" --numeric-owner -cf "$tarball.tmp" .
  # -slim as the official images make it: no documentation, manual pages or translations,
  # and dpkg told not to install them later.
  printf '%s\n' 'path-exclude /usr/share/doc/*' 'path-include /usr/share/doc/*/copyright' \
    'path-exclude /usr/share/info/*' 'path-exclude /usr/share/linda/*' \
    'path-exclude /usr/share/lintian/overrides/*' 'path-exclude /usr/share/locale/*' \
    'path-exclude /usr/share/man/*' | as_root tee "$rootfs/etc/dpkg/dpkg.cfg.d/docker-slim" > /dev/null
  as_root find "$rootfs/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
  as_root find "$rootfs/usr/share/info" "$rootfs/usr/share/locale" "$rootfs/usr/share/man" \
    "$rootfs/usr/share/lintian/overrides" -mindepth 1 -delete 2> /dev/null || true
  as_root tar -C "$rootfs" --numeric-owner -cf "$slim.tmp" .
  as_root rm -rf "$rootfs"
  mv "$tarball.tmp" "$tarball"
  mv "$slim.tmp" "$slim"
  say "debootstrap took $((SECONDS - t)) s; rootfs cached in $tarball (and -slim)" >&2
  echo "$tarball"
}

codename_of() { # debian:12, debian:12-slim, debian:bookworm -> bookworm
  local tag=${1##*:}
  tag=${tag%-slim}
  case "$tag" in
    11 | bullseye) echo bullseye ;;
    12 | bookworm) echo bookworm ;;
    13 | trixie) echo trixie ;;
    *) return 1 ;;
  esac
}

cuda_stand_in() { # NAME: include/ and nvJitLink of the installed toolkit, nothing else
  local name=$1 cuda=${CUDA_HOME:-/usr/local/cuda}
  [ -f "$cuda/include/cuda.h" ] && ls "$cuda"/lib64/libnvJitLink.so.* > /dev/null 2>&1 ||
    fail "no CUDA toolkit in $cuda (include/cuda.h, lib64/libnvJitLink.so.*) to make a stand-in for $name"
  local stage="$WORK/base/cuda-stand-in"
  rm -rf "$stage"
  mkdir -p "$stage/usr/local/cuda/lib64"
  cp -a "$(realpath "$cuda/include")" "$stage/usr/local/cuda/include"
  local lib=$stage/usr/local/cuda/lib64 so13=$cuda/lib64/libnvJitLink.so.13
  if [ -f "$so13" ] && [ ! -L "$so13" ]; then
    # A toolkit installed from wheels has the library as a plain file; lay it out as the CUDA
    # packages (and so the real image) do: libnvJitLink.so -> .so.13 -> .so.13.X.Y, the file.
    local version
    version=$(ls -d "$cuda"/dist-info/nvidia_nvjitlink-*.dist-info 2> /dev/null | head -1 |
      sed 's/.*nvidia_nvjitlink-\(.*\)\.dist-info/\1/')
    version=${version:-13.0.0}
    cp "$so13" "$lib/libnvJitLink.so.$version"
    ln -s "libnvJitLink.so.$version" "$lib/libnvJitLink.so.13"
    ln -s libnvJitLink.so.13 "$lib/libnvJitLink.so"
  else
    cp -a "$cuda"/lib64/libnvJitLink.so* "$lib/"
  fi
  tar -C "$stage" --numeric-owner -cf - . | podman import -q - "$name" > /dev/null
  rm -rf "$stage"
}

# Names as the Dockerfile writes them: podman resolves a short name to a local image first
# (an import is stored as localhost/NAME), then to a registry from registries.conf.
for from in "${FROMS[@]}"; do
  name=$from
  if podman image exists "$name"; then
    ok "base image $name present"
    continue
  fi
  if timeout 60 podman pull -q "$name" > "$WORK/pull.log" 2>&1; then
    ok "base image $name pulled"
    continue
  fi
  say "cannot pull $name ($(tail -1 "$WORK/pull.log" | cut -c1-160)); making it here"
  case "$from" in
    debian:*)
      codename=$(codename_of "$from") || fail "no Debian codename for $from"
      case "$from" in
        *-slim) tarball=$(debian_rootfs "$codename" slim) ;;
        *) tarball=$(debian_rootfs "$codename") ;;
      esac
      podman import -q -c 'CMD ["bash"]' "$tarball" "$name" > /dev/null
      ok "base image $name made with debootstrap ($codename)"
      ;;
    *cuda*)
      cuda_stand_in "$name"
      ok "base image $name: stand-in from the installed CUDA toolkit (include/, nvJitLink)"
      ;;
    *) fail "base image $from: cannot pull it and no recipe to make it" ;;
  esac
done

# CONTAINER_PREPARE_ONLY=1: steps 1 and 2 only (packages, podman's configuration, base images).
# scripts/dev.sh runs that in the background while the other stages build and test, since it is
# mostly waiting on downloads; the container stage then finds the base images present.
if [ "${CONTAINER_PREPARE_ONLY:-0}" = 1 ]; then
  say "prepared in $((SECONDS - START)) s: podman and the base images"
  exit 0
fi

# --- 3. build -------------------------------------------------------------------------------
say "podman build --format docker -t $IMAGE ."
t=$SECONDS
# buildah's RUN steps do not take containers.conf's default_ulimits: pass the same ones.
podman build --format docker --pull=never --ulimit "nofile=$nofile:$nofile" --ulimit "nproc=$nproc:$nproc" \
  -t "$IMAGE" -f Dockerfile . > "$WORK/build.log" 2>&1 ||
  { tail -40 "$WORK/build.log" >&2; fail "image build failed (log: $WORK/build.log)"; }
build_s=$((SECONDS - t))
ok "image built in $build_s s"

# --- 4. checks ------------------------------------------------------------------------------
CONTAINERS=()
cleanup() {
  for c in "${CONTAINERS[@]}"; do podman rm -f -t 0 "$c" > /dev/null 2>&1 || true; done
}
trap cleanup EXIT
DATA="$WORK/data"
rm -rf "$DATA"
mkdir -p "$DATA"
chmod 0777 "$DATA"

# The image's own CLI, outside the server's container, through the published port.
# --no-healthcheck: these are one-shot tools, and without systemd podman cannot time probes.
cli() { podman run --rm --no-healthcheck --network host -v "$DATA:/data" --entrypoint normgrad "$IMAGE" "$@"; }
load() { podman run --rm --no-healthcheck --network host -v "$DATA:/data" --entrypoint normgrad-load "$IMAGE" "$@"; }
in_image() { podman run --rm --no-healthcheck --entrypoint sh "$IMAGE" -c "$1"; }

start_server() { # NAME EXTRA_RUN_FLAGS... -- SERVER_ARGS...; prints nothing, waits for ready
  local name=$1
  shift
  local run_flags=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do run_flags+=("$1"); shift; done
  [ $# -gt 0 ] && shift
  podman rm -f -t 0 "$name" > /dev/null 2>&1 || true
  CONTAINERS+=("$name")
  # The image's HEALTHCHECK stays; its timer is off (podman times probes with systemd, absent
  # here): the checks run it with `podman healthcheck run`.
  podman run -d --name "$name" --health-interval=disable -p 127.0.0.1::50051 -p 127.0.0.1::9464 \
    "${run_flags[@]}" "$IMAGE" "$@" > /dev/null
  local i
  for i in $(seq 1 120); do
    if podman logs "$name" 2>/dev/null | grep -q "^normgrad-server ready"; then return 0; fi
    [ "$(podman inspect -f '{{.State.Running}}' "$name")" = true ] ||
      { podman logs "$name" >&2; fail "$name exited before its ready line"; }
    sleep 0.5
  done
  podman logs "$name" >&2
  fail "$name printed no ready line in 60 s"
}
port_of() { podman port "$1" "$2/tcp" | head -1 | sed 's/.*://'; }

# The backward of one batch through the CLI against numpy's reference.
$PY - "$DATA" <<'EOF'
import sys, numpy as np
d = sys.argv[1]
rng = np.random.default_rng(7)
x = rng.standard_normal((96, 896), dtype=np.float32)
dy = rng.standard_normal((96, 896), dtype=np.float32)
g = rng.standard_normal(896, dtype=np.float32)
for n, a in (("x", x), ("dy", dy), ("gamma", g)):
    np.save(f"{d}/{n}.npy", a)
EOF
chmod 0666 "$DATA"/*.npy
check_backward() { # PORT LABEL
  rm -f "$DATA/dx.npy" "$DATA/dg.npy"
  cli --target="127.0.0.1:$1" backward --x /data/x.npy --dy /data/dy.npy --gamma /data/gamma.npy \
    --dx /data/dx.npy --dgamma /data/dg.npy > "$WORK/backward.log" 2>&1 ||
    { cat "$WORK/backward.log" >&2; fail "$2: backward through the published port"; }
  $PY - "$DATA" <<'EOF' || fail "$2: backward gradients differ from numpy's"
import sys, numpy as np
d = sys.argv[1]
x, dy, g = (np.load(f"{d}/{n}.npy").astype(np.float64) for n in ("x", "dy", "gamma"))
eps = 1e-5
rinv = 1.0 / np.sqrt((x * x).mean(axis=1, keepdims=True) + eps)
xhat = x * rinv
gdy = dy * g
dx = rinv * (gdy - xhat * (gdy * xhat).mean(axis=1, keepdims=True))
dg = (dy * xhat).sum(axis=0)
got_dx, got_dg = np.load(f"{d}/dx.npy"), np.load(f"{d}/dg.npy")
assert got_dx.shape == dx.shape and got_dg.shape == dg.shape, (got_dx.shape, got_dg.shape)
assert np.allclose(got_dx, dx, rtol=1e-3, atol=1e-4), np.abs(got_dx - dx).max()
assert np.allclose(got_dg, dg, rtol=1e-3, atol=1e-3), np.abs(got_dg - dg).max()
EOF
  ok "$2: backward (96x896) through the published port matches numpy"
}
check_cubin() { # PORT LABEL
  rm -f "$DATA/k.cubin" "$DATA/k.ptx"
  cli --target="127.0.0.1:$1" emit-ptx --kernel rms_norm_backward_row_resident --hidden-dim 4096 \
    --target sm_90 -o /data/k.ptx --cubin /data/k.cubin > "$WORK/emit.log" 2>&1 ||
    { cat "$WORK/emit.log" >&2; fail "$2: emit-ptx --cubin through the published port"; }
  head -c 4 "$DATA/k.cubin" | od -An -c | grep -q 'E   L   F' || fail "$2: the cubin is not an ELF file"
  grep -q '^.entry\|\.entry' "$DATA/k.ptx" || fail "$2: the PTX has no .entry"
  ok "$2: emit-ptx --cubin through the published port ($(stat -c %s "$DATA/k.cubin")-byte ELF cubin)"
}

# 4a. Image contents.
size=$(podman image inspect -f '{{.Size}}' "$IMAGE")
size_mb=$((size / 1000000))
say "image size: $size_mb MB ($size bytes); ceiling $MAX_IMAGE_MB MB"
[ "$size_mb" -le "$MAX_IMAGE_MB" ] || fail "image is $size_mb MB, over the $MAX_IMAGE_MB MB ceiling"
ok "image size $size_mb MB <= $MAX_IMAGE_MB MB"
[ "$(podman image inspect -f '{{.Config.StopSignal}}' "$IMAGE")" = SIGTERM ] || fail "STOPSIGNAL is not SIGTERM"
podman image inspect -f '{{json .Config.Healthcheck}}' "$IMAGE" | grep -q 'normgrad health' ||
  fail "the image has no HEALTHCHECK (built without --format docker?)"
ok "image config: STOPSIGNAL SIGTERM, HEALTHCHECK kept"
compilers=$(in_image 'for c in cc c++ gcc g++ clang clang++ ld as cpp make cmake; do command -v $c; done; ls -d /usr/lib/gcc/*/*/cc1* 2>/dev/null; true')
[ -z "$compilers" ] || fail "the runtime image holds a compiler or build tool: $compilers"
ok "no compiler, assembler, linker or build tool in the runtime image"
unresolved=$(in_image 'for b in /usr/local/bin/* /usr/local/lib/libnvJitLink.so.13; do ldd "$b" | sed "s|^|$b: |"; done' | grep 'not found' || true)
[ -z "$unresolved" ] || fail "unresolved libraries: $unresolved"
in_image 'ls /usr/local/bin/' | tr '\n' ' ' | grep -q 'normgrad-server' || fail "no normgrad-server in /usr/local/bin"
ok "every library of $(in_image 'ls /usr/local/bin | tr "\n" " "')and libnvJitLink.so.13 resolves"
copies=$(in_image 'find / -xdev -name "libnvJitLink.so*" -type f 2> /dev/null | wc -l')
[ "$copies" = 1 ] || fail "$copies copies of nvJitLink in the image (want 1)"
ok "one copy of nvJitLink, found by the loader: $(in_image 'ldconfig -p | grep libnvJitLink | tr -s " "')"

# 4b. The image's default command.
start_server ng-default --
grpc=$(port_of ng-default 50051)
metrics=$(port_of ng-default 9464)
uid=$(podman exec ng-default sh -c 'grep ^Uid: /proc/1/status' | awk '{print $2}')
comm=$(podman exec ng-default cat /proc/1/comm)
[ "$comm" = normgrad-server ] || fail "PID 1 is $comm, not normgrad-server"
[ "$uid" != 0 ] || fail "PID 1 runs as root"
ok "PID 1 is normgrad-server as uid $uid"
podman healthcheck run ng-default > "$WORK/hc.log" 2>&1 || { cat "$WORK/hc.log" >&2; fail "HEALTHCHECK failed on a serving server"; }
ok "HEALTHCHECK command passes"
cli --target="127.0.0.1:$grpc" health | grep -q SERVING || fail "normgrad health through the published port"
ok "normgrad health through the published port: SERVING"
check_backward "$grpc" "default CMD"
check_cubin "$grpc" "default CMD"
curl_metrics=$($PY -c "import urllib.request,sys; print(urllib.request.urlopen('http://127.0.0.1:$metrics/metrics', timeout=5).read().decode())")
echo "$curl_metrics" | grep -q '^normgrad_serving 1' || fail "metrics through the published port"
ok "metrics through the published port (normgrad_serving 1)"

# 4c. The HEALTHCHECK fails against a dead port.
start_server ng-deadport -e NORMGRAD_HEALTH_ARGS=--target=127.0.0.1:1 --
if podman healthcheck run ng-deadport > "$WORK/hc-dead.log" 2>&1; then
  fail "HEALTHCHECK passed against a dead port"
fi
ok "HEALTHCHECK fails against a dead port ($(tr '\n' ' ' < "$WORK/hc-dead.log" | cut -c1-80))"
podman rm -f -t 0 ng-deadport > /dev/null

# 4d. The Kubernetes deployment's exact args (the CPU overlay: no GPU here), with its
# securityContext: read-only root, every capability dropped, no new privileges, /tmp an emptyDir.
command -v kubectl > /dev/null || fail "kubectl is needed to render deploy/k8s"
mapfile -t K8S_ARGS < <(kubectl kustomize deploy/k8s/overlays/cpu | $PY -c '
import sys, yaml
for d in yaml.safe_load_all(sys.stdin):
    if d and d["kind"] == "Deployment":
        for a in d["spec"]["template"]["spec"]["containers"][0]["args"]:
            print(a)')
[ ${#K8S_ARGS[@]} -gt 0 ] || fail "no args rendered from deploy/k8s/overlays/cpu"
say "Kubernetes args: ${K8S_ARGS[*]}"
start_server ng-k8s --read-only --cap-drop=ALL --security-opt=no-new-privileges \
  --tmpfs /tmp:rw,size=64m --user 10001:10001 -- "${K8S_ARGS[@]}"
caps=$(podman exec ng-k8s sh -c 'grep -E "^(CapEff|CapPrm|CapBnd|NoNewPrivs)" /proc/1/status' | tr -s '\t ' ' ')
echo "$caps" | grep -q 'CapEff: 0000000000000000' || fail "k8s: capabilities left: $caps"
echo "$caps" | grep -q 'CapBnd: 0000000000000000' || fail "k8s: bounding set not empty: $caps"
echo "$caps" | grep -q 'NoNewPrivs: 1' || fail "k8s: no-new-privileges not set: $caps"
podman exec ng-k8s sh -c 'touch /usr/local/bin/x 2>/dev/null' && fail "k8s: the root filesystem is writable"
ok "k8s: read-only root, no capabilities, no-new-privileges"
grpc=$(port_of ng-k8s 50051)
cli --target="127.0.0.1:$grpc" health | grep -q SERVING || fail "k8s args: normgrad health"
ok "k8s args: normgrad health SERVING"
check_backward "$grpc" "k8s args"
check_cubin "$grpc" "k8s args"

# 4e. SIGTERM under load: in-flight streams drain, the process exits 0 within the grace.
k8s_metrics=$(port_of ng-k8s 9464)
# The server's OK RmsNormBackward calls and streams in flight, from its metrics.
scrape_ok_in_flight() {
  $PY -c "
import urllib.request
t = urllib.request.urlopen('http://127.0.0.1:$k8s_metrics/metrics', timeout=5).read().decode()
v = lambda p: next((l.rsplit(' ', 1)[1] for l in t.splitlines() if l.startswith(p)), '0')
print(int(float(v('normgrad_requests_total{code=\"OK\",method=\"RmsNormBackward\"}'))),
      int(float(v('normgrad_inflight_streams '))))"
}
# The OK calls of the checks above, so that only the load's are compared with its own count.
read -r ok_earlier _ < <(scrape_ok_in_flight)
load --target="127.0.0.1:$grpc" --concurrency=4 --shapes=512x4096 --duration=8s --max-attempts=1 \
  --format=json -o /data/load.json > "$WORK/load.log" 2>&1 &
load_pid=$!
for i in $(seq 1 40); do # wait until streams are in flight; the load's OK calls so far, in flight
  read -r ok_server n < <(scrape_ok_in_flight)
  ok_before=$((ok_server - ok_earlier))
  [ "$n" -ge 1 ] && break
  sleep 0.25
done
[ "${n%.*}" -ge 1 ] || fail "SIGTERM check: no stream in flight under load"
t=$SECONDS
podman stop -t 35 ng-k8s > /dev/null
stop_s=$((SECONDS - t))
code=$(podman inspect -f '{{.State.ExitCode}}' ng-k8s)
wait "$load_pid" || true
podman logs ng-k8s > "$WORK/k8s-server.log" 2>&1
[ "$code" = 0 ] || { cat "$WORK/k8s-server.log" >&2; fail "SIGTERM under load: exit code $code"; }
grep -q 'SIGTERM' "$WORK/k8s-server.log" && grep -q 'normgrad-server: stopped' "$WORK/k8s-server.log" ||
  { cat "$WORK/k8s-server.log" >&2; fail "SIGTERM under load: no drain on the log"; }
$PY - "$DATA/load.json" "$n" "$ok_before" <<'EOF' || { cat "$WORK/load.log" >&2; fail "SIGTERM under load: in-flight calls were not drained"; }
import json, sys
r = json.load(open(sys.argv[1]))["runs"][-1]  # normgrad-load --format=json: one run
errors = r.get("errors_by_code", {})
ok, in_flight, ok_before = r.get("successes", 0), int(sys.argv[2]), int(sys.argv[3])
print(f"[container] load: {ok} calls OK ({ok - ok_before} after the last scrape before SIGTERM, "
      f"which saw {in_flight} in flight); errors {errors}")
# Every stream in flight at the signal finished OK: calls started after it get UNAVAILABLE (or
# CANCELLED in the instant gRPC's shutdown begins, docs/operations.md "Shutdown").
assert ok - ok_before >= in_flight, "a stream in flight at SIGTERM did not finish OK"
assert set(errors) <= {"UNAVAILABLE", "CANCELLED"}, f"unexpected errors: {errors}"
EOF
ok "SIGTERM under load: drained in $stop_s s, exit code 0"

cleanup
CONTAINERS=()

say "image $size_mb MB, built in $build_s s; stage $((SECONDS - START)) s"
