//! `rlplane bench tq`.

/// Arguments of `rlplane bench tq`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Arguments of a tq peer process.
#[derive(Debug, clap::Args)]
pub struct PeerArgs {}

/// Runs the benchmark.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("rlplane bench tq is not built yet")
}

/// Runs a peer process.
pub fn run_peer(_args: PeerArgs) -> anyhow::Result<()> {
    anyhow::bail!("rlplane tq peer is not built yet")
}
