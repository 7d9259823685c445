//! `rlplane`: the binary in every pod and the local runner.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "rlplane", version, about = "rlplane: the data plane for RL post-training (refit and transfer queue)")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a whole RLJob on this machine: every rank as a process, the coordinator here.
    Local(rlplane::local::LocalArgs),
    /// A pod's entry point: run the ranks of this pod from the job's plan.
    Worker(rlplane::pod::WorkerArgs),
    /// Check an RLJob manifest: print every problem, exit 2 if there is one.
    Validate {
        /// The manifest (YAML).
        manifest: std::path::PathBuf,
    },
    /// Benchmarks (refit, transfer queue).
    #[cfg(feature = "bench")]
    #[command(subcommand)]
    Bench(rlplane::bench::BenchCommand),
    /// Internal: a peer process spawned by a benchmark or test.
    #[cfg(feature = "bench")]
    #[command(subcommand, hide = true)]
    Peer(rlplane::bench::PeerCommand),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Logs and traces (exported when the plan, the manifest or OTEL_EXPORTER_OTLP_ENDPOINT names a
    // collector); flushed when `_telemetry` drops, after the command returns.
    let settings = match &cli.command {
        Command::Local(a) => rlplane::telemetry::Settings::for_manifest(&a.manifest),
        Command::Worker(a) => rlplane::telemetry::Settings::for_plan(&a.plan, a.process.as_deref()),
        _ => rlplane::telemetry::Settings::from_env("rlplane"),
    };
    let _telemetry = rlplane::telemetry::init(&settings);
    match cli.command {
        Command::Local(a) => rlplane::local::main(a),
        Command::Worker(a) => rlplane::pod::main(a),
        Command::Validate { manifest } => validate(&manifest),
        #[cfg(feature = "bench")]
        Command::Bench(c) => exit_code(rlplane::bench::run(c)),
        #[cfg(feature = "bench")]
        Command::Peer(c) => exit_code(rlplane::bench::run_peer(c)),
    }
}

/// A benchmark's outcome as the process's exit code, its error printed.
#[cfg(feature = "bench")]
fn exit_code(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn validate(path: &std::path::Path) -> ExitCode {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: cannot read {}: {e}", path.display());
            return ExitCode::from(2);
        }
    };
    match rlplane_api::load_rljob(&text) {
        Ok(job) => {
            println!("{}: valid RLJob `{}`", path.display(), job.metadata.name.unwrap_or_default());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {} is not a valid RLJob:", path.display());
            for line in &e.0 {
                eprintln!("  - {line}");
            }
            ExitCode::from(2)
        }
    }
}
