//! The generated protobuf and gRPC code of `proto/dedup/v1/dedup.proto`.

#![allow(
    missing_docs,
    clippy::all,
    clippy::pedantic,
    missing_debug_implementations
)]

/// Package `dedup.v1`.
pub mod v1 {
    tonic::include_proto!("dedup.v1");
}

/// The encoded `FileDescriptorSet` of the API, served by gRPC reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/dedup_descriptor.bin"));
