# syntax=docker/dockerfile:1.7
#
# rlplane's images, built from one multi-stage file:
#
#   docker build --target worker   -t ghcr.io/rlplane/rlplane-worker:0.1.0 .
#   docker build --target operator -t ghcr.io/rlplane/rlplane-operator:0.1.0 .
#   docker build --target client   -t rlplane-python-client .
#
# worker   - `rlplane`, the binary of every RLJob pod, on a CUDA base image. CUDA and NCCL are
#            loaded at run time (the build needs neither):
#              * libcuda.so.1 is the node's driver, mounted into the container by the NVIDIA
#                container toolkit (or the GPU operator) when the pod requests nvidia.com/gpu;
#              * libnccl.so.2 comes from pip's nvidia-nccl-cu13 wheel, unpacked into /opt/nccl;
#                RLPLANE_NCCL_LIBRARY points the worker at it (the worker otherwise asks python3
#                for pip's nvidia.nccl package, and else uses the system's libnccl.so).
#            CPU-only jobs (spec.device: Cpu) run on the same image without a GPU.
# operator - `rlplane-operator` on a distroless base (rustls: no OpenSSL, only libc).
# client   - Python 3 with numpy and this repository's Python client (`import rlplane`): a base for
#            a job's trainer and engine containers, which talk to the worker sidecar.
#
# All three run as the non-root user 65532. Builds are --locked: Cargo.lock is the source of truth.
#
# Build arguments for builds without a registry or a compiler in the image (e2e/cluster/images
# builds this way with buildah, on base images it makes from the host's own files):
#   BINARIES=prebuilt     take rlplane and rlplane-operator from .image-bin/ in the build context
#                         instead of compiling them in the `build` stage (which needs rust:*-bookworm
#                         and a long cargo build); they must link against a glibc no newer than
#                         the base images'.
#   NCCL=no-nccl          leave NCCL out (an empty /opt/nccl) for CPU-only worker images, instead of
#                         the `nccl` stage's pip download. RLPLANE_NCCL_LIBRARY then names a missing
#                         file, which the worker ignores.
#   CUDA_IMAGE, OPERATOR_BASE, PYTHON_IMAGE   the base images. The worker's and the operator's
#                         need only glibc and libgcc_s (no user 65532: USER is numeric); the
#                         client's needs /bin/sh, python3 (>= 3.11) and numpy or pip.
# Stages the target does not use are skipped (BuildKit, and buildah's default
# --skip-unused-stages), so their base images are never pulled. buildah 1.28 (Debian 12's) resolves
# `FROM ${BINARIES}` and `FROM ${NCCL}` for that only from --build-arg, not from the defaults below,
# and so skips the stages they name by default: with it, pass them explicitly
# (--build-arg BINARIES=build --build-arg NCCL=nccl).

ARG RUST_VERSION=1.95
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-base-ubuntu24.04
ARG OPERATOR_BASE=gcr.io/distroless/cc-debian12:nonroot
ARG PYTHON_IMAGE=python:3.12-slim-bookworm
ARG BINARIES=build
ARG NCCL=nccl

FROM rust:${RUST_VERSION}-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,id=rlplane-cargo-registry,target=/usr/local/cargo/registry \
    --mount=type=cache,id=rlplane-target,target=/src/target \
    cargo build --release --locked --no-default-features \
        -p rlplane --bin rlplane \
        -p rlplane-operator --bin rlplane-operator \
    && install -D -m 0755 target/release/rlplane /out/rlplane \
    && install -D -m 0755 target/release/rlplane-operator /out/rlplane-operator

# BINARIES=prebuilt: binaries built outside, e.g. by `cargo build --release` on the host.
FROM scratch AS prebuilt
COPY .image-bin/rlplane .image-bin/rlplane-operator /out/

FROM ${BINARIES} AS binaries

# NCCL for the worker: the library of pip's wheel, without Python in the final image.
FROM python:3.12-slim-bookworm AS nccl
ARG NCCL_VERSION=2.28.9
RUN pip install --no-cache-dir --disable-pip-version-check --target /opt/pip "nvidia-nccl-cu13==${NCCL_VERSION}" \
    && install -D -m 0644 /opt/pip/nvidia/nccl/lib/libnccl.so.2 /opt/nccl/lib/libnccl.so.2

# NCCL=no-nccl: nothing (WORKDIR creates the directory that the worker stage copies).
FROM scratch AS no-nccl
WORKDIR /opt/nccl

FROM ${NCCL} AS nccl-libs

FROM ${CUDA_IMAGE} AS worker
LABEL org.opencontainers.image.title="rlplane-worker" \
      org.opencontainers.image.description="rlplane worker: refit, transfer queue and coordinator of RLJob pods" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=nccl-libs /opt/nccl /opt/nccl
COPY --from=binaries /out/rlplane /usr/local/bin/rlplane
ENV RLPLANE_NCCL_LIBRARY=/opt/nccl/lib/libnccl.so.2 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 65532:65532
# The operator's pods run `rlplane worker --plan /etc/rlplane/plan.json`.
ENTRYPOINT ["/usr/local/bin/rlplane"]
CMD ["--help"]

FROM ${OPERATOR_BASE} AS operator
LABEL org.opencontainers.image.title="rlplane-operator" \
      org.opencontainers.image.description="rlplane operator: reconciles RLJobs into gangs of pods" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=binaries /out/rlplane-operator /usr/local/bin/rlplane-operator
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/rlplane-operator"]
CMD ["run"]

# The client is copied, not pip-installed: it is pure Python, and its build backend (setuptools)
# would have to be downloaded. numpy comes from the base image where it has it (a distribution's
# python3-numpy), else from pip.
FROM ${PYTHON_IMAGE} AS client
LABEL org.opencontainers.image.title="rlplane-python-client" \
      org.opencontainers.image.description="Python 3, numpy and rlplane's client of the worker sidecar" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN --mount=type=bind,source=python/rlplane,target=/mnt/rlplane \
    set -eu; \
    python3 -c 'import numpy' 2>/dev/null \
        || pip install --no-cache-dir --disable-pip-version-check 'numpy>=1.24'; \
    site="$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"; \
    mkdir -p "$site"; \
    cp -R /mnt/rlplane "$site/rlplane"; \
    find "$site/rlplane" -name __pycache__ -prune -exec rm -rf {} +; \
    python3 -m compileall -q "$site/rlplane"; \
    python3 -c 'import numpy, rlplane'
USER 65532:65532
CMD ["python3"]
