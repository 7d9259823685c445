//! The merged `/metrics` with real processes: `rlplane local --metrics-port` (every rank's
//! exposition and the in-process coordinator's) and a pod supervisor (`rlplane worker --plan`,
//! health, readiness and metrics on the plan's port), checked for valid OpenMetrics text and for
//! the series the dashboard reads.

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rlplane::metrics::scrape;

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_rlplane")
}

fn repo(p: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(p)
}

/// A free port outside the ephemeral range, so that no outgoing connection of the starting job
/// takes it before the job binds it.
fn free_port() -> u16 {
    rlplane::net::reserve_loopback_port().unwrap().local_addr().unwrap().port()
}

/// Kills and reaps the child when dropped, so a failed assertion leaves no run behind.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        // SAFETY: signalling our own child, not yet reaped.
        unsafe { libc::kill(self.0.id() as libc::pid_t, libc::SIGINT) };
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Forwards the child's stderr into a channel (and keeps draining it).
fn stderr_lines(child: &mut Child) -> std::sync::mpsc::Receiver<String> {
    let (tx, rx) = std::sync::mpsc::channel();
    let err = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    rx
}

/// Checks an OpenMetrics exposition: `# EOF` once, last; each family's HELP and TYPE once and
/// before its samples; a family's samples contiguous; no series twice. Returns the samples as
/// (series, value).
fn check_openmetrics(text: &str) -> Vec<(String, f64)> {
    assert!(text.ends_with("# EOF\n"), "the exposition ends with # EOF:\n{text}");
    assert_eq!(text.matches("# EOF").count(), 1, "# EOF once");
    let mut meta: HashMap<(String, String), usize> = HashMap::new();
    let mut closed: HashSet<String> = HashSet::new();
    let mut current = String::new();
    let mut series = HashSet::new();
    let mut samples = Vec::new();
    for line in text.lines().filter(|l| *l != "# EOF") {
        if let Some(rest) = line.strip_prefix("# ") {
            let mut parts = rest.splitn(3, ' ');
            let (kw, name) = (parts.next().unwrap().to_string(), parts.next().unwrap().to_string());
            *meta.entry((kw, name.clone())).or_default() += 1;
            if name != current {
                assert!(!closed.contains(&name), "family {name} appears twice:\n{text}");
                closed.insert(std::mem::replace(&mut current, name));
            }
            continue;
        }
        let (key, value) = line.rsplit_once(' ').unwrap();
        assert!(
            key.split('{').next().unwrap().starts_with(&current),
            "sample {line:?} outside its family ({current}):\n{text}"
        );
        assert!(series.insert(key.to_string()), "series {key} twice:\n{text}");
        samples.push((key.to_string(), value.parse::<f64>().unwrap()));
    }
    for ((kw, name), n) in &meta {
        assert_eq!(*n, 1, "# {kw} {name} {n} times");
    }
    samples
}

/// The value of the one sample whose series starts with `name{` and contains every `label`.
fn value(samples: &[(String, f64)], name: &str, labels: &[&str]) -> f64 {
    let found: Vec<f64> = samples
        .iter()
        .filter(|(k, _)| k.starts_with(&format!("{name}{{")) && labels.iter().all(|l| k.contains(l)))
        .map(|(_, v)| *v)
        .collect();
    assert_eq!(found.len(), 1, "one {name} with {labels:?}, found {found:?}");
    found[0]
}

