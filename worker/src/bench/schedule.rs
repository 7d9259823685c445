//! `rlplane bench schedule MANIFEST`: the same job under the synchronous schedule and under
//! asynchronous ones (`spec.schedule.maxPolicyLag` = 1, 2, …), in one run. Each lag's job runs
//! as `rlplane local MANIFEST --max-policy-lag K --json …`, the lags taking turns over several
//! rounds (so drift of the machine falls on all of them alike); the table gives each one's steps
//! per second (the median round), its ratio to lag 0 measured in the same run, the policy lag
//! its trainer ranks received, and the engines' and trainer's idle time per step.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::Context;
use serde::Serialize;

/// Arguments of `rlplane bench schedule`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The RLJob manifest (YAML) to run; its workload's generateMillis and trainMillis set how
    /// long generation and training take (e.g. manifests/rljob-cpu-async.yaml).
    pub manifest: PathBuf,
    /// The policy lags to compare; 0 (the synchronous schedule, the reference) is always run.
    #[arg(long, value_delimiter = ',', default_values_t = vec![1u32, 2])]
    pub lags: Vec<u32>,
    /// Override the manifest's steps.
    #[arg(long)]
    pub steps: Option<u32>,
    /// Runs of every lag, taken in turns.
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// One lag's result.
#[derive(Clone, Debug, Serialize)]
pub struct LagResult {
    /// The policy lag allowed (0: synchronous).
    pub max_policy_lag: u32,
    /// Steps per second of each round.
    pub steps_per_s: Vec<f64>,
    /// The median round's steps per second.
    pub median_steps_per_s: f64,
    /// Median steps per second ÷ lag 0's.
    pub vs_synchronous: f64,
    /// Mean policy lag of the samples trained on (median round).
    pub policy_lag_mean: f64,
    /// Largest policy lag a trainer rank received, over every round.
    pub policy_lag_max: u64,
    /// Samples dropped as stale, over every round.
    pub stale_dropped: u64,
    /// Mean engine idle seconds per step (median round).
    pub engine_idle_s: f64,
    /// Mean trainer idle seconds per step (median round).
    pub trainer_idle_s: f64,
}

/// What one `rlplane local` run reported.
struct Run {
    steps_per_s: f64,
    policy_lag_mean: f64,
    policy_lag_max: u64,
    stale_dropped: u64,
    engine_idle_s: f64,
    trainer_idle_s: f64,
}

/// Runs the job once with lag `k`.
fn run_once(manifest: &Path, k: u32, steps: Option<u32>, scratch: &Path) -> anyhow::Result<Run> {
    let json = scratch.join(format!("lag-{k}.json"));
    let mut cmd = Command::new(std::env::current_exe().context("finding the rlplane binary")?);
    cmd.arg("local").arg(manifest).args(["--max-policy-lag", &k.to_string(), "--json"]).arg(&json);
    if let Some(s) = steps {
        cmd.args(["--steps", &s.to_string()]);
    }
    let out = cmd.output().context("running rlplane local")?;
    anyhow::ensure!(
        out.status.success(),
        "rlplane local {} --max-policy-lag {k} failed:\n{}",
        manifest.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json)?)?;
    let s = &doc["summary"];
    let f = |k: &str| s[k].as_f64().with_context(|| format!("the run's summary lacks {k}"));
    Ok(Run {
        steps_per_s: f("steps_per_s")?,
        policy_lag_mean: f("policy_lag_mean")?,
        policy_lag_max: s["policy_lag_max"].as_u64().unwrap_or(0),
        stale_dropped: s["stale_dropped"].as_u64().unwrap_or(0),
        engine_idle_s: f("engine_idle_s")?,
        trainer_idle_s: f("trainer_idle_s")?,
    })
}

