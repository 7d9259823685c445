//! `rlplane bench refit`.

/// Arguments of `rlplane bench refit`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Arguments of a refit peer process.
#[derive(Debug, clap::Args)]
pub struct PeerArgs {}

/// Runs the benchmark.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("rlplane bench refit is not built yet")
}

/// Runs a peer process.
pub fn run_peer(_args: PeerArgs) -> anyhow::Result<()> {
    anyhow::bail!("rlplane refit peer is not built yet")
}
