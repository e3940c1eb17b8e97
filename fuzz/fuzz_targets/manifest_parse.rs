//! The `manifest_parse` target; the check (and its contract) is
//! `machine_api::fuzzing::check_manifest_parse`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| machine_api::fuzzing::check_manifest_parse(data));
