//! Generated protobuf messages and services (build.rs), nested as their packages are so
//! that the generated code's relative paths resolve.
#![allow(clippy::all, clippy::pedantic)]

pub mod mpspool {
    // The .proto files also describe messages only the Python side reads (the checkpoint
    // index and object graph the weight publisher parses).
    #[allow(dead_code)]
    pub mod tfs {
        tonic::include_proto!("mpspool.tfs");
    }
}

pub mod tensorflow {
    pub mod serving {
        tonic::include_proto!("tensorflow.serving");
    }
}