/// Scrapes `addr` until `ready` holds for the samples (or panics after 60 s).
async fn scrape_until(addr: &str, ready: impl Fn(&[(String, f64)]) -> bool) -> Vec<(String, f64)> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(text) = scrape(addr, Duration::from_secs(5)).await {
            let samples = check_openmetrics(&text);
            if ready(&samples) {
                return samples;
            }
        }
        assert!(Instant::now() < deadline, "{addr}/metrics never showed the expected series");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn steps_done(samples: &[(String, f64)]) -> f64 {
    samples.iter().find(|(k, _)| k.starts_with("rlplane_steps_total{")).map(|s| s.1).unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_metrics_port_merges_every_rank_and_the_coordinator() {
    let port = free_port();
    let mut child = Command::new(bin())
        .arg("local")
        .arg(repo("manifests/rljob-cpu.yaml"))
        .args(["--steps", "100000", "--metrics-port", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let lines = stderr_lines(&mut child);
    let _run = Reaped(child);
    let announced = lines
        .iter()
        .find(|l| l.contains("metrics at"))
        .unwrap_or_else(|| panic!("rlplane local never announced its metrics endpoint"));
    assert!(announced.contains(&format!("http://127.0.0.1:{port}/metrics")), "{announced}");
    let addr = format!("127.0.0.1:{port}");
    let s = scrape_until(&addr, |s| steps_done(s) >= 3.0).await;

    let job = r#"rljob="grpo-cpu",mode="split",transport="tcp""#;
    for process in ["trainer-0", "trainer-1", "gen-0", "gen-1"] {
        let up = format!("process=\"{process}\"");
        assert_eq!(value(&s, "rlplane_metrics_source_up", &[job, &up]), 1.0, "{process} answered");
    }
    // The coordinator's job-level series.
    let steps = value(&s, "rlplane_steps_total", &[job]);
    assert!(value(&s, "rlplane_refit_duration_seconds_count", &[job]) >= steps);
    assert!(value(&s, "rlplane_policy_version", &[job]) >= steps);
    for phase in ["generate", "transfer", "train", "refit", "control"] {
        let p = format!("phase=\"{phase}\"");
        assert!(value(&s, "rlplane_step_phase_duration_seconds_count", &[job, &p]) >= steps);
    }
    assert!(value(&s, "rlplane_tq_claim_duration_seconds_count", &[job]) >= steps);
    // The step's scalars: the synthetic engines report their rollouts' mean reward (0 or 1 each)
    // and mean response length (within spec.workload.responseTokens, 32 to 256).
    let reward = value(&s, "rlplane_step_scalar", &[job, r#"name="reward_mean""#]);
    assert!((0.0..=1.0).contains(&reward), "reward_mean {reward}");
    let length = value(&s, "rlplane_step_scalar", &[job, r#"name="response_tokens_mean""#]);
    assert!((32.0..=256.0).contains(&length), "response_tokens_mean {length}");
    // Each generation rank: the version it holds, what it received, what its producer put.
    for rank in ["0", "1"] {
        let me = format!("role=\"generation\",rank=\"{rank}\"");
        let held = value(&s, "rlplane_weight_version", &[job, &me]);
        assert!(held >= steps - 1.0 && held <= steps + 1.0, "gen {rank} holds v{held} after {steps} steps");
        let refits = value(&s, "rlplane_refit_rank_duration_seconds_count", &[job, &me]);
        assert!(refits >= held, "{refits} refits recorded at gen {rank} holding v{held}");
        // Every receiver gets the whole tiny model per refit.
        let bytes = value(&s, "rlplane_refit_rank_bytes_total", &[job, &me]);
        // A scrape may land between a refit's byte count and its duration (one refit apart).
        let whole = |n: f64| n > 0.0 && (bytes / n).fract() == 0.0;
        assert!(bytes > 0.0 && (whole(refits) || whole(refits + 1.0)), "{bytes} bytes over {refits} refits");
        for phase in ["transfer", "unpack", "buffer_wait"] {
            let p = format!("phase=\"{phase}\"");
            assert!(value(&s, "rlplane_refit_phase_duration_seconds_count", &[job, &me, &p]) >= 1.0);
        }
        assert!(value(&s, "rlplane_tq_put_bytes_total", &[job, &me]) > 0.0);
        let unit = format!("unit=\"{rank}\"");
        assert_eq!(value(&s, "rlplane_tq_storage_capacity_bytes", &[job, &me, &unit]), 67108864.0);
    }
    // Trainer leaders fetch; the sender packs.
    for rank in ["0", "1"] {
        let me = format!("role=\"trainer\",rank=\"{rank}\"");
        assert!(value(&s, "rlplane_tq_get_bytes_total", &[job, &me]) > 0.0);
    }
    let sender = r#"role="trainer",rank="0""#;
    assert!(value(&s, "rlplane_refit_phase_duration_seconds_count", &[job, sender, r#"phase="pack""#]) >= 1.0);
    assert!(!s.iter().any(|(k, _)| k.contains(r#"role="trainer""#) && k.contains(r#"phase="unpack""#)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_metrics_port_is_a_clear_error() {
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = busy.local_addr().unwrap().port();
    let out = Command::new(bin())
        .arg("local")
        .arg(repo("manifests/rljob-cpu.yaml"))
        .args(["--steps", "1", "--metrics-port", &port.to_string()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("--metrics-port {port}: cannot listen")) && stderr.contains("pick a free port"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_serves_health_readiness_and_every_ranks_metrics_on_the_plan_port() {
    use rlplane_api::TqPlacement;
    use rlplane_api::topology::{JobIdentity, build_plan};
    // One pod runs everything: colocated, one node, producer-local storage.
    let mut job =
        rlplane_api::load_rljob(&std::fs::read_to_string(repo("manifests/rljob-cpu-colocated.yaml")).unwrap()).unwrap();
    job.spec.transfer_queue.placement = TqPlacement::ProducerLocal;
    job.spec.workload.steps = 100000;
    let port = free_port();
    job.spec.observability.metrics_port = port;
    let dir = std::env::temp_dir().join(format!("rlplane-test-pod-metrics-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let id = JobIdentity {
        name: "grpo-cpu-colocated".into(),
        namespace: "test".into(),
        uid: "uid-1".into(),
        epoch: 0,
        resume: None,
    };
    let mut plan = {
        let addressing = rlplane::local::LocalAddressing::new(&dir);
        build_plan(&job.spec, &id, &addressing).unwrap()
    };
    // The epoch's key, where the operator would mount it: here, a file of the test's.
    let key_file = dir.join("job.key");
    let _ = std::fs::remove_file(&key_file);
    rlplane::net::write_key_file(&key_file, &rlplane::net::JobAuth::generate_key().unwrap()).unwrap();
    plan.job.key_file = key_file.display().to_string();
    assert_eq!(plan.pods.len(), 1, "one pod: {:?}", plan.pods.iter().map(|p| &p.name).collect::<Vec<_>>());
    for pod in &plan.pods {
        std::fs::create_dir_all(&pod.ipc_dir).unwrap();
    }
    let plan_path = dir.join("plan.json");
    std::fs::write(&plan_path, plan.to_json()).unwrap();

    let mut child = Command::new(bin())
        .args(["worker", "--plan"])
        .arg(&plan_path)
        .env("RLPLANE_POD", &plan.pods[0].name)
        .env_remove("KUBERNETES_SERVICE_HOST")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let _lines = stderr_lines(&mut child);
    let _pod = Reaped(child);
    let addr = format!("127.0.0.1:{port}");
    let s = scrape_until(&addr, |s| steps_done(s) >= 2.0).await;
    let job = r#"rljob="grpo-cpu-colocated",mode="colocated",transport="tcp""#;
    // Every process of the pod, the coordinator included, answered and is in the exposition.
    let procs: Vec<String> = plan.processes.iter().map(|p| p.name.clone()).collect();
    for p in &procs {
        let up = format!("process=\"{p}\"");
        assert_eq!(value(&s, "rlplane_metrics_source_up", &[job, &up]), 1.0, "{p} answered");
    }
    assert!(value(&s, "rlplane_policy_version", &[job]) >= 2.0);
    for rank in ["0", "1"] {
        let me = format!("role=\"generation\",rank=\"{rank}\"");
        assert!(value(&s, "rlplane_weight_version", &[job, &me]) >= 1.0);
    }
    let health = |path: &'static str| {
        let addr = addr.clone();
        async move {
            let stream = tokio::net::TcpStream::connect(&addr).await.unwrap();
            let (mut sender, conn) =
                hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await.unwrap();
            tokio::spawn(conn);
            let req = hyper::Request::get(path)
                .header("host", &addr)
                .body(http_body_util::Empty::<bytes::Bytes>::new())
                .unwrap();
            sender.send_request(req).await.unwrap().status().as_u16()
        }
    };
    assert_eq!(health("/healthz").await, 200);
    assert_eq!(health("/readyz").await, 200, "every rank of the pod is ready");
    let _ = std::fs::remove_dir_all(&dir);
}
