//! Compiles the fake cloud's inspection API with protox (no system `protoc`).

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("proto");
    let mut compiler = protox::Compiler::new([root.clone()])?;
    compiler.include_imports(true).include_source_info(true);
    compiler.open_file(root.join("fakecloud/v1/fakecloud.proto"))?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out.join("fakecloud_descriptor.bin"), compiler.encode_file_descriptor_set())?;
    tonic_prost_build::configure().compile_fds(compiler.file_descriptor_set())?;
    println!("cargo:rerun-if-changed=proto");
    Ok(())
}
