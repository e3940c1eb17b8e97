# aws-ec2-driver — build from the workspace root:
#   docker build -f deploy/docker/aws-ec2-driver.Dockerfile -t machine-driver/aws-ec2-driver:0.1.0 .
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --profile dist --locked -p aws-ec2-driver --bin aws-ec2-driver

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/dist/aws-ec2-driver /usr/local/bin/aws-ec2-driver
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/aws-ec2-driver"]
