//! The soak (issue 26): a CPU job (`rlplane local manifests/rljob-cpu.yaml`, TCP refit, 2 trainer
//! and 2 generation ranks) runs many steps while every process of the job — the `rlplane local`
//! process (the coordinator) and each rank — is sampled from /proc: its resident memory (VmRSS)
//! and its open descriptors. Once warm-up is over (10% of the steps: allocations, caches and
//! connections made), neither may grow: RSS at most 5%, descriptors not at all.
//!
//! CI runs a short version (`DEFAULT_STEPS`); the full soak is 2,000 steps:
//!
//! ```text
//! RLPLANE_SOAK_STEPS=2000 cargo test -p rlplane --locked --test soak -- --nocapture
//! ```
//!
//! `RLPLANE_SOAK_MAX_POLICY_LAG=K` runs the same job asynchronously (`--max-policy-lag K`): the
//! engines' two command lanes, up to K + 1 steps of rollouts in the transfer queue.

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Steps of the short version, the one CI runs.
const DEFAULT_STEPS: u32 = 600;
/// Time between two samples of every process.
const SAMPLE_EVERY: Duration = Duration::from_millis(500);
/// Samples a window holds: the baseline and the end are each the median of this many.
const WINDOW: usize = 5;
/// Allowed RSS growth from the baseline to the end.
const RSS_GROWTH: f64 = 0.05;

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_rlplane")
}

fn repo(p: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(p)
}

fn steps() -> u32 {
    match std::env::var("RLPLANE_SOAK_STEPS") {
        Ok(s) => s.parse().expect("RLPLANE_SOAK_STEPS is a number of steps"),
        Err(_) => DEFAULT_STEPS,
    }
}

/// The runner, killed (and reaped) if the test fails before it exits; its ranks exit when it does.
struct Runner(Child);

impl Drop for Runner {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One process at one instant.
#[derive(Clone, Copy)]
struct Sample {
    pid: u32,
    /// Steps the job had finished when the sample was taken.
    done: u32,
    rss_kib: u64,
    fds: usize,
}

/// Every process's parent, from /proc/*/stat (only thread-group leaders are listed there).
fn parents() -> HashMap<u32, u32> {
    let mut map = HashMap::new();
    let Ok(dir) = std::fs::read_dir("/proc") else { return map };
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        // "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ')'.
        let Some((_, rest)) = stat.rsplit_once(')') else { continue };
        if let Some(ppid) = rest.split_whitespace().nth(1).and_then(|p| p.parse().ok()) {
            map.insert(pid, ppid);
        }
    }
    map
}

/// `root` and all its descendants.
fn tree(root: u32) -> Vec<u32> {
    let parents = parents();
    let mut out = vec![root];
    let mut i = 0;
    while i < out.len() {
        let p = out[i];
        out.extend(parents.iter().filter(|&(_, &pp)| pp == p).map(|(&c, _)| c));
        i += 1;
    }
    out
}

/// A process's name: the rank's `--process NAME`, else `local` for the runner, else its comm.
fn name(pid: u32, root: u32) -> Option<String> {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
    if let Some(i) = args.iter().position(|a| *a == b"--process") {
        return args.get(i + 1).map(|a| String::from_utf8_lossy(a).into_owned());
    }
    if pid == root {
        return Some("local".into());
    }
    std::fs::read_to_string(format!("/proc/{pid}/comm")).ok().map(|c| format!("{} ({pid})", c.trim()))
}

fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn fd_count(pid: u32) -> Option<usize> {
    Some(std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count())
}

/// Samples every process of the job once; a process that exits meanwhile is left out.
fn sample_all(root: u32, done: u32, into: &mut BTreeMap<String, Vec<Sample>>) {
    for pid in tree(root) {
        let (Some(name), Some(rss_kib), Some(fds)) = (name(pid, root), rss_kib(pid), fd_count(pid)) else {
            continue;
        };
        into.entry(name).or_default().push(Sample { pid, done, rss_kib, fds });
    }
}

