//! `rlplane local` end to end, with real processes: both modes with the tiny model, the summary's
//! byte counts against what the manifest implies, a rank killed mid-run, Ctrl-C, and invalid
//! manifests.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rlplane::workload::step_samples;
use rlplane_api::load_rljob;
use rlplane_api::model::manifest_bytes;

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_rlplane")
}

fn repo(p: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(p)
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("rlplane-test-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Runs a manifest to completion and returns the --json summary.
fn run_json(manifest: &Path, extra: &[&str]) -> serde_json::Value {
    let out = scratch("json").join(format!("{}.json", manifest.file_stem().unwrap().to_string_lossy()));
    let o = Command::new(bin())
        .arg("local")
        .arg(manifest)
        .args(["--json", out.to_str().unwrap()])
        .args(extra)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "rlplane local {} failed: {}\n{stderr}", manifest.display(), o.status);
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        stdout.contains("refit")
            && stdout.contains("transfer queue")
            && stdout.contains("dispatch")
            && stdout.contains("round trip"),
        "{stdout}"
    );
    serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap()
}

/// The bytes a step's rollouts put into the transfer queue, from the workload definition:
/// input_ids i64 and response_mask u8 per token, old_logprobs f32 per response token, a f32 reward.
fn expected_put_bytes(manifest: &Path, steps: u32) -> u64 {
    let job = load_rljob(&std::fs::read_to_string(manifest).unwrap()).unwrap();
    (1..=steps)
        .flat_map(|s| step_samples(&job.spec.workload, s))
        .map(|s| {
            let tokens = (s.prompt_tokens + s.response_tokens) as u64;
            tokens * 8 + tokens + s.response_tokens as u64 * 4 + 4
        })
        .sum()
}

fn check_summary(manifest: &Path, v: &serde_json::Value) {
    let job = load_rljob(&std::fs::read_to_string(manifest).unwrap()).unwrap();
    let steps = job.spec.workload.steps;
    let s = &v["summary"];
    assert_eq!(s["steps"], steps);
    let model = manifest_bytes(&job.spec.model.manifest());
    let receivers = job.spec.generation.engines as u64 * job.spec.generation.tensor_parallel as u64;
    assert_eq!(s["refit_bytes_per_receiver"].as_u64().unwrap(), model, "every receiver gets the whole model");
    assert_eq!(s["refit_bytes_total"].as_u64().unwrap(), model * receivers * steps as u64);
    let put = expected_put_bytes(manifest, steps);
    assert_eq!(s["tq_put_bytes"].as_u64().unwrap(), put, "bytes put = what the workload implies");
    assert_eq!(s["tq_get_bytes"].as_u64().unwrap(), put, "the trainer fetched every byte once");
    // Control time is accounted per stretch of commands sent together: with one data-parallel
    // shard the update goes out with Train (the ranks derive its seed), with several it waits for
    // every shard's batch digest.
    let stretch = if job.spec.trainer.parallelism.data == 1 { "train+update+refit" } else { "update+refit" };
    for step in v["steps"]["steps"].as_array().unwrap() {
        assert_eq!(step["version"], step["step"], "refit version = step");
        assert!(step["imbalance"].as_f64().unwrap() >= 1.0);
        let parts = step["control_phases"].as_object().unwrap();
        assert!(parts.contains_key(stretch), "{parts:?}");
        let sum: f64 = parts.values().map(|p| p.as_f64().unwrap()).sum();
        assert!((sum - step["control_s"].as_f64().unwrap()).abs() < 1e-9, "the parts make the control time: {step}");
    }
    assert!(s["dispatches"].as_u64().unwrap() > 0);
}

#[test]
fn split_mode_runs_and_accounts_every_byte() {
    let m = repo("manifests/rljob-cpu.yaml");
    check_summary(&m, &run_json(&m, &[]));
}

#[test]
fn colocated_mode_with_dedicated_storage_and_sharded_senders_runs() {
    let m = repo("manifests/rljob-cpu-colocated.yaml");
    check_summary(&m, &run_json(&m, &[]));
}

