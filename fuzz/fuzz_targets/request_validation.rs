//! libFuzzer entry point for [`dedupd_fuzz::request_validation`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    dedupd_fuzz::request_validation(data);
});
