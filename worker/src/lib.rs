//! The rlplane worker: refit sender/receiver, transfer-queue storage and clients, the step
//! coordinator, and the local runner that runs a whole RLJob on one machine.
//!
//! One module per concern; plain data in between; no global state.

pub mod bench;
pub mod control;
pub mod coordinator;
pub mod digest;
pub mod gpu;
pub mod hot_wait;
pub mod link;
pub mod local;
pub mod metrics;
pub mod net;
pub mod patience;
pub mod pod;
pub mod proc;
pub mod refit;
pub mod roles;
pub mod shm;
pub mod sidecar;
pub mod status;
pub mod supervisor;
pub mod telemetry;
pub mod tq;
pub mod transport;
pub mod workload;