/// Runs the benchmark.
pub fn run(args: Args) -> anyhow::Result<()> {
    anyhow::ensure!(args.rounds >= 1, "--rounds must be at least 1");
    // Lag 0 first (the reference), then each other lag once, in order.
    let mut lags = vec![0u32];
    lags.extend(args.lags.iter().copied().filter(|&k| k > 0));
    lags[1..].sort_unstable();
    lags.dedup();
    if let Some(&k) = lags.iter().find(|&&k| k > rlplane_api::MAX_POLICY_LAG) {
        anyhow::bail!("--lags: {k} is more than spec.schedule.maxPolicyLag allows ({})", rlplane_api::MAX_POLICY_LAG);
    }
    let scratch = std::env::temp_dir().join(format!("rlplane-bench-schedule-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).with_context(|| format!("creating {}", scratch.display()))?;
    let runs = rounds(&args, &lags, &scratch);
    let _ = std::fs::remove_dir_all(&scratch);
    let runs = runs?;
    let results = summarize(&lags, runs);
    print!("{}", table(&args.manifest, &results));
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&results)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// Every lag's runs, the lags taking turns in each round.
fn rounds(args: &Args, lags: &[u32], scratch: &Path) -> anyhow::Result<Vec<Vec<Run>>> {
    let mut runs: Vec<Vec<Run>> = lags.iter().map(|_| Vec::new()).collect();
    for round in 0..args.rounds {
        for (i, &k) in lags.iter().enumerate() {
            let r = run_once(&args.manifest, k, args.steps, scratch)?;
            eprintln!("round {}: maxPolicyLag {k}: {:.2} steps/s", round + 1, r.steps_per_s);
            runs[i].push(r);
        }
    }
    Ok(runs)
}

/// Each lag's median round, and its ratio to lag 0's.
fn summarize(lags: &[u32], runs: Vec<Vec<Run>>) -> Vec<LagResult> {
    let mut results: Vec<LagResult> = lags
        .iter()
        .zip(runs)
        .map(|(&k, mut rs)| {
            let steps_per_s: Vec<f64> = rs.iter().map(|r| r.steps_per_s).collect();
            let lag_max = rs.iter().map(|r| r.policy_lag_max).max().unwrap_or(0);
            let dropped = rs.iter().map(|r| r.stale_dropped).sum();
            rs.sort_by(|a, b| a.steps_per_s.total_cmp(&b.steps_per_s));
            let m = &rs[rs.len() / 2];
            LagResult {
                max_policy_lag: k,
                steps_per_s,
                median_steps_per_s: m.steps_per_s,
                vs_synchronous: 0.0,
                policy_lag_mean: m.policy_lag_mean,
                policy_lag_max: lag_max,
                stale_dropped: dropped,
                engine_idle_s: m.engine_idle_s,
                trainer_idle_s: m.trainer_idle_s,
            }
        })
        .collect();
    let reference = results[0].median_steps_per_s;
    for r in &mut results {
        r.vs_synchronous = if reference > 0.0 { r.median_steps_per_s / reference } else { 0.0 };
    }
    results
}

/// The results as a table.
fn table(manifest: &Path, results: &[LagResult]) -> String {
    let mut out = format!(
        "{}: steps per second by schedule (median of {} rounds; the reference is lag 0, the synchronous schedule, in the same run)\n",
        manifest.display(),
        results[0].steps_per_s.len()
    );
    out += "maxPolicyLag  steps/s   vs lag 0  lag mean  lag max  stale  engine idle/step  trainer idle/step\n";
    for r in results {
        out += &format!(
            "{:>12}  {:>7.2}  {:>8.2}×  {:>8.2}  {:>7}  {:>5}  {:>15.4}s  {:>16.4}s\n",
            r.max_policy_lag,
            r.median_steps_per_s,
            r.vs_synchronous,
            r.policy_lag_mean,
            r.policy_lag_max,
            r.stale_dropped,
            r.engine_idle_s,
            r.trainer_idle_s
        );
    }
    out
}