#[test]
fn invalid_manifests_exit_2_with_every_message() {
    let o = Command::new(bin()).arg("local").arg(repo("manifests/invalid/parallelism-mismatch.yaml")).output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(e.contains("spec.trainer.parallelism: tensor×pipeline×context×data = 1×1×1×3 = 3"), "{e}");
    // Several problems at once are all listed.
    let bad = std::fs::read_to_string(repo("manifests/rljob-cpu.yaml"))
        .unwrap()
        .replace("numBuffers: 2", "numBuffers: 0")
        .replace("trainer:", "trainr:");
    let f = scratch("bad").join("bad.yaml");
    std::fs::write(&f, bad).unwrap();
    let o = Command::new(bin()).arg("local").arg(&f).output().unwrap();
    assert_eq!(o.status.code(), Some(2));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(e.contains("spec.trainr: unknown field; did you mean `trainer`?"), "{e}");
    let o = Command::new(bin()).arg("local").arg("/nonexistent.yaml").output().unwrap();
    assert_eq!(o.status.code(), Some(2));
}

/// Children of `parent` (direct), from /proc.
fn children_of(parent: u32) -> Vec<(u32, String)> {
    let mut v = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        // Fields after the command (which may contain spaces) follow the last ')'.
        let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else { continue };
        let ppid: u32 = rest.split_whitespace().nth(1).and_then(|p| p.parse().ok()).unwrap_or(0);
        if ppid == parent {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            v.push((pid, String::from_utf8_lossy(&cmd).replace('\0', " ")));
        }
    }
    v
}

/// Processes whose command line mentions `needle`.
fn processes_mentioning(needle: &str) -> Vec<u32> {
    let me = std::process::id();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_string_lossy().parse::<u32>().ok())
        .filter(|&pid| pid != me)
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| String::from_utf8_lossy(&c).contains(needle))
                .unwrap_or(false)
        })
        .collect()
}

/// A runner process, killed (and reaped) if the test fails before it exits.
struct Runner(Child);

impl Drop for Runner {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts a long run and returns it once step 2 finished, with its stderr lines so far.
fn start_long_run() -> (Runner, std::sync::mpsc::Receiver<String>) {
    let mut child = Command::new(bin())
        .arg("local")
        .arg(repo("manifests/rljob-cpu.yaml"))
        .args(["--steps", "100000"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    let child = Runner(child);
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let line = rx.recv_timeout(deadline.saturating_duration_since(Instant::now())).expect("the run reaches step 2");
        if line.starts_with("step 2/") {
            return (child, rx);
        }
    }
}

fn wait_exit(child: &mut Child, within: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + within;
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        assert!(Instant::now() < deadline, "the runner did not exit within {within:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn assert_no_orphans(runner: u32) {
    // Scratch directories and plan paths carry the runner's pid.
    let needle = format!("-{runner}-");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let left: Vec<u32> = processes_mentioning(&needle).into_iter().filter(|&p| p != runner).collect();
        if left.is_empty() {
            return;
        }
        assert!(Instant::now() < deadline, "orphan rank processes left behind: {left:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_rank_killed_mid_run_ends_the_run_naming_it_and_leaves_no_orphans() {
    let (mut child, rx) = start_long_run();
    let runner = child.0.id();
    let ranks = children_of(runner);
    assert_eq!(ranks.len(), 4, "four rank processes: {ranks:?}");
    let (victim, _) = ranks.iter().find(|(_, cmd)| cmd.contains("--process gen-1")).expect("gen-1 is a child").clone();
    let killed_at = Instant::now();
    // SAFETY: kill(2) on our grandchild.
    unsafe {
        libc::kill(victim as i32, libc::SIGKILL);
    }
    let status = wait_exit(&mut child.0, Duration::from_secs(15));
    let took = killed_at.elapsed();
    assert_eq!(status.code(), Some(1), "a failed run exits 1");
    assert!(took < Duration::from_secs(10), "the failure ended the run in {took:?}");
    let lines: Vec<String> = rx.try_iter().collect();
    let all = lines.join("\n");
    assert!(all.contains("generation rank 1") && all.contains("gen-1"), "the error names the rank:\n{all}");
    assert_no_orphans(runner);
}

#[test]
fn ctrl_c_stops_every_rank_cleanly() {
    let (mut child, rx) = start_long_run();
    let runner = child.0.id();
    // SAFETY: kill(2) on our child.
    unsafe {
        libc::kill(runner as i32, libc::SIGINT);
    }
    let status = wait_exit(&mut child.0, Duration::from_secs(15));
    assert_eq!(status.code(), Some(130));
    let all: Vec<String> = rx.try_iter().collect();
    assert!(all.iter().any(|l| l.contains("interrupted")), "{all:?}");
    assert_no_orphans(runner);
}
