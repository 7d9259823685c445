//! The transfer-queue controller: metadata only.
//!
//! It knows which (sample, field) pairs exist, which storage unit holds each sample, sequence
//! lengths and tags — never the bytes. [`Controller`] is the plain state machine (deterministic,
//! clock passed in; module `state`); [`TqController`] wraps it for the coordinator (module
//! `server`): shared, served over TCP on the plan's `tq_controller` port, clearing partitions in
//! every storage unit, and watching the units so that a dead one marks its partitions lost.
//!
//! Claims: [`Controller::claim`] hands out ready samples (those having every required field),
//! each exactly once per consumer group, under a lease. A claim not acknowledged before its lease
//! expires (the consumer died) is claimable again; nothing is lost.

mod server;
mod state;

pub(crate) use server::connect_unit;
pub use server::{ClearReport, ControllerConfig, TqController};
pub use state::{AckReport, Claim, Controller, ControllerError, GroupStatus, MAX_FIELDS, PartitionStatus};
