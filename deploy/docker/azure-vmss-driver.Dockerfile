# azure-vmss-driver — build from the workspace root:
#   docker build -f deploy/docker/azure-vmss-driver.Dockerfile -t machine-driver/azure-vmss-driver:0.1.0 .
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --profile dist --locked -p azure-vmss-driver --bin azure-vmss-driver

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/dist/azure-vmss-driver /usr/local/bin/azure-vmss-driver
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/azure-vmss-driver"]
