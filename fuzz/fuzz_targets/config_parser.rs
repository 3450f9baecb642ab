//! libFuzzer entry point for [`dedupd_fuzz::config_parser`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    dedupd_fuzz::config_parser(data);
});
