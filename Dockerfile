# syntax=docker/dockerfile:1
# The relay image: built in the Rust image (the toolchain pinned in rust-toolchain.toml, dependencies
# exactly as in Cargo.lock), run on a slim Debian as an unprivileged user. Used by docker-compose.yml.

FROM rust:1.95-bookworm AS build
WORKDIR /src
# The history is not in the build context (.dockerignore): pass the commit for `--version`,
# e.g. docker build --build-arg OUTBOX_RELAY_COMMIT=$(git rev-parse --short=12 HEAD) .
ARG OUTBOX_RELAY_COMMIT=unknown
COPY . .
# Cache mounts keep the registry and target dir between builds; the binary is copied out of the
# (unpersisted) target mount in the same step. The release profile (Cargo.toml) strips debug info and
# symbols, so target/release/outbox-relay is the small binary users ship; a profile with symbols for
# profiling is `--profile profiling` (target/profiling/), never the image's.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin outbox-relay \
    && cp target/release/outbox-relay /usr/local/bin/outbox-relay

FROM debian:bookworm-slim
# ca-certificates for TLS to managed NATS (tls://); for Postgres, sslrootcert=system uses the roots
# bundled in the binary, and verify-ca/verify-full take a CA file mounted into the container.
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --no-create-home --shell /usr/sbin/nologin relay
COPY --from=build /usr/local/bin/outbox-relay /usr/local/bin/outbox-relay
USER relay
# /metrics, /healthz, /readyz
EXPOSE 9187
ENTRYPOINT ["outbox-relay"]
CMD ["run"]
