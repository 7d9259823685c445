//! The transfer queue: metadata-only controller, storage units, clients and the wire codec.
//!
//! Rollouts flow from the generation ranks to the trainer's data-parallel shards; the coordinator
//! sees only metadata and bulk bytes never pass through it.
//!
//! - [`controller`]: which (sample, field) pairs exist and where; claims under leases; clear;
//!   lost storage units. Runs inside the coordinator ([`controller::TqController`]).
//! - [`storage`]: bulk columns in memory with a capacity and backpressure; with placement
//!   ProducerLocal a unit lives in the producer's own process (one hop to the consumer).
//! - [`client`]: put / claim / get / ack / write-back / clear ([`client::TqClient`]).
//! - [`fanout`]: a data-parallel leader fetches its shard's batch and fans it out to followers.
//! - [`assign`]: token-balanced assignment of a step's samples to data-parallel shards.
//! - [`version`]: the policy version each sample carries, and its lag behind the step training it.
//! - [`codec`] and [`column`]: the wire format and the data model (`docs/transfer-queue.md`).

pub mod assign;
pub mod client;
pub mod codec;
pub mod column;
pub mod controller;
pub mod fanout;
pub mod storage;
pub mod version;

pub use assign::{Assignment, assign};
pub use client::{ClientConfig, PutOptions, PutReport, TqClient, WriteRole};
pub use column::{
    ABSENT, Batch, BatchMeta, BatchMetaBuilder, Column, DType, Element, FieldSpec, MetaError, SampleKey, SampleRef,
    SampleTags,
};
pub use controller::{Claim, ControllerConfig, TqController};
pub use storage::{StorageServer, StorageUnit};

use codec::ErrorCode;
use rlplane_wire::net::NetError;

/// Errors of transfer-queue clients. Each names the peer, partition, field or key involved, and
/// what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum TqError {
    /// Connecting, handshaking or talking to a peer failed (includes a refused job token).
    #[error(transparent)]
    Net(#[from] NetError),
    /// The controller refused a request.
    #[error("transfer-queue controller: {message}")]
    Controller {
        /// Error code.
        code: ErrorCode,
        /// Its reason.
        message: String,
    },
    /// A storage unit refused a request.
    #[error("{message} (storage unit {unit} at {addr})")]
    Storage {
        /// Unit.
        unit: u32,
        /// Its address.
        addr: String,
        /// Error code.
        code: ErrorCode,
        /// Its reason.
        message: String,
    },
    /// A storage unit holding samples could not be reached: it died. The controller has been
    /// told, and marks the partitions with samples on it lost.
    #[error(
        "storage unit {unit} at {addr} is unreachable while fetching partition `{partition}`: {reason}; \
         the partition is lost (clear it and generate the step again)"
    )]
    StorageUnitLost {
        /// Unit.
        unit: u32,
        /// Its address.
        addr: String,
        /// Partition being read.
        partition: String,
        /// What was seen.
        reason: String,
    },
    /// A data-parallel follower tried to write back; only the shard's leader writes.
    #[error(
        "{process} is a data-parallel follower and may not write back (field `{field}`): only the shard's leader \
         {leader} writes, so that the field is written once"
    )]
    FollowerWriteBack {
        /// The follower.
        process: String,
        /// Its leader.
        leader: String,
        /// Field it tried to write.
        field: String,
    },
    /// Bad input from the caller.
    #[error("{what}; {fix}")]
    Input {
        /// What is wrong.
        what: String,
        /// How to fix it.
        fix: String,
    },
    /// A peer answered something this client did not ask for, or data disagreeing with metadata.
    #[error("peer {peer} sent {what}")]
    Protocol {
        /// Peer.
        peer: String,
        /// What.
        what: String,
    },
}

impl TqError {
    /// The error code a controller or storage unit replied with, if any.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            TqError::Controller { code, .. } | TqError::Storage { code, .. } => Some(*code),
            _ => None,
        }
    }

    fn input(what: impl Into<String>, fix: impl Into<String>) -> TqError {
        TqError::Input { what: what.into(), fix: fix.into() }
    }
}
