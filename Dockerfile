# syntax=docker/dockerfile:1
# dedupd: a small, non-root image. The build stage runs exactly the build CI
# runs (`cargo build --release --locked -p dedupd`, toolchain pinned in
# rust-toolchain.toml), so the binary in the image is the one CI tested. The
# image carries only the sidecar: the benchmark tool is not built into it.

FROM rust:1.95.0-slim-bookworm AS build
# jemalloc (the allocator) is built from C sources with make, which the slim
# image lacks.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends make \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# BuildKit cache mounts keep the crate registry and the target directory
# between builds, so a source change recompiles dedupd, not its dependencies.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/usr/local/cargo/git \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p dedupd \
 && install -D -m 0755 target/release/dedupd /out/dedupd \
 && mkdir -p /out/data

# distroless: glibc and CA certificates, no shell, no package manager.
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /out/dedupd /usr/local/bin/dedupd
COPY --from=build --chown=65532:65532 /out/data /var/lib/dedupd
USER 65532:65532
# The root filesystem can be read-only: dedupd writes only to its data dir.
VOLUME ["/var/lib/dedupd"]
# The sidecar shape: gRPC on the pod's loopback only (no credentials needed;
# add a unix:// socket for the app, or a token or mTLS before listening
# beyond loopback: dedupd refuses that otherwise). The ops port serves
# /readyz and /healthz to the kubelet, which probes the pod IP.
ENV DEDUPD_DATA_DIR=/var/lib/dedupd \
    DEDUPD_LISTEN=127.0.0.1:50051 \
    DEDUPD_METRICS_LISTEN=0.0.0.0:9090 \
    DEDUPD_LOG_FORMAT=json
EXPOSE 9090
# /readyz is plain HTTP whatever TLS the gRPC port speaks.
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
  CMD ["/usr/local/bin/dedupd", "health", "--readyz", "127.0.0.1:9090"]
ENTRYPOINT ["/usr/local/bin/dedupd"]
