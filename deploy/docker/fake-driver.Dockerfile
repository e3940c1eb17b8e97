# fake-driver — build from the workspace root:
#   docker build -f deploy/docker/fake-driver.Dockerfile -t machine-driver/fake-driver:0.1.0 .
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --profile dist --locked -p fake-driver --bin fake-driver

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/dist/fake-driver /usr/local/bin/fake-driver
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/fake-driver"]
