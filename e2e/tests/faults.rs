//! The fault campaign (issue 26): jobs run on the real node (kubelet, containerd, CNI) while
//! faults of every kind below are injected, one at a time, each at a random moment of a stepping
//! job — so at a random phase of its step (generation and puts, the claim, training, the refit)
//! and, for the operator, in the middle of the reconcile that follows a gang restart. Two jobs
//! run side by side: the synthetic CPU job (the worker's own ranks, a dedicated storage unit) and
//! a job whose trainer and engine are the user's containers (the Python client's test scripts)
//! with the worker as their native sidecar.
//!
//! - `kill -9` of one process of each role (found on this machine by its pod and arguments): a
//!   trainer rank, an engine, the coordinator, a storage unit; the user's trainer process, the
//!   user's engine process, and the worker sidecar serving them;
//! - a pod deleted through the API;
//! - the operator killed (`kill -9`) right after a rank's death, then started again;
//! - the API server, and etcd, killed and started again with their own command lines;
//! - a network partition between the trainer's pod and an engine's (`iptables` in the trainer
//!   pod's network namespace), healed after 3 s;
//! - a slowed link (a 4 Mbit/s token bucket on a pod's `eth0`) for 5 s.
//!
//! Every job runs with `refit.verify: Full` and a checkpoint every 10 steps. What the campaign
//! counts comes from the jobs' own checks, which fail the step (and so show in the gang restart's
//! message, or the job's failure) rather than let it pass: a step whose claim differs from what
//! its producers put (a rollout lost or delivered twice), a follower's batch that differs from its
//! leader's, a receiver whose weights differ from the trainer's digest or whose version is not the
//! one announced (a mixed or unverified version). It prints a table (faults by kind, jobs
//! completed, violations of each kind, gang restarts, recovery p50/p99) and fails on any job that
//! does not succeed or any violation.
//!
//!   export KUBECONFIG=$(e2e/cluster/up)
//!   RLPLANE_FAULTS=26 cargo test -p rlplane-e2e --test faults -- --nocapture
//!
//! `RLPLANE_FAULTS` (default 13: each kind once, the short version CI runs) and
//! `RLPLANE_FAULT_SEED` (default: the clock; printed) choose the campaign;
//! `RLPLANE_FAULT_KINDS=DeletePod,KillSidecar,…` replays a given order.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams};
use rlplane_api::plan::ProcessRole;
use rlplane_api::{Phase, RLJob, WorkerPlan};
use rlplane_e2e::real_node::Setup;
use rlplane_e2e::{epoch_of, kubectl, kubectl_stdin, phase_of, workspace};
use rlplane_operator::cluster::{OperatorProcess, operator_binary};
use rlplane_operator::desired::{PLAN_KEY, WORKER_CONTAINER, labels};

/// Steps of each synthetic job of the campaign.
const STEPS: u64 = 150;
/// Steps of each job of the user's containers (whose steps are quicker: 8 samples).
const USER_STEPS: u64 = 1500;
/// The share of a job's steps it must have left for a fault to be injected into it (its ranks
/// exit at the end).
const STEPS_LEFT_DIV: u64 = 5;
/// Steps a job must make after it stepped again before the next fault: a restart a fault
/// causes later (a timeout) is still that fault's.
const SETTLE: u64 = 5;
/// How long one fault may take to recover from before the campaign fails.
const RECOVERY_LIMIT: Duration = Duration::from_secs(180);

/// What a job's own checks say when data was lost, duplicated, corrupted or mixed (the
/// coordinator's and the receivers' error texts), by the column of the table they count in.
const VIOLATIONS: [(&str, &str); 6] = [
    ("rollouts lost or delivered twice (claimed ≠ put)", "samples but the producers put"),
    ("batches corrupted in fan-out", "differs from its leader"),
    ("weights unverified (digest)", "do not match the trainer's digest"),
    ("versions mixed", "reports weight version"),
    ("versions mixed", "where the coordinator announced"),
    ("rollouts past the policy lag", "lags more than"),
];

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Fault {
    KillTrainer,
    KillEngine,
    KillCoordinator,
    KillStorageUnit,
    DeletePod,
    KillOperator,
    RestartApiServer,
    RestartEtcd,
    Partition,
    SlowLink,
    KillUserTrainer,
    KillUserEngine,
    KillSidecar,
}

const KINDS: [Fault; 13] = [
    Fault::KillTrainer,
    Fault::KillEngine,
    Fault::KillCoordinator,
    Fault::KillStorageUnit,
    Fault::DeletePod,
    Fault::KillOperator,
    Fault::RestartApiServer,
    Fault::RestartEtcd,
    Fault::Partition,
    Fault::SlowLink,
    Fault::KillUserTrainer,
    Fault::KillUserEngine,
    Fault::KillSidecar,
];

