//! The `token_open` target; the check (and its contract) is `driver_sdk_core::fuzzing::check_token_open`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| driver_sdk_core::fuzzing::check_token_open(data));