/// Reads the runner's stderr: every line kept (for a failure's message), and the last finished
/// step (`step K/N: ...`) published to `done`.
fn follow_stderr(child: &mut Child, done: Arc<AtomicU32>) -> (Arc<Mutex<Vec<String>>>, std::thread::JoinHandle<()>) {
    let stderr = child.stderr.take().unwrap();
    let lines = Arc::new(Mutex::new(Vec::new()));
    let kept = lines.clone();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let step = line.strip_prefix("step ").and_then(|r| r.split_once('/')).and_then(|(k, _)| k.parse().ok());
            if let Some(k) = step {
                done.fetch_max(k, Ordering::SeqCst);
            }
            kept.lock().unwrap().push(line);
        }
    });
    (lines, reader)
}

fn median(mut v: Vec<u64>) -> u64 {
    v.sort_unstable();
    v[v.len() / 2]
}

/// Baseline and end of one process.
struct Verdict {
    name: String,
    rss_base: u64,
    rss_end: u64,
    fds_base: u64,
    fds_end: u64,
    /// Steps done at the baseline and at the end (each window's median).
    step_base: u64,
    step_end: u64,
}

impl Verdict {
    fn growth(&self) -> f64 {
        self.rss_end as f64 / self.rss_base as f64 - 1.0
    }

    /// RSS growth per step between the two windows, bytes.
    fn bytes_per_step(&self) -> f64 {
        (self.rss_end as f64 - self.rss_base as f64) * 1024.0 / (self.step_end - self.step_base).max(1) as f64
    }
}

/// The rule: the baseline is the median of the first `WINDOW` samples taken once 10% of the
/// steps were done, the end the median of the last `WINDOW` samples taken before the last step
/// finished (so the job's shutdown is not measured); a median, so one sample caught mid-allocation
/// or with a connection briefly open decides nothing. Per process: RSS end ≤ 1.05 × RSS baseline,
/// and descriptors end ≤ descriptors baseline. None when the process was sampled fewer than
/// `2 * WINDOW` times in between (one that came and went, or a run too short).
fn verdict(name: &str, samples: &[Sample], steps: u32) -> Option<Verdict> {
    let warm = steps / 10;
    let steady: Vec<Sample> = samples.iter().copied().filter(|s| s.done >= warm && s.done < steps).collect();
    if steady.len() < 2 * WINDOW {
        return None;
    }
    assert!(steady.iter().all(|s| s.pid == steady[0].pid), "{name} was restarted during the soak");
    let base = &steady[..WINDOW];
    let end = &steady[steady.len() - WINDOW..];
    let rss = |w: &[Sample]| median(w.iter().map(|s| s.rss_kib).collect());
    let fds = |w: &[Sample]| median(w.iter().map(|s| s.fds as u64).collect());
    let step = |w: &[Sample]| median(w.iter().map(|s| s.done as u64).collect());
    Some(Verdict {
        name: name.into(),
        rss_base: rss(base),
        rss_end: rss(end),
        fds_base: fds(base),
        fds_end: fds(end),
        step_base: step(base),
        step_end: step(end),
    })
}

/// The verdicts as a Markdown table (for CI's log and docs/benchmarks.md alike).
fn table(verdicts: &[Verdict], steps: u32, took: Duration) -> String {
    let mut t = format!(
        "soak: {steps} steps in {:.1}s; baseline once {} steps were done; each value the median of {WINDOW} \
         samples {:?} apart\n\n",
        took.as_secs_f64(),
        steps / 10,
        SAMPLE_EVERY
    );
    t += "| process | RSS baseline (MiB) | RSS end (MiB) | growth | growth per step | fds baseline | fds end |\n";
    t += "|---|---:|---:|---:|---:|---:|---:|\n";
    for v in verdicts {
        let mib = |k: u64| k as f64 / 1024.0;
        t += &format!(
            "| {} | {:.1} | {:.1} | {:+.2}% | {:.0} B | {} | {} |\n",
            v.name,
            mib(v.rss_base),
            mib(v.rss_end),
            100.0 * v.growth(),
            v.bytes_per_step(),
            v.fds_base,
            v.fds_end
        );
    }
    t
}

