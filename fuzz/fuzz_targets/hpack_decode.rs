//! The `hpack_decode` target; the check (and its contract) is `driver_sdk::fuzzing::check_hpack_decode`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| driver_sdk::fuzzing::check_hpack_decode(data));
