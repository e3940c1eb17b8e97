//! The `provider_spec_validate` target; the check (and its contract) is `driver_sdk_core::fuzzing::check_provider_spec_validate`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| driver_sdk_core::fuzzing::check_provider_spec_validate(data));
