//! Benchmarks: `rlplane bench refit`, `tq`, `control`, `schedule`, and the refit link model `layout`. Each runs its peers as separate
//! processes on loopback and prints ratios against a reference measured in the same run.

pub mod control;
pub mod gpu;
pub mod layout;
pub mod refit;
pub mod schedule;
pub mod tq;

use clap::Subcommand;

/// `rlplane bench ...`
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Refit bandwidth against a raw stream of the same bytes.
    Refit(refit::Args),
    /// Transfer-queue throughput and latency against a raw stream of the same bytes.
    Tq(tq::Args),
    /// Control-plane dispatch latency against a raw TCP ping-pong between the same processes.
    Control(control::Args),
    /// What a manifest's refit makes every GPU's links carry, and the refit time that predicts.
    Layout(layout::Args),
    /// Steps per second of a job under the synchronous schedule and asynchronous ones, in one run.
    Schedule(schedule::Args),
}

/// Hidden entry points of the processes a benchmark or test spawns.
#[derive(Debug, Subcommand)]
pub enum PeerCommand {
    /// A refit peer process.
    Refit(refit::PeerArgs),
    /// A transfer-queue peer process.
    Tq(tq::PeerArgs),
    /// A GPU refit peer process.
    Gpu(gpu::PeerArgs),
    /// A control-plane peer process.
    Control(control::PeerArgs),
}

/// Runs a benchmark.
pub fn run(cmd: BenchCommand) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::Refit(a) => refit::run(a),
        BenchCommand::Tq(a) => tq::run(a),
        BenchCommand::Control(a) => control::run(a),
        BenchCommand::Layout(a) => layout::run(a),
        BenchCommand::Schedule(a) => schedule::run(a),
    }
}

/// Runs a peer process.
pub fn run_peer(cmd: PeerCommand) -> anyhow::Result<()> {
    match cmd {
        PeerCommand::Refit(a) => refit::run_peer(a),
        PeerCommand::Tq(a) => tq::run_peer(a),
        PeerCommand::Gpu(a) => gpu::run_peer(a),
        PeerCommand::Control(a) => control::run_peer(a),
    }
}
