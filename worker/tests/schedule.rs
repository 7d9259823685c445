//! Asynchronous RL (`spec.schedule`, issue 24), end to end on CPUs: `rlplane local
//! manifests/rljob-cpu-async.yaml` (2 engines, 2 data-parallel trainer ranks, TCP refit) under
//! the random delays its workload draws for every engine's generation and every trainer rank's
//! training (`workload.generateMillis`, `trainMillis`). For each policy lag `k` the run's JSON is
//! read from the trainer's side: the largest lag any trainer rank found in its batch as it
//! arrived (each rank checks every sample's `policy_version` tag and would fail the run past
//! `k`), the coordinator's count of samples by lag, and that nothing was dropped or lost.
//!
//! The faults of an asynchronous job: a trainer slower than every engine and engines slower than
//! the trainer (generation waits at the bound, never past it), and an engine killed while it is
//! ahead of the trainer (the gang restarts from the last checkpoint; no step is lost, none trains
//! on another epoch's rollouts, and the bound holds from the first step after the resume).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

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
    run_manifest(&repo("manifests/rljob-cpu-async.yaml"), k, steps)
}

/// The async manifest with other simulated times (milliseconds, min and max) and, optionally,
/// a checkpoint every `checkpoint` steps, written into `dir`.
fn variant(dir: &Path, generate: (u32, u32), train: (u32, u32), checkpoint: Option<u32>) -> PathBuf {
    let text = std::fs::read_to_string(repo("manifests/rljob-cpu-async.yaml")).unwrap();
    let (g, t) = ("    generateMillis: {min: 40, max: 80}", "    trainMillis: {min: 40, max: 80}");
    assert!(text.contains(g) && text.contains(t), "the manifest's simulated times changed; update this test");
    let mut text = text
        .replace(g, &format!("    generateMillis: {{min: {}, max: {}}}", generate.0, generate.1))
        .replace(t, &format!("    trainMillis: {{min: {}, max: {}}}", train.0, train.1));
    if let Some(every) = checkpoint {
        text += &format!("  checkpoint:\n    everySteps: {every}\n");
    }
    let path = dir.join("rljob.yaml");
    std::fs::write(&path, text).unwrap();
    path
}

/// Runs `manifest` with policy lag `k` for `steps` steps; returns its `--json` document.
fn run_manifest(manifest: &Path, k: u32, steps: u32) -> Value {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("run.json");
    let out = Command::new(bin())
        .arg("local")
        .arg(manifest)
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
    check_steps_from(doc, k, 1, steps)
}

/// [`check_steps`] for a run whose last epoch ran steps `first..=last`.
fn check_steps_from(doc: &Value, k: u32, first: u32, last: u32) -> Vec<u64> {
    let records = doc["steps"]["steps"].as_array().unwrap();
    assert_eq!(records.len(), (last + 1 - first) as usize, "every step ran once");
    let mut by_lag = vec![0u64; k as usize + 1];
    for (i, r) in records.iter().enumerate() {
        let step = i as u64 + u64::from(first);
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
        // Step s can't lag more than s − first versions: the epoch's first version is the oldest.
        assert!(lags.len() as u64 <= step + 1 - u64::from(first), "step {step}: lags {lags:?}");
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
        // Generation ran ahead: from step 2 on, step s is generated while the trainer still
        // trains step s - 1, so with weights at least one version old. (How old exactly, up to
        // k, depends on whether a refit landed before the step started: the engine receives
        // while it generates and takes the newest version at each step's start.)
        let lagged: u64 = by_lag[1..].iter().sum();
        assert!(
            lagged >= u64::from(steps - 1) * SAMPLES_PER_STEP,
            "k = {k}: samples by lag {by_lag:?}: generation did not run ahead"
        );
        let s = &doc["summary"];
        assert_eq!(s["max_policy_lag"], k);
        assert_eq!(s["policy_lag_max"], k, "k = {k}: the trainer saw the lag it was allowed");
        assert_eq!(s["stale_dropped"], 0);
    }
}

