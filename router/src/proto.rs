//! Generated protobuf messages and services (build.rs), nested as their packages are so
//! that the generated code's relative paths resolve.
#![allow(clippy::all, clippy::pedantic)]

pub mod mpspool {
    pub mod tfs {
        tonic::include_proto!("mpspool.tfs");
    }
}

pub mod tensorflow {
    pub mod serving {
        tonic::include_proto!("tensorflow.serving");
    }
}