/// Runs the job, sampling every process until the runner exits.
fn run_sampled(steps: u32) -> (ExitStatus, BTreeMap<String, Vec<Sample>>, Vec<String>, String, Duration) {
    let lag = std::env::var("RLPLANE_SOAK_MAX_POLICY_LAG").ok();
    let mut child = Command::new(bin())
        .arg("local")
        .arg(repo("manifests/rljob-cpu.yaml"))
        .args(["--steps", &steps.to_string()])
        .args(lag.iter().flat_map(|k| ["--max-policy-lag", k.as_str()]))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let root = child.id();
    let done = Arc::new(AtomicU32::new(0));
    let (stderr, stderr_reader) = follow_stderr(&mut child, done.clone());
    let mut stdout = child.stdout.take().unwrap();
    let stdout_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stdout.read_to_string(&mut s);
        s
    });
    let mut runner = Runner(child);
    let start = Instant::now();
    // Generous: a debug build on a loaded 2-core machine runs about 25 steps a second.
    let deadline = start + Duration::from_secs(120) + Duration::from_millis(250) * steps;
    let mut samples = BTreeMap::new();
    let status = loop {
        if let Some(status) = runner.0.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "the soak did not finish within {:?}", deadline - start);
        // The step count read before sampling: a sample is never credited with a later step.
        let d = done.load(Ordering::SeqCst);
        sample_all(root, d, &mut samples);
        std::thread::sleep(SAMPLE_EVERY);
    };
    let took = start.elapsed();
    stderr_reader.join().unwrap();
    let stdout = stdout_reader.join().unwrap();
    let stderr = std::mem::take(&mut *stderr.lock().unwrap());
    (status, samples, stderr, stdout, took)
}

#[test]
fn a_cpu_job_keeps_its_memory_and_descriptors_over_many_steps() {
    let steps = steps();
    assert!(steps >= 100, "a soak of {steps} steps is too short to measure anything");
    let (status, samples, stderr, stdout, took) = run_sampled(steps);
    let log = stderr.join("\n");
    assert!(status.success(), "rlplane local failed: {status}\n{log}");
    let last = format!("step {steps}/{steps}:");
    assert!(stderr.iter().any(|l| l.starts_with(&last)), "the job did not run all {steps} steps:\n{log}");
    assert!(stdout.lines().any(|l| l.split_whitespace().eq(["steps".to_string(), steps.to_string()])), "{stdout}");
    let verdicts: Vec<Verdict> = samples.iter().filter_map(|(name, s)| verdict(name, s, steps)).collect();
    for p in ["local", "trainer-0", "trainer-1", "gen-0", "gen-1"] {
        let n = samples.get(p).map_or(0, Vec::len);
        assert!(
            verdicts.iter().any(|v| v.name == p),
            "{p}: {n} samples, too few once {} of {steps} steps were done (at least {} needed: more steps)",
            steps / 10,
            2 * WINDOW
        );
    }
    let t = table(&verdicts, steps, took);
    // Straight to the test's stderr, past the harness's capture, so CI's log shows the table
    // for a passing run too.
    let _ = std::io::stderr().write_all(t.as_bytes());
    for v in &verdicts {
        assert!(
            v.rss_end as f64 <= (1.0 + RSS_GROWTH) * v.rss_base as f64,
            "{}: RSS grew {:.1}% (more than {:.0}%)\n{t}",
            v.name,
            100.0 * v.growth(),
            100.0 * RSS_GROWTH
        );
        assert!(v.fds_end <= v.fds_base, "{}: descriptors grew from {} to {}\n{t}", v.name, v.fds_base, v.fds_end);
    }
}
