//! Generates the gRPC code from `ferrolog/**/*.proto` with protox, a pure
//! Rust protobuf compiler, so no system `protoc` is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = [
        "ferrolog/raft/v1/raft.proto",
        "ferrolog/client/v1/client.proto",
        "ferrolog/groups/v1/offsets.proto",
    ];
    for p in protos {
        println!("cargo:rerun-if-changed={p}");
    }
    let fds = protox::compile(protos, ["."])?;
    // `bytes` fields decode as `bytes::Bytes` slices of the received buffer,
    // so keys, values and Raft entries are not copied out of the request.
    tonic_prost_build::configure().bytes(".").compile_fds(fds)?;
    Ok(())
}
