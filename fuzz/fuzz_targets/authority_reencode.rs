//! The `authority_reencode` target; the check (and its contract) is `driver_sdk::fuzzing::check_authority_reencode`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| driver_sdk::fuzzing::check_authority_reencode(data));