/// The two kinds of job the campaign runs, side by side: the synthetic CPU job (the worker's own
/// trainer and engine ranks) and a job whose trainer and engine are the user's containers (the
/// Python client's test scripts) with the worker as their native sidecar.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum JobKind {
    Synthetic,
    User,
}

impl JobKind {
    fn steps(self) -> u64 {
        match self {
            JobKind::Synthetic => STEPS,
            JobKind::User => USER_STEPS,
        }
    }
}

impl Fault {
    fn name(self) -> &'static str {
        match self {
            Fault::KillTrainer => "kill -9 a trainer rank",
            Fault::KillEngine => "kill -9 an engine",
            Fault::KillCoordinator => "kill -9 the coordinator",
            Fault::KillStorageUnit => "kill -9 a storage unit",
            Fault::DeletePod => "delete a pod",
            Fault::KillOperator => "kill -9 the operator mid-reconcile",
            Fault::RestartApiServer => "restart the API server",
            Fault::RestartEtcd => "restart etcd",
            Fault::Partition => "partition two pods for 3 s",
            Fault::SlowLink => "slow a pod's link for 5 s",
            Fault::KillUserTrainer => "kill -9 the user's trainer process",
            Fault::KillUserEngine => "kill -9 the user's engine process",
            Fault::KillSidecar => "kill -9 the worker sidecar of a user's process",
        }
    }

    fn job_kind(self) -> JobKind {
        match self {
            Fault::KillUserTrainer | Fault::KillUserEngine | Fault::KillSidecar => JobKind::User,
            _ => JobKind::Synthetic,
        }
    }
}

/// A small seeded generator (xorshift64*): the campaign is reproducible from its printed seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// One fault's outcome.
struct Injected {
    fault: Fault,
    job: String,
    what: String,
    /// From the injection to the job stepping again (in a new epoch when it restarted).
    recovery: Duration,
    restarted: bool,
}

struct Campaign {
    setup: Setup,
    operator: OperatorProcess,
    binary: PathBuf,
    /// The cluster's state directory (its `pids` file names the control plane's processes).
    state: PathBuf,
    rng: Rng,
    jobs: Vec<String>,
    /// The job of each kind the next fault of that kind goes to.
    current: BTreeMap<JobKind, String>,
    /// The Python client's image (the user's containers).
    client_image: String,
    /// Where the user's trainer keeps its checkpoints on this machine (a hostPath volume).
    checkpoints: PathBuf,
    /// Every Restarting condition message seen while a fault recovered (the GangRestart Events
    /// say the same; a message is kept even when its Event was not published).
    restart_messages: Vec<String>,
}

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_fault_campaign_on_the_real_node_loses_no_rollout_and_mixes_no_version() -> anyhow::Result<()> {
    let Some(setup) = Setup::start("faults").await? else { return Ok(()) };
    let count = env_number("RLPLANE_FAULTS", KINDS.len() as u64) as usize;
    let seed = env_number("RLPLANE_FAULT_SEED", std::time::UNIX_EPOCH.elapsed()?.as_nanos() as u64 | 1);
    println!("fault campaign: {count} faults, seed {seed} (RLPLANE_FAULT_SEED={seed} repeats it)");
    let binary = operator_binary(&workspace())?;
    let operator = OperatorProcess::start(&binary, &setup.namespace, &["--image-pull-policy", "Never"])?;
    let kubeconfig = PathBuf::from(std::env::var("KUBECONFIG").context("KUBECONFIG")?);
    let state = kubeconfig.parent().context("the kubeconfig's directory")?.to_path_buf();
    let client_image = setup.image("python-client")?.to_string();
    let checkpoints = PathBuf::from(format!("/var/tmp/rlplane-faults/{}", setup.namespace));
    let mut c = Campaign {
        setup,
        operator,
        binary,
        state,
        rng: Rng(seed),
        jobs: Vec::new(),
        current: BTreeMap::new(),
        client_image,
        checkpoints,
        restart_messages: Vec::new(),
    };
    let result = c.run(count).await;
    c.operator.terminate();
    c.setup.cleanup().await?;
    let _ = std::fs::remove_dir_all(&c.checkpoints);
    result
}

