//! `rlplane-operator`: reconciles RLJobs into running gangs (`run`, the default), and measures
//! itself against a cluster (`bench`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};
use rlplane_operator::bench::{self, BenchOptions};
use rlplane_operator::desired::OperatorConfig;
use rlplane_operator::run::{RunOptions, run};

/// The rlplane operator: reconciles RLJobs into running gangs of pods.
#[derive(Parser, Debug)]
#[command(name = "rlplane-operator", version, args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the operator (the default when no subcommand is given).
    Run(RunArgs),
    /// Time a 64-pod RLJob's objects appearing (and its pods scheduled), count the API requests
    /// per reconcile, and measure the operator's RSS with 100 RLJobs, against the cluster
    /// KUBECONFIG names (skipped when KUBECONFIG is unset).
    Bench(BenchArgs),
}

#[derive(Args, Debug, Clone)]
struct RunArgs {
    /// Worker image for roles that name none.
    #[arg(long, env = "RLPLANE_WORKER_IMAGE", default_value_t = OperatorConfig::default().worker_image)]
    worker_image: String,
    /// imagePullPolicy of the worker container (Always, IfNotPresent, Never; default: the cluster's).
    #[arg(long, env = "RLPLANE_IMAGE_PULL_POLICY")]
    image_pull_policy: Option<PullPolicy>,
    /// Watch RLJobs in this namespace only (default: every namespace).
    #[arg(long, visible_alias = "watch-namespace", env = "RLPLANE_WATCH_NAMESPACE")]
    namespace: Option<String>,
    /// Address of /healthz, /readyz and /metrics.
    #[arg(long, env = "RLPLANE_METRICS_ADDR", default_value = "0.0.0.0:8080")]
    metrics_addr: SocketAddr,
    /// Elect a leader through a coordination.k8s.io Lease, so that several replicas are safe.
    #[arg(long, env = "RLPLANE_LEADER_ELECTION", default_value_t = true, action = clap::ArgAction::Set)]
    leader_election: bool,
    /// Name of the Lease.
    #[arg(long, default_value = "rlplane-operator")]
    lease_name: String,
    /// Namespace of the Lease (default: $POD_NAMESPACE, else --namespace, else default).
    #[arg(long)]
    lease_namespace: Option<String>,
    /// Seconds the lease stays valid without renewal (a new leader takes over after this when
    /// the old one dies without releasing it).
    #[arg(long, default_value_t = 15, value_parser = clap::value_parser!(u64).range(2..=3600))]
    lease_duration_seconds: u64,
    /// This replica's identity (default: $POD_NAME, else the host name and process id).
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
    /// RLJobs reconciled at once.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u16).range(1..))]
    concurrency: u16,
    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text, env = "RLPLANE_LOG_FORMAT")]
    log_format: LogFormat,
}

#[derive(Args, Debug)]
struct BenchArgs {
    /// Namespace for the benchmark's RLJobs (created; deleted afterwards unless --keep).
    #[arg(long, default_value = "rlplane-bench")]
    namespace: String,
    /// Pods of the latency job.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(2..=1024))]
    pods: u32,
    /// RLJobs alive while the RSS is measured.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=10000))]
    jobs: u32,
    /// Latency measurements (the report gives median and max).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=100))]
    rounds: u32,
    /// Operator binary to start (default: this one).
    #[arg(long, env = "RLPLANE_OPERATOR_BIN")]
    operator_bin: Option<PathBuf>,
    /// Keep the namespace and its RLJobs afterwards.
    #[arg(long)]
    keep: bool,
    /// Let the latency job's pods be scheduled (the cluster needs room for --pods pods) and time
    /// until the scheduler bound them all.
    #[arg(long)]
    schedule: bool,
}

/// Accepts both clap's kebab-case and Kubernetes' own spelling (`IfNotPresent`).
#[derive(Clone, Copy, Debug, ValueEnum)]
enum PullPolicy {
    #[value(alias = "Always")]
    Always,
    #[value(alias = "IfNotPresent")]
    IfNotPresent,
    #[value(alias = "Never")]
    Never,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,kube_lease_manager=warn"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

fn run_options(a: RunArgs) -> RunOptions {
    let identity = a.identity.unwrap_or_else(|| {
        let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "rlplane-operator".into());
        format!("{host}-{}", std::process::id())
    });
    let lease_namespace = a
        .lease_namespace
        .or_else(|| std::env::var("POD_NAMESPACE").ok().filter(|s| !s.is_empty()))
        .or_else(|| a.namespace.clone())
        .unwrap_or_else(|| "default".into());
    RunOptions {
        config: OperatorConfig {
            worker_image: a.worker_image,
            image_pull_policy: a.image_pull_policy.map(|p| format!("{p:?}")),
        },
        namespace: a.namespace,
        metrics_addr: a.metrics_addr,
        leader_election: a.leader_election,
        lease_name: a.lease_name,
        lease_namespace,
        identity,
        lease_duration_seconds: a.lease_duration_seconds,
        // Renew a third of the way before expiry: a slow API server call never costs the lease.
        lease_grace_seconds: (a.lease_duration_seconds / 3).max(1),
        concurrency: a.concurrency,
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        None => {
            init_logging(cli.run.log_format);
            run(run_options(cli.run)).await
        }
        Some(Command::Run(a)) => {
            init_logging(a.log_format);
            run(run_options(a)).await
        }
        Some(Command::Bench(b)) => {
            init_logging(LogFormat::Text);
            let opts = BenchOptions {
                namespace: b.namespace,
                pods: b.pods,
                jobs: b.jobs,
                rounds: b.rounds,
                operator_bin: b.operator_bin,
                keep: b.keep,
                schedule: b.schedule,
            };
            bench::cluster(&opts).await
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