/// Mean idle seconds per step of the engines and of the trainer.
fn idle(doc: &Value) -> (f64, f64) {
    let s = &doc["summary"];
    (s["engine_idle_s"].as_f64().unwrap(), s["trainer_idle_s"].as_f64().unwrap())
}

#[test]
fn a_trainer_slower_than_every_engine_holds_generation_at_the_bound() {
    let dir = tempfile::tempdir().unwrap();
    let m = variant(dir.path(), (1, 3), (40, 60), None);
    let (k, steps) = (2, 8);
    let doc = run_manifest(&m, k, steps);
    let by_lag = check_steps(&doc, k, steps);
    // The engines run as far ahead as allowed and then wait: from step k + 1 on, every sample
    // lags exactly k.
    assert!(by_lag[k as usize] >= u64::from(steps - k) * SAMPLES_PER_STEP, "samples by lag {by_lag:?}");
    let (engines, trainer) = idle(&doc);
    assert!(engines > trainer, "the engines wait for the trainer: idle per step {engines} s vs {trainer} s");
}

#[test]
fn engines_slower_than_the_trainer_never_pass_the_bound_either() {
    let dir = tempfile::tempdir().unwrap();
    let m = variant(dir.path(), (40, 60), (1, 3), None);
    let (k, steps) = (2, 8);
    let doc = run_manifest(&m, k, steps);
    let by_lag = check_steps(&doc, k, steps);
    // Generation is the bottleneck: it still runs ahead (the trainer never makes it wait for a
    // refit it could have done without), within the bound.
    assert!(by_lag[1..].iter().sum::<u64>() > 0, "samples by lag {by_lag:?}: generation never ran ahead");
}

#[test]
fn an_engine_killed_while_ahead_of_the_trainer_resumes_from_the_checkpoint_losing_no_step() {
    let dir = tempfile::tempdir().unwrap();
    // Checkpoints every 4 steps; generation and training take 20-40 ms each, so the engines are
    // generating the step after the one in training when gen-0 is killed.
    let m = variant(dir.path(), (20, 40), (20, 40), Some(4));
    let (k, steps) = (1u32, 16u32);
    let json = dir.path().join("run.json");
    let mut child = Command::new(bin())
        .arg("local")
        .arg(&m)
        .args(["--max-policy-lag", &k.to_string(), "--steps", &steps.to_string(), "--json"])
        .arg(&json)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = BufReader::new(child.stderr.take().unwrap());
    let mut lines = stderr.lines().map_while(Result::ok);
    let mut seen = Vec::new();
    for line in lines.by_ref() {
        let at_step_6 = line.starts_with("step 6/");
        seen.push(line);
        if at_step_6 {
            break;
        }
    }
    let victim = gen_0_of(child.id()).unwrap_or_else(|| panic!("no gen-0 process; the run said:\n{}", seen.join("\n")));
    // SAFETY: kill(2) on a grandchild of this test.
    unsafe {
        libc::kill(victim as i32, libc::SIGKILL);
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    let rest: Vec<String> = lines.collect();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "the run did not finish after the restart");
        std::thread::sleep(Duration::from_millis(50));
    };
    let all = [seen, rest].concat().join("\n");
    assert!(status.success(), "the gang restart resumed and finished:\n{all}");
    assert!(all.contains("gang restart 1/") && all.contains("resuming after step 4"), "{all}");
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    // The last epoch ran steps 5..=16, each on all of its own samples and within the bound.
    let by_lag = check_steps_from(&doc, k, 5, steps);
    assert_eq!(by_lag.iter().sum::<u64>(), u64::from(steps - 4) * SAMPLES_PER_STEP);
}

/// The pid of rank gen-0 among the descendants of `runner`, from /proc.
fn gen_0_of(runner: u32) -> Option<u32> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_string_lossy().parse().ok()?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let ppid: u32 = stat.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse().ok()?;
        let cmd = String::from_utf8_lossy(&std::fs::read(format!("/proc/{pid}/cmdline")).ok()?).replace('\0', " ");
        (ppid == runner && cmd.contains("--process gen-0")).then_some(pid)
    })
}
