# Multi-stage build of the streamrl binary (one file: it is also the sandboxes' init).
# Build: docker build -t streamrl .
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p streamrl --bin streamrl

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates zlib1g python3 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/streamrl /usr/local/bin/streamrl
COPY topology.yaml /app/topology.yaml
WORKDIR /app
ENTRYPOINT ["streamrl"]
CMD ["run"]
