# syntax=docker/dockerfile:1
# mbtunnel node proxy image: `make image` (IMAGE=mbtunnel:0.1.0 by default).
# tests/deploy.rs checks this file: the build stage installs through scripts/deps.sh, the two
# stages share a Debian release, and EXPOSE lists the binary's default listener ports.

# Build stage: the Rust toolchain on Debian 12, the same packages `make` installs, and the `dist`
# profile (release with fat LTO and one codegen unit: 5–9 % less proxy CPU per byte and per request
# than `release`, measured in benches/README.md).
ARG RUST_VERSION=1.95
FROM rust:${RUST_VERSION}-bookworm AS build
WORKDIR /src
# System packages come from scripts/deps.sh, the project's one list (cmake, clang, … for BoringSSL).
COPY scripts/deps.sh scripts/deps.sh
RUN ./scripts/deps.sh && rm -rf /var/lib/apt/lists/*
COPY . .
# The revision the image is built from, shown in /config_dump's `version.gitRevision`
# (`make image` passes `git rev-parse HEAD`).
ARG MBTUNNEL_GIT_REVISION=unknown
ENV MBTUNNEL_GIT_REVISION=${MBTUNNEL_GIT_REVISION}
# Cargo's registry and target directory are BuildKit caches, so a rebuild after a source change
# does not rebuild BoringSSL. The binary is copied out of the cache; its debug info is stripped
# (symbol names stay, so backtraces still name functions).
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --profile dist --locked \
    && cp target/dist/mbtunnel /usr/local/bin/mbtunnel \
    && strip --strip-debug /usr/local/bin/mbtunnel

# Runtime stage: Debian 12 slim (the glibc the binary was linked against; the C++ runtime BoringSSL
# needs is linked in statically, see .cargo/config.toml), the binary
# and nothing else: no compiler, no package lists. No ca-certificates either: the proxy trusts only
# the mesh root it is given, never the system store.
FROM debian:bookworm-slim AS runtime
COPY --from=build /usr/local/bin/mbtunnel /usr/local/bin/mbtunnel
# outbound, inbound plaintext, inbound HBONE, metrics, readiness (admin stays on 127.0.0.1:15000).
EXPOSE 15001 15006 15008 15020 15021
# Runs as root on purpose. The redirect modes need NET_ADMIN (IP_TRANSPARENT, SO_MARK, iptables in
# pod namespaces), NET_RAW and, for in-pod and eBPF, SYS_ADMIN. A container runtime grants added
# capabilities to a root process only: Kubernetes has no ambient capabilities for other users, and
# file capabilities on the binary would make it fail to start wherever a capability is dropped.
# deploy/daemonset.yaml drops every other capability and makes the root filesystem read-only.
ENTRYPOINT ["/usr/local/bin/mbtunnel"]
CMD ["run"]
