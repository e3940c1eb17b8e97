//! Generated Rust types, gRPC clients and servers for the `machinedriver.v1` protocol.
//!
//! The `.proto` files in this crate's folder are the single source of truth for the protocol;
//! `build.rs` compiles them with `protox`, so no system `protoc` is needed. Most users want
//! `driver-sdk`, which builds on this crate; it is separate so that tools (and the bare-tonic
//! benchmark) can use the wire types without the SDK.

#![allow(missing_docs, unreachable_pub)]

/// The `machinedriver.v1` package.
pub mod v1 {
    tonic::include_proto!("machinedriver.v1");

    impl std::fmt::Debug for Secrets {
        /// Prints the keys only: secret values never reach logs or debug output.
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            let mut keys: Vec<&String> = self.data.keys().collect();
            keys.sort();
            f.debug_struct("Secrets").field("keys", &keys).field("values", &"<redacted>").finish()
        }
    }
}

/// Encoded `FileDescriptorSet` of the protocol and everything it imports (for reflection).
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/machinedriver_descriptor.bin"));

/// The full names of the protocol's gRPC services.
pub const SERVICE_NAMES: [&str; 4] =
    ["machinedriver.v1.Identity", "machinedriver.v1.Machines", "machinedriver.v1.Pools", "machinedriver.v1.Operations"];

#[cfg(test)]
mod tests {
    use super::v1::Secrets;

    #[test]
    fn secrets_debug_hides_values() {
        let s = Secrets { data: [("token".to_string(), "hunter2".to_string())].into() };
        let printed = format!("{s:?}");
        assert!(printed.contains("token"), "{printed}");
        assert!(!printed.contains("hunter2"), "{printed}");
    }
}
