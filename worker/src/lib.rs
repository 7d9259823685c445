//! The rlplane worker process: roles, the sidecar's local API, the coordinator, control, the pod
//! and local runners, the supervisor, metrics, status and telemetry.
//!
//! One module per concern; plain data in between; no global state. The libraries it runs on are
//! crates of their own, below it: `rlplane-wire` (sockets, framing, handshake, key files, links,
//! shared memory, child processes), `rlplane-tq` (the transfer queue) and `rlplane-refit` (plan,
//! memory, GPU access, transports, the streaming engine). They are re-exported here under the
//! names the process layer and the tests use (`rlplane::refit::plan`, `rlplane::net`, …); none of
//! them can import anything from this crate.

#[cfg(feature = "bench")]
pub mod bench;
pub mod control;
pub mod coordinator;
pub mod local;
pub mod metrics;
pub mod pod;
pub mod reservoir;
pub mod roles;
pub mod sidecar;
pub mod status;
pub mod supervisor;
pub mod telemetry;
pub mod workload;

pub use rlplane_refit as refit;
pub use rlplane_refit::{digest, gpu, transport};
pub use rlplane_tq as tq;
pub use rlplane_wire::{hot_wait, link, net, patience, proc, shm};
