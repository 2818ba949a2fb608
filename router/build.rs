//! Generates the TF Serving messages and services from the project's own .proto files with a
//! protoc that ships inside a crate (nothing to install beside cargo).
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    std::env::set_var("PROTOC", protoc);
    // Read when the script runs, not baked in when it compiles: a build script compiled for
    // one checkout can be reused for another sharing its target directory.
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("..");
    let services = root.join("router/proto/tfserving_services.proto");
    println!("cargo:rerun-if-changed={}", services.display());
    for name in ["serving.proto", "tensorflow.proto"] {
        println!(
            "cargo:rerun-if-changed={}",
            root.join("mpspool/protos").join(name).display()
        );
    }
    tonic_prost_build::configure()
        .build_client(false)
        // prost's codec with each request's decoded size checked first (src/decode_budget.rs).
        .codec_path("crate::decode_budget::BudgetedCodec")
        .bytes(".")
        .compile_protos(&[services], &[root])?;
    Ok(())
}
