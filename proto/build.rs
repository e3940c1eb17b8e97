//! Compiles `machinedriver/v1/*.proto` with protox (pure Rust, no system `protoc`).

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let proto = root.join("machinedriver/v1/driver.proto");
    let mut compiler = protox::Compiler::new([root.clone()])?;
    compiler.include_imports(true).include_source_info(true);
    compiler.open_file(&proto)?;
    let fds = compiler.file_descriptor_set();
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    // The encoded set (with imports) serves reflection, so grpcurl can resolve every type.
    std::fs::write(out.join("machinedriver_descriptor.bin"), compiler.encode_file_descriptor_set())?;
    tonic_prost_build::configure()
        .extern_path(".google.rpc", "::tonic_types::pb")
        // Secrets get a hand-written, redacting Debug (lib.rs).
        .skip_debug(["machinedriver.v1.Secrets"])
        .compile_fds(fds)?;
    println!("cargo:rerun-if-changed=machinedriver");
    println!("cargo:rerun-if-changed=google");
    Ok(())
}
