//! Process groups for fsdp-rs. This crate starts with the launch environment: how a worker
//! learns its rank, world size and rendezvous address from its launcher.

pub mod world;

pub use world::{Launcher, WorldError, WorldInfo};
