//! `rlplane`: the binary in every pod and the local runner.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "rlplane", version, about = "rlplane: the data plane for RL post-training")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Benchmarks (refit, transfer queue).
    #[command(subcommand)]
    Bench(rlplane::bench::BenchCommand),
    /// Internal: a peer process spawned by a benchmark or test.
    #[command(subcommand, hide = true)]
    Peer(rlplane::bench::PeerCommand),
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("RLPLANE_LOG").unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Bench(c) => rlplane::bench::run(c),
        Command::Peer(c) => rlplane::bench::run_peer(c),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
