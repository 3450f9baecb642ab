//! Compiles `proto/dedup/v1/dedup.proto` in pure Rust (protox), so building
//! dedupd needs no system `protoc`. The encoded descriptor set is kept for
//! gRPC server reflection.

use std::{env, fs, io, path::PathBuf};

use prost::Message;

fn main() -> io::Result<()> {
    let proto = "proto/dedup/v1/dedup.proto";
    println!("cargo:rerun-if-changed={proto}");

    let descriptors = protox::compile([proto], ["proto"]).map_err(io::Error::other)?;
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    fs::write(
        out_dir.join("dedup_descriptor.bin"),
        descriptors.encode_to_vec(),
    )?;

    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(descriptors)
}