impl Campaign {
    async fn run(&mut self, count: usize) -> anyhow::Result<()> {
        let started = Instant::now();
        let mut order: Vec<Fault> = Vec::new();
        while order.len() < count {
            let mut round = KINDS.to_vec();
            for i in (1..round.len()).rev() {
                round.swap(i, self.rng.below(i as u64 + 1) as usize);
            }
            order.extend(round);
        }
        order.truncate(count);
        // RLPLANE_FAULT_KINDS=KillUserEngine,DeletePod,… replays a given order instead.
        if let Ok(kinds) = std::env::var("RLPLANE_FAULT_KINDS") {
            order = kinds
                .split(',')
                .map(|k| {
                    KINDS
                        .into_iter()
                        .find(|f| format!("{f:?}") == k.trim())
                        .with_context(|| format!("no fault kind {k}"))
                })
                .collect::<anyhow::Result<_>>()?;
        }
        let mut done = Vec::new();
        for (i, fault) in order.into_iter().enumerate() {
            let (job, before, t, what) = self.inject_into_a_running_job(fault).await?;
            let (restarted, recovery) =
                self.recovered(&job, &before, t).await.with_context(|| format!("after {what}"))?;
            println!(
                "fault {}: {what} at step {} of epoch {}: {} in {:.1} s",
                i + 1,
                before.status.as_ref().and_then(|s| s.step).unwrap_or(0),
                epoch_of(&before),
                if restarted { "the gang restarted and steps again" } else { "the job steps on" },
                recovery.as_secs_f64()
            );
            done.push(Injected { fault, job: job.clone(), what, recovery, restarted });
        }
        for job in self.current.values() {
            self.finish(job).await?;
        }
        self.report(&done, started.elapsed()).await
    }

    /// Injects `fault` into a stepping job of its kind, at a random moment of its step; returns
    /// the job, its status before, the instant and what was done. A job may finish between the
    /// look that found it stepping and the fault (its status lags its steps): the fault then goes
    /// to the next job of that kind.
    async fn inject_into_a_running_job(&mut self, fault: Fault) -> anyhow::Result<(String, RLJob, Instant, String)> {
        let kind = fault.job_kind();
        let mut tries = 0;
        loop {
            let job = match self.current.get(&kind).cloned() {
                Some(job) => job,
                None => self.start_job(kind)?,
            };
            let job = self.stepping(job, kind).await?;
            self.current.insert(kind, job.clone());
            // A random moment of the step under way.
            tokio::time::sleep(Duration::from_millis(self.rng.below(1500))).await;
            let before = self.jobs_api().get(&job).await?;
            let t = Instant::now();
            let e = match self.inject(fault, &job, &before).await {
                Ok(what) => return Ok((job, before, t, what)),
                Err(e) => e,
            };
            if tries < 3 && self.finished(&job).await? {
                tries += 1;
                println!("{job} finished before {fault:?} landed; the next job of its kind gets it");
                continue;
            }
            let (_, pods, _) = kubectl(&["get", "pods", "-n", &self.setup.namespace, "-o", "wide"])?;
            return Err(e.context(format!("injecting {fault:?} into {job}; its pods:\n{pods}")));
        }
    }

