//! libFuzzer entry point for [`dedupd_fuzz::record_codec`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    dedupd_fuzz::record_codec(data);
});
