//! The `hpack_decode` target; the check (and its contract) is `h2_authority::fuzzing::check_hpack_decode`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| h2_authority::fuzzing::check_hpack_decode(data));