    /// Whether `job` is Succeeded, or becomes so within 10 s.
    async fn finished(&self, job: &str) -> anyhow::Result<bool> {
        for _ in 0..50 {
            if phase_of(&self.jobs_api().get(job).await?) == Some(Phase::Succeeded) {
                return Ok(true);
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Ok(false)
    }

    fn jobs_api(&self) -> Api<RLJob> {
        Api::namespaced(self.setup.client.clone(), &self.setup.namespace)
    }

    fn pods_api(&self) -> Api<Pod> {
        Api::namespaced(self.setup.client.clone(), &self.setup.namespace)
    }

    /// Applies the campaign's next job of `kind`.
    fn start_job(&mut self, kind: JobKind) -> anyhow::Result<String> {
        let name = format!("faults-{}", self.jobs.len() + 1);
        let text = match kind {
            JobKind::Synthetic => synthetic_job(&name)?,
            JobKind::User => self.user_job(&name)?,
        };
        let (ok, out, err) = kubectl_stdin(&["apply", "-n", &self.setup.namespace, "-f", "-"], &text)?;
        anyhow::ensure!(ok, "kubectl apply: {err}");
        println!("{}", out.trim());
        self.jobs.push(name.clone());
        Ok(name)
    }

    /// A job whose trainer and engine are the Python client's test scripts in the client image,
    /// the worker beside each as its native sidecar; the trainer checkpoints into a hostPath
    /// directory, which its next epoch restores from.
    fn user_job(&mut self, name: &str) -> anyhow::Result<String> {
        if !self.checkpoints.exists() {
            use std::os::unix::fs::PermissionsExt as _;
            std::fs::create_dir_all(&self.checkpoints)?;
            // The container's user is not this machine's root.
            std::fs::set_permissions(&self.checkpoints, std::fs::Permissions::from_mode(0o777))?;
            let scripts = workspace().join("python/tests/sidecar");
            let from = |f: &str| format!("--from-file={}", scripts.join(f).display());
            let args = ["create", "configmap", "sidecar-scripts", "-n", &self.setup.namespace];
            let (ok, _, err) =
                kubectl(&[&args[..], &[&from("launch.py"), &from("trainer.py"), &from("engine.py")]].concat())?;
            anyhow::ensure!(ok, "kubectl create configmap: {err}");
        }
        let (image, dir) = (&self.client_image, self.checkpoints.display());
        let container = |cname: &str, args: &str, ckpt: bool| {
            let (mount, volume) = if ckpt {
                (", {name: ckpt, mountPath: /ckpt}", format!(", {{name: ckpt, hostPath: {{path: {dir}}}}}"))
            } else {
                ("", String::new())
            };
            format!(
                "    template:\n      spec:\n        volumes: [{{name: scripts, configMap: {{name: sidecar-scripts}}}}{volume}]\n\
                 \x20       containers:\n        - name: {cname}\n          image: {image}\n          imagePullPolicy: Never\n\
                 \x20         command: [python3, /scripts/launch.py, \"1\", {args}]\n\
                 \x20         volumeMounts: [{{name: scripts, mountPath: /scripts}}{mount}]\n"
            )
        };
        Ok(format!(
            "apiVersion: rlplane.dev/v1alpha1\nkind: RLJob\nmetadata:\n  name: {name}\nspec:\n  mode: Split\n  device: Cpu\n\
             \x20 runPolicy: {{backoffLimit: 1000, failurePolicy: {{disruptionLimit: 10000}}}}\n\
             \x20 checkpoint: {{everySteps: 10}}\n\
             \x20 model:\n    preset: tiny\n  trainer:\n    nodes: 1\n    gpusPerNode: 1\n{}\
             \x20 generation:\n    engines: 1\n    tensorParallel: 1\n{}\
             \x20 refit: {{transport: Tcp, bufferBytes: 262144, timeoutSeconds: 60, verify: Full}}\n\
             \x20 transferQueue: {{placement: ProducerLocal, capacityBytes: 67108864}}\n\
             \x20 workload: {{steps: {USER_STEPS}, promptsPerStep: 4, samplesPerPrompt: 2, promptTokens: 16, responseTokens: {{min: 8, max: 32}}, seed: 7}}\n",
            container("train", "/scripts/trainer.py, --report, /tmp, --checkpoint-dir, /ckpt", true),
            container("generate", "/scripts/engine.py, --report, /tmp, --mode, direct", false),
        ))
    }
}

/// The synthetic CPU job with a dedicated storage unit (a process of its own to kill), every
/// refit checked byte for byte, a checkpoint every 10 steps, and limits no campaign reaches.
fn synthetic_job(name: &str) -> anyhow::Result<String> {
    Ok(std::fs::read_to_string(workspace().join("manifests/rljob-cpu.yaml"))?
            .replace("name: grpo-cpu\n", &format!("name: {name}\n"))
            .replace("steps: 3", &format!("steps: {STEPS}"))
            .replace("    placement: ProducerLocal\n", "    placement: Dedicated\n    storageUnits: 1\n")
            .replace("    timeoutSeconds: 30\n", "    timeoutSeconds: 30\n    verify: Full\n")
            .replacen(
                "spec:\n",
                "spec:\n  runPolicy: {backoffLimit: 1000, failurePolicy: {disruptionLimit: 10000}}\n  checkpoint: {everySteps: 10}\n",
                1,
            ))
}

impl Campaign {
    /// Waits until `job` is Running and has made a few steps in its epoch; a job that finished
    /// is replaced by the next one, which is then waited for.
    async fn stepping(&mut self, mut job: String, kind: JobKind) -> anyhow::Result<String> {
        let deadline = Instant::now() + RECOVERY_LIMIT;
        loop {
            let j = self.jobs_api().get(&job).await?;
            let st = j.status.clone().unwrap_or_default();
            match st.phase {
                Phase::Succeeded => {
                    println!("{job}: Succeeded at step {:?} after {} gang restarts", st.step, st.restarts);
                    job = self.start_job(kind)?;
                    continue;
                }
                Phase::Failed => bail!("{job} failed: {:?}", rlplane_e2e::condition(&j, "Failed")),
                _ => {}
            }
            let from = st.resumed_from.as_ref().map_or(0, |c| c.step);
            let now = st.step.unwrap_or(0);
            // A fault lands in the middle of a job: one near its end waits for the next job.
            let room = now + kind.steps() / STEPS_LEFT_DIV <= kind.steps();
            if st.phase == Phase::Running && now >= from + 3 && room && self.gang_runs(&job, st.epoch).await? {
                return Ok(job);
            }
            anyhow::ensure!(Instant::now() < deadline, "{job} did not step within {RECOVERY_LIMIT:?}: {st:?}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Whether every pod of the job's epoch `epoch` runs and no other epoch's is left.
    async fn gang_runs(&self, job: &str, epoch: u32) -> anyhow::Result<bool> {
        let pods = self.job_pods(job).await?;
        let e = epoch.to_string();
        let running = |p: &Pod| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
        Ok(!pods.is_empty() && pods.iter().all(|p| p.labels().get(labels::EPOCH) == Some(&e) && running(p)))
    }

    async fn job_pods(&self, job: &str) -> anyhow::Result<Vec<Pod>> {
        let lp = ListParams::default().labels(&format!("{}={job}", labels::JOB));
        Ok(self.pods_api().list(&lp).await?.items)
    }

    /// The job's current plan, from its ConfigMap.
    async fn plan(&self, job: &str) -> anyhow::Result<WorkerPlan> {
        let maps: Api<ConfigMap> = Api::namespaced(self.setup.client.clone(), &self.setup.namespace);
        let map = maps.get(&rlplane_api::topology::plan_config_map_name(job)).await?;
        let text = map.data.and_then(|d| d.get(PLAN_KEY).cloned()).context("no plan")?;
        Ok(serde_json::from_str(&text)?)
    }

    async fn pod(&self, name: &str) -> anyhow::Result<Pod> {
        Ok(self.pods_api().get(name).await?)
    }

    /// Injects `fault` into `job` (as it stood in `before`) and returns what was done.
    async fn inject(&mut self, fault: Fault, job: &str, before: &RLJob) -> anyhow::Result<String> {
        let plan = self.plan(job).await?;
        anyhow::ensure!(plan.job.epoch == epoch_of(before), "the plan is not the running epoch's");
        match fault {
            Fault::KillTrainer => self.kill_process(&plan, |r| matches!(r, ProcessRole::Trainer(_))),
            Fault::KillEngine => self.kill_process(&plan, |r| matches!(r, ProcessRole::Generation(_))),
            Fault::KillCoordinator => self.kill_process(&plan, |r| *r == ProcessRole::Coordinator),
            Fault::KillStorageUnit => self.kill_process(&plan, |r| matches!(r, ProcessRole::Storage { .. })),
            Fault::DeletePod => {
                let pod = &plan.pods[self.rng.below(plan.pods.len() as u64) as usize].name;
                self.pods_api().delete(pod, &DeleteParams::default()).await?;
                Ok(format!("deleted pod {pod}"))
            }
            Fault::KillOperator => {
                let killed = self.kill_process(&plan, |r| matches!(r, ProcessRole::Trainer(_)))?;
                // The operator sees the dead rank, restarts the gang, and dies in the middle.
                tokio::time::sleep(Duration::from_millis(800 + self.rng.below(700))).await;
                self.operator.kill();
                tokio::time::sleep(Duration::from_secs(1)).await;
                self.operator =
                    OperatorProcess::start(&self.binary, &self.setup.namespace, &["--image-pull-policy", "Never"])?;
                Ok(format!("{killed}, then killed the operator and started another"))
            }
            Fault::RestartApiServer => self.restart_component("kube-apiserver").await,
            Fault::RestartEtcd => self.restart_component("etcd").await,
            Fault::Partition => {
                let trainer = self.pod(&plan.pods[0].name).await?;
                let engines: Vec<_> = plan.pods.iter().filter(|p| p.name.contains("-gen-")).collect();
                let pick = self.rng.below(engines.len() as u64) as usize;
                let engine = self.pod(&engines[pick].name).await?;
                let ip = engine.status.as_ref().and_then(|s| s.pod_ip.clone()).context("the engine pod's IP")?;
                let node = &self.setup.node;
                let rules = [["INPUT", "-s"], ["OUTPUT", "-d"]];
                for [chain, dir] in rules {
                    node.in_network_of(&trainer, WORKER_CONTAINER, &["iptables", "-I", chain, dir, &ip, "-j", "DROP"])?;
                }
                tokio::time::sleep(Duration::from_secs(3)).await;
                for [chain, dir] in rules {
                    node.in_network_of(&trainer, WORKER_CONTAINER, &["iptables", "-D", chain, dir, &ip, "-j", "DROP"])?;
                }
                Ok(format!("partitioned {} from {} for 3 s", trainer.name_any(), engine.name_any()))
            }
            Fault::KillUserTrainer => self.kill_user_process(&plan, "/scripts/trainer.py"),
            Fault::KillUserEngine => self.kill_user_process(&plan, "/scripts/engine.py"),
            Fault::KillSidecar => {
                self.kill_process(&plan, |r| matches!(r, ProcessRole::Trainer(_) | ProcessRole::Generation(_)))
            }
            Fault::SlowLink => {
                let pick = self.rng.below(plan.pods.len() as u64) as usize;
                let pod = self.pod(&plan.pods[pick].name).await?;
                let node = &self.setup.node;
                let tbf = ["tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", "4mbit", "burst", "32kbit"];
                node.in_network_of(&pod, WORKER_CONTAINER, &[&tbf[..], &["latency", "200ms"]].concat())?;
                tokio::time::sleep(Duration::from_secs(5)).await;
                node.in_network_of(&pod, WORKER_CONTAINER, &["tc", "qdisc", "del", "dev", "eth0", "root"])?;
                Ok(format!("slowed {}'s link to 4 Mbit/s for 5 s", pod.name_any()))
            }
        }
    }

    /// `kill -9` of a process of the plan whose role `pick` accepts, chosen at random, found on
    /// this machine by its process name and its pod (`RLPLANE_POD` in its environment).
    fn kill_process(&mut self, plan: &WorkerPlan, pick: impl Fn(&ProcessRole) -> bool) -> anyhow::Result<String> {
        let candidates: Vec<_> = plan.processes.iter().filter(|p| pick(&p.role)).collect();
        anyhow::ensure!(!candidates.is_empty(), "the plan has no such process");
        let p = candidates[self.rng.below(candidates.len() as u64) as usize];
        let pod = &plan.pods[p.pod as usize].name;
        // A rank's process may still be starting: look for it a few seconds.
        let named = |args: &[&[u8]]| args.windows(2).any(|w| w[0] == b"--process" && w[1] == p.name.as_bytes());
        let pid =
            wait_for_pid(pod, named).with_context(|| format!("no process {} of pod {pod} on this machine", p.name))?;
        // SAFETY: kill(2) on a pid just found running; no memory is involved.
        anyhow::ensure!(
            unsafe { libc::kill(pid, libc::SIGKILL) } == 0,
            "kill {pid}: {}",
            std::io::Error::last_os_error()
        );
        Ok(format!("kill -9 {} of pod {pod}", p.name))
    }

    /// `kill -9` of the user's process running `script` (a Python script of the client's tests,
    /// not its `launch.py`) in whichever of the job's pods runs it.
    fn kill_user_process(&mut self, plan: &WorkerPlan, script: &str) -> anyhow::Result<String> {
        let runs = |args: &[&[u8]]| args.get(1) == Some(&script.as_bytes());
        for pod in &plan.pods {
            if let Some(pid) = wait_for_pid(&pod.name, runs) {
                // SAFETY: kill(2) on a pid just found running; no memory is involved.
                anyhow::ensure!(unsafe { libc::kill(pid, libc::SIGKILL) } == 0, "kill {pid}");
                return Ok(format!("kill -9 the user's {script} of pod {}", pod.name));
            }
        }
        let seen: Vec<String> = std::fs::read_dir("/proc")?
            .flatten()
            .filter_map(|e| {
                let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
                let text = String::from_utf8_lossy(&cmdline).replace('\0', " ");
                text.contains(script).then(|| {
                    let env = std::fs::read(e.path().join("environ")).unwrap_or_default();
                    let pod =
                        env.split(|b| *b == 0).find(|v| v.starts_with(b"RLPLANE_POD=") || v.starts_with(b"HOSTNAME="));
                    format!(
                        "{}: {text} ({})",
                        e.file_name().to_string_lossy(),
                        pod.map(String::from_utf8_lossy).unwrap_or_default()
                    )
                })
            })
            .collect();
        bail!("no process runs {script} in the job's pods; processes naming it: {seen:#?}")
    }

    /// Kills control-plane component `name` (as `e2e/cluster/up` recorded it in its `pids` file)
    /// with SIGKILL, starts it again with the same command line and log, records the new pid, and
    /// waits until the API server answers again.
    async fn restart_component(&self, name: &str) -> anyhow::Result<String> {
        let pids_file = self.state.join("pids");
        let pids = std::fs::read_to_string(&pids_file)?;
        let (pid, exe) = pids
            .lines()
            .find_map(|l| {
                let mut w = l.split_whitespace();
                (w.next() == Some(name))
                    .then(|| Some((w.next()?.parse::<i32>().ok()?, w.next()?.to_string())))
                    .flatten()
            })
            .with_context(|| format!("{name} is not in {}", pids_file.display()))?;
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline"))?;
        let args: Vec<String> = cmdline
            .split(|b| *b == 0)
            .filter(|a| !a.is_empty())
            .skip(1)
            .map(|a| String::from_utf8_lossy(a).into())
            .collect();
        // SAFETY: kill(2) of the component's recorded pid.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        // Its listening sockets close late in its exit (after /proc/PID/exe goes): wait until it
        // is a zombie or gone, and start it again until one start keeps running (a port still in
        // use makes a start exit at once).
        while alive(pid) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let log_path = self.state.join(format!("logs/{name}.log"));
        let mut tries = 0;
        let child = loop {
            let log = std::fs::OpenOptions::new().append(true).open(&log_path)?;
            let mut child = std::process::Command::new("setsid")
                .arg(&exe)
                .args(&args)
                .stdin(std::process::Stdio::null())
                .stdout(log.try_clone()?)
                .stderr(log)
                .spawn()
                .with_context(|| format!("starting {exe}"))?;
            tokio::time::sleep(Duration::from_millis(1500)).await;
            match child.try_wait()? {
                None => break child,
                Some(status) if tries < 10 => {
                    tries += 1;
                    println!("{name} exited at once ({status}); starting it again");
                }
                Some(status) => bail!("{name} keeps exiting ({status}); see {}", log_path.display()),
            }
        };
        let new_pid = child.id();
        let updated: Vec<String> =
            pids.lines()
                .map(|l| {
                    if l.split_whitespace().next() == Some(name) { format!("{name} {new_pid} {exe}") } else { l.into() }
                })
                .collect();
        std::fs::write(&pids_file, updated.join("\n") + "\n")?;
        let deadline = Instant::now() + Duration::from_secs(90);
        while !kubectl(&["get", "--raw", "/readyz"]).map(|r| r.0).unwrap_or(false) {
            anyhow::ensure!(Instant::now() < deadline, "the API server is not ready 90 s after {name} restarted");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Ok(format!("killed {name} (pid {pid}) and started it again (pid {new_pid})"))
    }

    /// Waits until the job steps again after a fault injected at `t` into it as it stood in
    /// `before`: a step of a new epoch beyond the checkpoint it resumed from, or, without a
    /// restart, a step beyond the one before the fault — and then [`SETTLE`] more steps in that
    /// epoch, so that a restart the fault causes later is still the fault's. Returns whether the
    /// gang restarted, and when the job first stepped again.
    async fn recovered(&mut self, job: &str, before: &RLJob, t: Instant) -> anyhow::Result<(bool, Duration)> {
        let mut epoch = epoch_of(before);
        let mut step = before.status.as_ref().and_then(|s| s.step).unwrap_or(0);
        let mut restarted = false;
        let mut stepped: Option<(u64, Duration)> = None;
        let mut stale: Option<u64> = None;
        loop {
            let j = self.jobs_api().get(job).await?;
            let st = j.status.clone().unwrap_or_default();
            anyhow::ensure!(st.phase != Phase::Failed, "{job} failed: {:?}", rlplane_e2e::condition(&j, "Failed"));
            if let Some((status, _, message)) = rlplane_e2e::condition(&j, "Restarting")
                && status == "True"
                && !self.restart_messages.contains(&message)
            {
                println!("  {job} restarts: {message}");
                self.restart_messages.push(message);
            }
            if st.phase == Phase::Succeeded {
                return Ok((restarted || st.epoch > epoch_of(before), stepped.map_or(t.elapsed(), |s| s.1)));
            }
            let now = st.step.unwrap_or(0);
            if st.epoch > epoch {
                // A restart: the new epoch counts from the checkpoint it resumed from, and only
                // once its coordinator has written (the old epoch's step stays until then).
                (epoch, step, restarted, stepped) =
                    (st.epoch, st.resumed_from.as_ref().map_or(0, |c| c.step), true, None);
                stale = Some(now);
            }
            if stale.is_some_and(|s| s != now) {
                stale = None;
            }
            if st.epoch == epoch && st.phase == Phase::Running && now > step && stale.is_none() {
                let (first, at) = *stepped.get_or_insert((now, t.elapsed()));
                if now >= first + SETTLE {
                    return Ok((restarted, at));
                }
            }
            anyhow::ensure!(t.elapsed() < RECOVERY_LIMIT, "{job} did not step again within {RECOVERY_LIMIT:?}: {st:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Runs the last job to its end.
    async fn finish(&self, job: &str) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(600);
        loop {
            let j = self.jobs_api().get(job).await?;
            match phase_of(&j) {
                Some(Phase::Succeeded) => return Ok(()),
                Some(Phase::Failed) => bail!("{job} failed: {:?}", rlplane_e2e::condition(&j, "Failed")),
                _ => {}
            }
            anyhow::ensure!(Instant::now() < deadline, "{job} did not finish within 600 s");
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// Prints the campaign's table and fails on a job that did not succeed or a violation.
    async fn report(&self, done: &[Injected], took: Duration) -> anyhow::Result<()> {
        let mut completed = 0;
        let mut restarts = 0;
        let mut notes = Vec::new();
        for job in &self.jobs {
            let j = self.jobs_api().get(job).await?;
            let st = j.status.clone().unwrap_or_default();
            anyhow::ensure!(st.phase == Phase::Succeeded, "{job}: {:?}", st.phase);
            let steps = u64::from(j.spec.workload.steps);
            anyhow::ensure!(st.step == Some(steps), "{job}: every step of its last epoch: {:?} of {steps}", st.step);
            completed += 1;
            restarts += st.restarts;
            for n in rlplane_e2e::gang_restart_notes(&self.setup.client, &self.setup.namespace, job).await? {
                if !notes.contains(&n) {
                    notes.push(n);
                }
            }
        }
        for m in &self.restart_messages {
            if !notes.iter().any(|n| n.starts_with(m.as_str()) || m.starts_with(n.as_str())) {
                notes.push(m.clone());
            }
        }
        println!("\nfault campaign: {} faults in {:.0} s", done.len(), took.as_secs_f64());
        println!("| fault | injected | gang restarted | recovery p50 | recovery max |");
        println!("|---|---:|---:|---:|---:|");
        let mut by_kind: BTreeMap<Fault, Vec<&Injected>> = BTreeMap::new();
        for d in done {
            by_kind.entry(d.fault).or_default().push(d);
        }
        for (kind, list) in &by_kind {
            let secs: Vec<f64> = list.iter().map(|d| d.recovery.as_secs_f64()).collect();
            println!(
                "| {} | {} | {} | {:.1} s | {:.1} s |",
                kind.name(),
                list.len(),
                list.iter().filter(|d| d.restarted).count(),
                percentile(&secs, 0.5),
                percentile(&secs, 1.0)
            );
        }
        let all: Vec<f64> = done.iter().map(|d| d.recovery.as_secs_f64()).collect();
        println!(
            "| **all** | {} | {} | {:.1} s | {:.1} s (p99 {:.1} s) |",
            done.len(),
            done.iter().filter(|d| d.restarted).count(),
            percentile(&all, 0.5),
            percentile(&all, 1.0),
            percentile(&all, 0.99)
        );
        println!(
            "\njobs completed: {completed} of {} ({STEPS} steps each, {USER_STEPS} for the user's containers), gang restarts: {restarts}",
            self.jobs.len()
        );
        let mut violations: BTreeMap<&str, Vec<&String>> = VIOLATIONS.iter().map(|(c, _)| (*c, Vec::new())).collect();
        for n in &notes {
            for (column, text) in VIOLATIONS {
                if n.contains(text) {
                    violations.entry(column).or_default().push(n);
                }
            }
        }
        for (column, found) in &violations {
            println!("{column}: {}", found.len());
        }
        let (lost, twice) = claimed_vs_put(&notes);
        println!("of which rollouts lost: {lost}, rollouts delivered twice: {twice}");
        println!("\nwhy each gang restarted (its GangRestart Event or Restarting condition):");
        for n in &notes {
            println!("  {n}");
        }
        for d in done {
            println!("  [{}] {}", d.job, d.what);
        }
        let total: usize = violations.values().map(Vec::len).sum();
        anyhow::ensure!(total == 0, "{total} integrity violations: {violations:?}");
        Ok(())
    }
}

/// Of the claim checks that failed ("claimed A samples but the producers put B"): how many
/// claimed fewer (rollouts lost) and how many more (rollouts delivered twice).
fn claimed_vs_put(notes: &[String]) -> (usize, usize) {
    let (mut lost, mut twice) = (0, 0);
    for n in notes {
        let Some((_, rest)) = n.split_once("claimed ") else { continue };
        let mut words = rest.split_whitespace();
        let claimed = words.next().and_then(|w| w.parse::<u64>().ok());
        let put = rest
            .split_once("producers put ")
            .and_then(|(_, p)| p.split(|c: char| !c.is_ascii_digit()).next()?.parse::<u64>().ok());
        match (claimed, put) {
            (Some(c), Some(p)) if c < p => lost += 1,
            (Some(c), Some(p)) if c > p => twice += 1,
            _ => {}
        }
    }
    (lost, twice)
}

/// Whether process `pid` still runs (exists and is not a zombie).
fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command's closing parenthesis.
        Ok(stat) => stat.rsplit_once(')').is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

#[test]
fn a_failed_claim_check_counts_as_lost_or_twice() {
    let n = |a, b| format!("pod p: …: error: step 4: claimed {a} samples but the producers put {b}; gang restart");
    assert_eq!(claimed_vs_put(&[n(63, 64), n(65, 64), n(64, 64), "pod q: was killed by signal 9".into()]), (1, 1));
}

fn percentile(v: &[f64], p: f64) -> f64 {
    let mut v = v.to_vec();
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// The pid, on this machine, of a process of pod `pod` (its environment names the pod, as
/// `RLPLANE_POD` or the container's `HOSTNAME`) whose arguments `matches` accepts; looked for a
/// few seconds (a process may still be starting).
fn wait_for_pid(pod: &str, matches: impl Fn(&[&[u8]]) -> bool) -> Option<i32> {
    for _ in 0..50 {
        if let Some(pid) = host_pid(pod, &matches) {
            return Some(pid);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    None
}

fn host_pid(pod: &str, matches: &impl Fn(&[&[u8]]) -> bool) -> Option<i32> {
    let names = [format!("RLPLANE_POD={pod}"), format!("HOSTNAME={pod}")];
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else { continue };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else { continue };
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        if !matches(&args) {
            continue;
        }
        let Ok(environ) = std::fs::read(entry.path().join("environ")) else { continue };
        if environ.split(|b| *b == 0).any(|v| names.iter().any(|n| v == n.as_bytes())) {
            return Some(pid);
        }
    }
    None
}
