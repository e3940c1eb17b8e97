//! Compiles the cluster-autoscaler's `externalgrpc.proto` (release 1.36.1, unchanged) with protox
//! (pure Rust, no system `protoc`); its google/protobuf imports are protox's own.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("protos");
    let mut compiler = protox::Compiler::new([root.clone()])?;
    compiler.include_imports(true).include_source_info(true);
    compiler.open_file(root.join("externalgrpc.proto"))?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    // The encoded set serves reflection, so grpcurl can call the server by hand.
    std::fs::write(out.join("externalgrpc_descriptor.bin"), compiler.encode_file_descriptor_set())?;
    tonic_prost_build::configure().build_client(true).compile_fds(compiler.file_descriptor_set())?;
    println!("cargo:rerun-if-changed=protos");
    Ok(())
}
