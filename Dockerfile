# syntax=docker/dockerfile:1.7
#
# rlplane's images, built from one multi-stage file:
#
#   docker build --target worker   -t ghcr.io/rlplane/rlplane-worker:0.1.0 .
#   docker build --target operator -t ghcr.io/rlplane/rlplane-operator:0.1.0 .
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
#
# Both run as the non-root user 65532. Builds are --locked: Cargo.lock is the source of truth.

ARG RUST_VERSION=1.95
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-base-ubuntu24.04
ARG OPERATOR_BASE=gcr.io/distroless/cc-debian12:nonroot

FROM rust:${RUST_VERSION}-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,id=rlplane-cargo-registry,target=/usr/local/cargo/registry \
    --mount=type=cache,id=rlplane-target,target=/src/target \
    cargo build --release --locked \
        -p rlplane --bin rlplane \
        -p rlplane-operator --bin rlplane-operator \
    && install -D -m 0755 target/release/rlplane /out/rlplane \
    && install -D -m 0755 target/release/rlplane-operator /out/rlplane-operator

# NCCL for the worker: the library of pip's wheel, without Python in the final image.
FROM python:3.12-slim-bookworm AS nccl
ARG NCCL_VERSION=2.28.9
RUN pip install --no-cache-dir --disable-pip-version-check --target /opt/pip "nvidia-nccl-cu13==${NCCL_VERSION}" \
    && install -D -m 0644 /opt/pip/nvidia/nccl/lib/libnccl.so.2 /opt/nccl/lib/libnccl.so.2

FROM ${CUDA_IMAGE} AS worker
LABEL org.opencontainers.image.title="rlplane-worker" \
      org.opencontainers.image.description="rlplane worker: refit, transfer queue and coordinator of RLJob pods" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=nccl /opt/nccl /opt/nccl
COPY --from=build /out/rlplane /usr/local/bin/rlplane
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
COPY --from=build /out/rlplane-operator /usr/local/bin/rlplane-operator
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/rlplane-operator"]
CMD ["run"]
