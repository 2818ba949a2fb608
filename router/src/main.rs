//! mpspool's front door (work in progress: the modules below are being written).
#![allow(dead_code)]
mod codec;
mod config;
mod control;
mod dispatch;
mod grpc;
mod log;
mod metrics;
mod proto;
mod server;
mod signature;
mod state;
mod status;
mod timeline;
mod wire;
mod workers;

fn main() {}
