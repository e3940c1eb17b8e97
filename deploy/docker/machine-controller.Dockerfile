# machine-controller — build from the workspace root:
#   docker build -f deploy/docker/machine-controller.Dockerfile -t machine-driver/machine-controller:0.1.0 .
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --profile dist --locked -p machine-controller --bin machine-controller

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/dist/machine-controller /usr/local/bin/machine-controller
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/machine-controller"]
