# syntax=docker/dockerfile:1
# dedupd: a small, non-root image. The build stage runs exactly the build CI
# runs (`cargo build --release --locked` with the toolchain pinned in
# rust-toolchain.toml), so the binary in the image is the one CI tested.

FROM rust:1.95.0-slim-bookworm AS build
WORKDIR /src
# Dependencies first, so source changes do not refetch them.
COPY Cargo.toml Cargo.lock rust-toolchain.toml build.rs ./
COPY proto ./proto
COPY src ./src
COPY benches ./benches
RUN cargo build --release --locked \
 && install -D -m 0755 target/release/dedupd /out/dedupd \
 && mkdir -p /out/data

# distroless: glibc and CA certificates, no shell, no package manager.
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /out/dedupd /usr/local/bin/dedupd
COPY --from=build --chown=65532:65532 /out/data /var/lib/dedupd
USER 65532:65532
# The root filesystem can be read-only: dedupd writes only to its data dir.
VOLUME ["/var/lib/dedupd"]
ENV DEDUPD_DATA_DIR=/var/lib/dedupd \
    DEDUPD_LISTEN=0.0.0.0:50051 \
    DEDUPD_METRICS_LISTEN=0.0.0.0:9090 \
    DEDUPD_LOG_FORMAT=json
EXPOSE 50051 9090
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
  CMD ["/usr/local/bin/dedupd", "health", "--addr", "127.0.0.1:50051"]
ENTRYPOINT ["/usr/local/bin/dedupd"]
