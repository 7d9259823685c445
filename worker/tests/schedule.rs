//! Asynchronous RL (`spec.schedule`, issue 24), end to end on CPUs: `rlplane local
//! manifests/rljob-cpu-async.yaml` (2 engines, 2 data-parallel trainer ranks, TCP refit) under
//! the random delays its workload draws for every engine's generation and every trainer rank's
//! training (`workload.generateMillis`, `trainMillis`). For each policy lag `k` the run's JSON is
//! read from the trainer's side: the largest lag any trainer rank found in its batch as it
//! arrived (each rank checks every sample's `policy_version` tag and would fail the run past
//! `k`), the coordinator's count of samples by lag, and that nothing was dropped or lost.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_rlplane")
}

fn repo(p: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(p)
}

/// Samples every step of the manifest's workload makes (promptsPerStep × samplesPerPrompt).
const SAMPLES_PER_STEP: u64 = 64;

/// Runs the async manifest with policy lag `k` for `steps` steps; returns its `--json` document.
fn run(k: u32, steps: u32) -> Value {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("run.json");
    let out = Command::new(bin())
        .arg("local")
        .arg(repo("manifests/rljob-cpu-async.yaml"))
        .args(["--max-policy-lag", &k.to_string(), "--steps", &steps.to_string(), "--json"])
        .arg(&json)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "k = {k}: rlplane local failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap()
}

/// Checks every step of a run with lag bound `k`; returns how many samples lagged by each
/// amount over the run.
fn check_steps(doc: &Value, k: u32, steps: u32) -> Vec<u64> {
    let records = doc["steps"]["steps"].as_array().unwrap();
    assert_eq!(records.len(), steps as usize, "every step ran once");
    let mut by_lag = vec![0u64; k as usize + 1];
    for (i, r) in records.iter().enumerate() {
        let step = i as u64 + 1;
        assert_eq!(r["step"], step);
        assert_eq!(r["version"], step, "step {step}: every engine holds the step's weights after its refit");
        let trainer_lag = r["trainer_lag_max"].as_u64().unwrap();
        assert!(
            trainer_lag <= k as u64,
            "step {step}: a trainer rank received a sample {trainer_lag} versions old; k = {k}"
        );
        let lags: Vec<u64> = r["policy_lags"].as_array().unwrap().iter().map(|n| n.as_u64().unwrap()).collect();
        assert!(lags.len() <= k as usize + 1, "step {step}: lags {lags:?} past k = {k}");
        assert_eq!(lags.iter().sum::<u64>(), SAMPLES_PER_STEP, "step {step}: every sample trained on, once");
        assert_eq!(r["samples"], SAMPLES_PER_STEP);
        assert_eq!(r["stale_dropped"], 0, "step {step}: the schedule never hands out weights older than k");
        // Step s can't lag more than s − 1 versions: version 0 is the oldest there is.
        assert!(lags.len() as u64 <= step, "step {step}: lags {lags:?}");
        for (l, n) in lags.iter().enumerate() {
            by_lag[l] += n;
        }
    }
    by_lag
}

#[test]
fn the_synchronous_schedule_trains_only_on_the_previous_steps_weights() {
    let doc = run(0, 4);
    let by_lag = check_steps(&doc, 0, 4);
    assert_eq!(by_lag, [4 * SAMPLES_PER_STEP]);
    assert_eq!(doc["summary"]["max_policy_lag"], 0);
}

#[test]
fn generation_runs_ahead_by_at_most_the_lag_the_job_allows() {
    for k in [1u32, 2] {
        let steps = 8;
        let doc = run(k, steps);
        let by_lag = check_steps(&doc, k, steps);
        // Generation ran ahead: from step k + 1 on, engines generate step s while the trainer
        // still trains an earlier one, so most samples lag exactly k.
        assert!(
            by_lag[k as usize] >= (steps - k) as u64 * SAMPLES_PER_STEP,
            "k = {k}: samples by lag {by_lag:?}: generation did not run {k} steps ahead"
        );
        let s = &doc["summary"];
        assert_eq!(s["max_policy_lag"], k);
        assert_eq!(s["policy_lag_max"], k, "k = {k}: the trainer saw the lag it was allowed");
        assert_eq!(s["stale_dropped"], 0);
    }
}
