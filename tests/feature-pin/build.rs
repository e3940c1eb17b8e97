//! Empty: present so that the build-dependencies (pins of the compiler's side: build scripts
//! and proc-macros) are resolved.
fn main() {}
