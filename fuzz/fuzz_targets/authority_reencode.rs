//! The `authority_reencode` target; the check (and its contract) is `h2_authority::fuzzing::check_authority_reencode`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| h2_authority::fuzzing::check_authority_reencode(data));
