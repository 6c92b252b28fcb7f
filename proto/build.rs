//! Generates the gRPC code from `ferrolog/**/*.proto` with protox, a pure
//! Rust protobuf compiler, so no system `protoc` is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = ["ferrolog/raft/v1/raft.proto", "ferrolog/client/v1/client.proto"];
    for p in protos {
        println!("cargo:rerun-if-changed={p}");
    }
    let fds = protox::compile(protos, ["."])?;
    tonic_prost_build::configure().compile_fds(fds)?;
    Ok(())
}
