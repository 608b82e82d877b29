# normgrad server image (docs/operations.md, "Running the image").
#   docker build -t normgrad .                       or: podman build --format docker -t normgrad .
#   docker run --gpus all --stop-timeout 35 -p 50051:50051 -p 9464:9464 normgrad
# Stop it with `docker stop -t 35` (or `podman stop -t 35`): the server drains for up to
# --shutdown-grace (30 s) after SIGTERM, longer than Docker's default 10 s before SIGKILL.
# Without a GPU (or without the NVIDIA container runtime) the server falls back to its CPU
# backend. No CUDA toolkit at run time: the NVIDIA runtime mounts libcuda.so.1 into the container.

# CUDA headers (cuda.h for the Driver API types) and nvJitLink (PTX -> cubin for EmitPtx).
ARG CUDA_IMAGE=nvidia/cuda:13.0.0-devel-ubuntu24.04
FROM ${CUDA_IMAGE} AS cuda

# Build: Debian 12 plus the same script the README runs, so the two cannot drift.
FROM debian:12 AS build
COPY --from=cuda /usr/local/cuda/include /usr/local/cuda/include
WORKDIR /src
COPY . .
# No tests, benchmarks or Python package here, so not their tools either (torch, clang, gtest).
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends ca-certificates \
 && NORMGRAD_DEPS_EXCLUDE="python3-torch python3-dev pybind11-dev python3-numpy python3-yaml clang-14 libclang-rt-14-dev libgtest-dev libgmock-dev libbenchmark-dev libdnnl-dev" \
    BUILD_DIR=/src/build BUILD_TYPE=Release bash scripts/dev.sh build -DNORMGRAD_BUILD_TESTS=OFF \
    -DNORMGRAD_BUILD_BENCHMARKS=OFF -DNORMGRAD_BUILD_PYTHON=OFF \
 && mkdir -p /out/bin \
 && cp build/bin/normgrad-server build/bin/normgrad build/bin/normgrad-load build/bin/normgrad-ptx /out/bin/

# Runtime: only the binaries and the shared libraries they link (deploy/runtime-packages.txt).
FROM debian:12-slim AS runtime
COPY deploy/runtime-packages.txt /tmp/runtime-packages.txt
RUN apt-get update -qq \
 && grep -v '^#' /tmp/runtime-packages.txt | xargs apt-get install -y -qq --no-install-recommends \
 && rm -rf /var/lib/apt/lists/* /tmp/runtime-packages.txt \
 && groupadd --gid 10001 normgrad && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin normgrad
COPY --from=build /out/bin/ /usr/local/bin/
# nvJitLink once: naming the SONAME copies the file it points at (a glob would also copy the
# versioned file it links to, a second ~99 MB). /usr/local/lib is in the loader's search path
# after ldconfig, so `--nvjitlink` is not needed: any args (Kubernetes replaces the CMD) find it.
COPY --from=cuda /usr/local/cuda/lib64/libnvJitLink.so.13 /usr/local/lib/
RUN ldconfig && ldconfig -p | grep -q 'libnvJitLink.so.13 .*/usr/local/lib/libnvJitLink.so.13'
ENV NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute
# Two malloc arenas: resident memory tracks what is in use (30-minute soak: 69-98 MiB against
# 106-198 MiB with glibc's default, throughput not lower; docs/testing.md).
ENV MALLOC_ARENA_MAX=2
USER 10001:10001
EXPOSE 50051 9464
# The probe's flags come from NORMGRAD_HEALTH_ARGS when set: a TLS server is probed on its
# plaintext --health-listen port (-e NORMGRAD_HEALTH_ARGS=--target=127.0.0.1:50052) or over TLS
# (--target=... --tls-ca FILE); docs/operations.md, "Running the image".
# SIGTERM starts the drain (docs/operations.md, "Shutdown"); give it --stop-timeout 35.
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
  CMD ["sh", "-c", "exec normgrad health ${NORMGRAD_HEALTH_ARGS:---target=127.0.0.1:50051}"]
ENTRYPOINT ["normgrad-server"]
CMD ["--listen=0.0.0.0:50051", "--metrics-listen=0.0.0.0:9464", "--backend=auto"]
