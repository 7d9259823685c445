//! The operator's decisions, pure: gang semantics, lifecycle, status and Events, driven through
//! whole scenarios on an in-memory cluster (no API server).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use k8s_openapi::api::core::v1::{
    ContainerState, ContainerStateTerminated, ContainerStateWaiting, ContainerStatus, Pod, PodCondition, PodStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use rlplane_api::{CheckpointRef, GangScheduler, LastRefit, Phase, RLJob, RLJobStatus, RoleCounts, load_rljob};
use rlplane_operator::conditions::{self, reasons};
use rlplane_operator::decide::{Decision, RESYNC, Step, WAIT_FOR_PODS, create_failed, decide};
use rlplane_operator::desired::{OperatorConfig, labels};
use rlplane_operator::observe::FailureKind;

const UID: &str = "6f1c-uid";

fn job(file: &str) -> RLJob {
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../manifests").join(file)).unwrap();
    let mut job = load_rljob(&text).unwrap();
    job.metadata.namespace = Some("ml".into());
    job.metadata.uid = Some(UID.into());
    job.metadata.generation = Some(1);
    job
}

fn cfg() -> OperatorConfig {
    OperatorConfig { worker_image: "rlplane-worker:test".into(), image_pull_policy: None }
}

fn t(s: i64) -> Timestamp {
    Timestamp::from_second(1_800_000_000 + s).unwrap()
}

/// A cluster in memory: the job, its pods, and what the decisions did to them.
struct Sim {
    job: RLJob,
    pods: Vec<Pod>,
    now: Timestamp,
    next_uid: u32,
    deleted_job: bool,
    deleted_objects: u32,
}

impl Sim {
    fn new(job: RLJob) -> Sim {
        Sim { job, pods: Vec::new(), now: t(0), next_uid: 0, deleted_job: false, deleted_objects: 0 }
    }

    /// Decides and applies the decision's effects the way the API server would: pods created
    /// Pending, deleted pods terminating (gone after `kubelet_gc`), status written.
    fn step(&mut self) -> Decision {
        let d = decide(&self.job, &self.pods, self.now, &cfg());
        for s in &d.steps {
            match s {
                Step::CreatePods(pods) => {
                    for p in pods {
                        let mut p = p.clone();
                        assert!(!self.pods.iter().any(|x| x.metadata.name == p.metadata.name), "name clash");
                        self.next_uid += 1;
                        p.metadata.uid = Some(format!("pod-uid-{}", self.next_uid));
                        p.status = Some(PodStatus { phase: Some("Pending".into()), ..Default::default() });
                        self.pods.push(p);
                    }
                }
                Step::DeletePods(refs) => {
                    for r in refs {
                        let p = self.pods.iter_mut().find(|p| p.metadata.name.as_ref() == Some(&r.name)).unwrap();
                        assert_eq!(p.metadata.uid, r.uid, "deletes are conditioned on the uid");
                        p.metadata.deletion_timestamp = Some(Time(self.now));
                    }
                }
                Step::WriteStatus(st) => {
                    assert_eq!(
                        (st.step, &st.last_refit, &st.checkpoint, &st.scalars, &st.stall),
                        (None, &None, &None, &None, &None),
                        "the operator never writes the coordinator's step, lastRefit, checkpoint, scalars, stall"
                    );
                    // As a server-side apply under its own field manager: the coordinator's
                    // fields stay.
                    let old = self.job.status.take().unwrap_or_default();
                    self.job.status = Some(RLJobStatus {
                        step: old.step,
                        last_refit: old.last_refit,
                        checkpoint: old.checkpoint,
                        scalars: old.scalars,
                        stall: old.stall,
                        ..(**st).clone()
                    });
                }
                Step::DeleteJob => self.deleted_job = true,
                Step::DeleteObjects => self.deleted_objects += 1,
                Step::ApplyObjects(_) | Step::DeletePodGroups(_) | Step::Publish(_) => {}
            }
        }
        d
    }

    /// Terminating pods disappear.
    fn kubelet_gc(&mut self) {
        self.pods.retain(|p| p.metadata.deletion_timestamp.is_none());
    }

    /// The pod of the job's current epoch that the first epoch names `name` (later epochs add
    /// `-e<epoch>`).
    fn pod(&mut self, name: &str) -> &mut Pod {
        let epoch = self.job.status.as_ref().map_or(0, |s| s.epoch);
        let name = if epoch == 0 { name.to_string() } else { format!("{name}-e{epoch}") };
        self.pods
            .iter_mut()
            .find(|p| p.metadata.name.as_deref() == Some(&name))
            .unwrap_or_else(|| panic!("no pod {name}"))
    }

    fn set_all_ready(&mut self) {
        for p in &mut self.pods {
            set_ready(p, true);
        }
    }

    fn status(&self) -> &RLJobStatus {
        self.job.status.as_ref().unwrap()
    }

    fn condition(&self, type_: &str) -> (String, String, String) {
        let c = conditions::find(&self.status().conditions, type_).unwrap_or_else(|| panic!("no {type_}"));
        (c.status.clone(), c.reason.clone(), c.message.clone())
    }

    /// Brings a job to Running at epoch 0.
    fn running(job: RLJob) -> Sim {
        let mut sim = Sim::new(job);
        sim.step();
        sim.set_all_ready();
        sim.now = t(30);
        sim.step();
        assert_eq!(sim.status().phase, Phase::Running);
        sim
    }
}

fn set_ready(p: &mut Pod, ready: bool) {
    let st = p.status.get_or_insert_with(Default::default);
    st.phase = Some("Running".into());
    st.conditions = Some(vec![PodCondition {
        type_: "Ready".into(),
        status: if ready { "True" } else { "False" }.into(),
        ..Default::default()
    }]);
}

fn terminated(name: &str, code: i32, reason: &str, at: i64) -> ContainerStatus {
    ContainerStatus {
        name: name.into(),
        state: Some(ContainerState {
            terminated: Some(ContainerStateTerminated {
                exit_code: code,
                reason: Some(reason.into()),
                finished_at: Some(Time(t(at))),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn fail_container(p: &mut Pod, code: i32, reason: &str, at: i64) {
    let st = p.status.get_or_insert_with(Default::default);
    st.phase = Some("Failed".into());
    st.container_statuses = Some(vec![terminated("rlplane-worker", code, reason, at)]);
}

/// As [`fail_container`], with the termination message the worker wrote.
fn fail_container_saying(p: &mut Pod, code: i32, at: i64, message: &str) {
    fail_container(p, code, "Error", at);
    let st = p.status.as_mut().and_then(|s| s.container_statuses.as_mut()).unwrap();
    st[0].state.as_mut().and_then(|s| s.terminated.as_mut()).unwrap().message = Some(message.into());
}

fn steps(d: &Decision) -> Vec<&'static str> {
    d.steps
        .iter()
        .map(|s| match s {
            Step::ApplyObjects(_) => "ApplyObjects",
            Step::CreatePods(_) => "CreatePods",
            Step::WriteStatus(_) => "WriteStatus",
            Step::DeletePods(_) => "DeletePods",
            Step::DeleteObjects => "DeleteObjects",
            Step::DeletePodGroups(_) => "DeletePodGroups",
            Step::DeleteJob => "DeleteJob",
            Step::Publish(_) => "Publish",
        })
        .collect()
}

fn event_reasons(d: &Decision) -> Vec<String> {
    d.events().map(|e| e.reason.clone()).collect()
}

fn pod_names(d: &Decision) -> Vec<String> {
    d.steps
        .iter()
        .flat_map(|s| match s {
            Step::CreatePods(p) => p.iter().map(|p| p.metadata.name.clone().unwrap()).collect(),
            Step::DeletePods(p) => p.iter().map(|p| p.name.clone()).collect(),
            _ => Vec::new(),
        })
        .collect()
}

#[test]
fn a_new_job_gets_its_objects_then_its_pods_then_status_starting() {
    let mut sim = Sim::new(job("rljob-cpu.yaml"));
    let d = sim.step();
    assert_eq!(steps(&d), ["ApplyObjects", "CreatePods", "WriteStatus", "Publish"]);
    assert_eq!(pod_names(&d), ["grpo-cpu-trainer-0", "grpo-cpu-gen-0", "grpo-cpu-gen-1"]);
    let st = sim.status();
    assert_eq!((st.phase, st.epoch, st.restarts, st.observed_generation), (Phase::Starting, 0, 0, Some(1)));
    assert_eq!(st.start_time, Some(Time(t(0))));
    assert_eq!(st.roles.trainer, RoleCounts { ready: 0, total: 1 });
    assert_eq!(st.roles.generation, RoleCounts { ready: 0, total: 2 });
    assert_eq!(
        sim.condition(conditions::PODS_CREATED),
        ("True".into(), "PodsCreated".into(), "created 3 pods for epoch 0".into())
    );
    assert_eq!(sim.condition(conditions::PODS_READY).0, "False");
    // Every condition is present from the first write, so `kubectl wait` works on any of them.
    let types: Vec<_> = st.conditions.iter().map(|c| c.type_.as_str()).collect();
    assert_eq!(types, conditions::ALL);
    assert_eq!(event_reasons(&d), ["PodsCreated"]);
    assert_eq!(d.requeue_after, Some(RESYNC));
    // The applied objects are the job's: RBAC for the coordinator, Service, plan.
    let Step::ApplyObjects(objects) = &d.steps[0] else { unreachable!() };
    assert!(objects.pods.is_empty(), "pods are created separately, once");
    assert_eq!(objects.role.metadata.name.as_deref(), Some("grpo-cpu-worker"));
}

#[test]
fn nothing_changes_on_a_reconcile_that_observes_nothing_new() {
    let mut sim = Sim::new(job("rljob-cpu.yaml"));
    sim.step();
    let before = sim.job.status.clone();
    sim.now = t(100);
    let d = sim.step();
    // Only the idempotent apply of the objects: no status write (no value changes on every
    // reconcile), no event, no pod created twice.
    assert_eq!(steps(&d), ["ApplyObjects"]);
    assert_eq!(sim.job.status, before);
}

#[test]
fn all_pods_ready_makes_the_job_running_and_it_stays_running() {
    let mut sim = Sim::new(job("rljob-cpu.yaml"));
    sim.step();
    set_ready(sim.pod("grpo-cpu-trainer-0"), true);
    sim.now = t(10);
    let d = sim.step();
    assert_eq!(sim.status().phase, Phase::Starting);
    assert_eq!(sim.condition(conditions::PODS_READY), ("False".into(), "PodsNotReady".into(), "1/3 pods ready".into()));
    assert_eq!(steps(&d), ["ApplyObjects", "WriteStatus"]);
    let ready_since =
        conditions::find(&sim.status().conditions, conditions::PODS_READY).unwrap().last_transition_time.clone();

    sim.set_all_ready();
    sim.now = t(20);
    let d = sim.step();
    let st = sim.status();
    assert_eq!(st.phase, Phase::Running);
    assert_eq!(st.roles.generation, RoleCounts { ready: 2, total: 2 });
    assert_eq!(sim.condition(conditions::RUNNING).0, "True");
    assert_eq!(sim.condition(conditions::PODS_READY), ("True".into(), "AllPodsReady".into(), "3/3 pods ready".into()));
    assert_eq!(event_reasons(&d), ["Running"]);
    let c = conditions::find(&st.conditions, conditions::PODS_READY).unwrap();
    assert_eq!(c.last_transition_time, Time(t(20)), "PodsReady flipped");
    assert_ne!(c.last_transition_time, ready_since);
    let created = conditions::find(&st.conditions, conditions::PODS_CREATED).unwrap();
    assert_eq!(created.last_transition_time, Time(t(0)), "PodsCreated did not flip: its time stays");

    // A pod going unready (or a rank finishing before the coordinator) does not stop Running.
    set_ready(sim.pod("grpo-cpu-gen-1"), false);
    sim.now = t(30);
    let d = sim.step();
    assert_eq!(sim.status().phase, Phase::Running);
    assert_eq!(sim.condition(conditions::PODS_READY).2, "2/3 pods ready");
    assert!(event_reasons(&d).is_empty());
}

#[test]
fn pods_the_scheduler_cannot_place_say_so_in_pods_ready() {
    let mut sim = Sim::new(job("rljob-cpu.yaml"));
    sim.step();
    let why = "0/4 nodes are available: 4 Insufficient nvidia.com/gpu.";
    sim.pod("grpo-cpu-gen-1").status.as_mut().unwrap().conditions = Some(vec![PodCondition {
        type_: "PodScheduled".into(),
        status: "False".into(),
        reason: Some("Unschedulable".into()),
        message: Some(why.into()),
        ..Default::default()
    }]);
    sim.now = t(10);
    sim.step();
    assert_eq!(sim.status().phase, Phase::Starting, "an unplaced pod is no failure: the gang waits");
    assert_eq!(
        sim.condition(conditions::PODS_READY),
        (
            "False".into(),
            reasons::UNSCHEDULABLE.into(),
            format!("0/3 pods ready; 1 cannot be scheduled (pod grpo-cpu-gen-1: {why})")
        )
    );
}

#[test]
fn a_container_that_cannot_start_says_which_pod_and_why_in_pods_ready() {
    let mut sim = Sim::new(job("rljob-cpu.yaml"));
    sim.step();
    let why = "Container image \"ghcr.io/rlplane/nope:0\" is not present with pull policy of Never";
    sim.pod("grpo-cpu-trainer-0").status.as_mut().unwrap().container_statuses = Some(vec![ContainerStatus {
        name: "rlplane-worker".into(),
        state: Some(ContainerState {
            waiting: Some(ContainerStateWaiting {
                reason: Some("ErrImageNeverPull".into()),
                message: Some(why.into()),
            }),
            ..Default::default()
        }),
        ..Default::default()
    }]);
    sim.now = t(10);
    let d = sim.step();
    assert_eq!(sim.status().phase, Phase::Starting, "no failure: the gang waits, as a Job's pods do");
    assert_eq!(d.restart, None);
    assert_eq!(
        sim.condition(conditions::PODS_READY),
        (
            "False".into(),
            reasons::CONTAINERS_NOT_STARTING.into(),
            format!("0/3 pods ready; pod grpo-cpu-trainer-0: container rlplane-worker: ErrImageNeverPull: {why}")
        )
    );
}

#[test]
fn a_failed_pod_restarts_the_whole_gang_with_a_new_epoch() {
    let mut sim = Sim::running(job("rljob-cpu.yaml"));
    sim.job.status.as_mut().unwrap().step = Some(7);
    fail_container(sim.pod("grpo-cpu-gen-1"), 137, "OOMKilled", 40);
    sim.now = t(45);
    let d = sim.step();
    // Status first (the intent survives a crash), then every pod of the gang.
    assert_eq!(steps(&d), ["WriteStatus", "DeletePods", "Publish"]);
    assert_eq!(pod_names(&d), ["grpo-cpu-trainer-0", "grpo-cpu-gen-0", "grpo-cpu-gen-1"]);
    assert_eq!(d.restart, Some(FailureKind::ContainerFailed));
    let st = sim.status();
    assert_eq!((st.phase, st.epoch, st.restarts), (Phase::Restarting, 1, 1));
    assert_eq!(st.step, Some(7), "the coordinator's fields are untouched");
    let (status, reason, message) = sim.condition(conditions::RESTARTING);
    assert_eq!((status.as_str(), reason.as_str()), ("True", "ContainerFailed"));
    assert_eq!(
        message,
        "pod grpo-cpu-gen-1: container rlplane-worker exited with code 137 (OOMKilled); gang restart 1/3 with epoch 1"
    );
    assert_eq!(sim.condition(conditions::PODS_CREATED).1, reasons::RESTARTING);
    let ev = d.events().next().unwrap();
    assert!(ev.warning && ev.reason == "GangRestart" && ev.note.contains("grpo-cpu-gen-1"), "{ev:?}");
    assert_eq!(d.requeue_after, Some(WAIT_FOR_PODS));

    // The old pods are terminating: the gang of epoch 1 is created beside them under names of
    // its own, after the plan (and its token) of the new epoch; the terminating pods of epoch 0
    // are not failures of epoch 1.
    sim.now = t(46);
    let d = sim.step();
    assert_eq!(steps(&d), ["ApplyObjects", "CreatePods", "WriteStatus", "Publish"]);
    let Step::ApplyObjects(objects) = &d.steps[0] else { unreachable!() };
    assert_eq!(objects.plan.job.epoch, 1, "the plan (and its token) of the new epoch is in place first");
    assert_eq!(pod_names(&d), ["grpo-cpu-trainer-0-e1", "grpo-cpu-gen-0-e1", "grpo-cpu-gen-1-e1"]);
    assert_eq!(sim.pods.len(), 6, "three terminating, three new");
    let st = sim.status();
    assert_eq!((st.phase, st.epoch, st.restarts), (Phase::Starting, 1, 1));
    assert_eq!(st.start_time, Some(Time(t(0))), "the deadline counts from the job's start, not the epoch's");
    assert_eq!(sim.condition(conditions::RESTARTING).0, "False");
    assert_eq!(sim.condition(conditions::RESTARTING).1, reasons::RESTARTED);

    // The old pods go; nothing more is created.
    sim.kubelet_gc();
    sim.now = t(50);
    let d = sim.step();
    assert_eq!(steps(&d), ["ApplyObjects"]);
    assert!(sim.pods.iter().all(|p| p.metadata.labels.as_ref().unwrap()[labels::EPOCH] == "1"));
    assert_eq!(sim.status().phase, Phase::Starting);
    assert_eq!(sim.condition(conditions::RESTARTING).1, reasons::RESTARTED);
}

#[test]
fn exhausting_the_backoff_limit_fails_the_job_naming_the_pod_and_the_reason() {
    let mut j = job("rljob-cpu.yaml");
    j.spec.run_policy.backoff_limit = 1;
    let mut sim = Sim::running(j);
    fail_container(sim.pod("grpo-cpu-trainer-0"), 1, "Error", 31);
    sim.now = t(32);
    sim.step();
    assert_eq!(sim.status().restarts, 1);
    sim.kubelet_gc();
    sim.step();
    sim.set_all_ready();
    sim.step();
    assert_eq!((sim.status().phase, sim.status().epoch), (Phase::Running, 1));

    // The second failure is one too many.
    fail_container(sim.pod("grpo-cpu-gen-0"), 137, "OOMKilled", 88);
    sim.now = t(90);
    let d = sim.step();
    assert_eq!(steps(&d), ["WriteStatus", "DeletePods", "Publish"]);
    assert_eq!(d.restart, None);
    let st = sim.status();
    assert_eq!((st.phase, st.restarts, st.epoch), (Phase::Failed, 1, 1));
    assert_eq!(st.completion_time, Some(Time(t(90))));
    let (status, reason, message) = sim.condition(conditions::FAILED);
    assert_eq!((status.as_str(), reason.as_str()), ("True", "BackoffLimitExceeded"));
    assert_eq!(
        message,
        "pod grpo-cpu-gen-0-e1: container rlplane-worker exited with code 137 (OOMKilled); backoffLimit 1 reached after 1 restarts"
    );
    assert!(d.events().next().unwrap().warning);

    // Final: the pods go, then the objects, then nothing more happens.
    sim.kubelet_gc();
    let d = sim.step();
    assert_eq!(steps(&d), ["DeleteObjects", "WriteStatus"]);
    assert_eq!(sim.condition(conditions::PODS_CREATED).1, reasons::NO_PODS);
    let d = sim.step();
    assert!(d.steps.is_empty(), "{:?}", steps(&d));
    assert_eq!(d.requeue_after, None);
}

/// Restarts the gang of `sim` once more (its pods gone, then all ready at the new epoch).
fn run_again(sim: &mut Sim) {
    sim.kubelet_gc();
    sim.step();
    sim.set_all_ready();
    sim.step();
}

fn evict(p: &mut Pod) {
    let st = p.status.get_or_insert_with(Default::default);
    st.conditions.get_or_insert_with(Vec::new).push(PodCondition {
        type_: "DisruptionTarget".into(),
        status: "True".into(),
        reason: Some("EvictionByEvictionAPI".into()),
        message: Some("Eviction API: evicting".into()),
        ..Default::default()
    });
    // The SIGTERM that follows kills the worker: not its fault.
    st.container_statuses = Some(vec![terminated("rlplane-worker", 143, "Error", 40)]);
}

#[test]
fn disruptions_do_not_burn_the_backoff_limit_and_have_a_limit_of_their_own() {
    let mut j = job("rljob-cpu.yaml");
    j.spec.run_policy.backoff_limit = 0;
    j.spec.run_policy.failure_policy.disruption_limit = 2;
    let mut sim = Sim::running(j);
    for n in 1..=2 {
        evict(sim.pod("grpo-cpu-gen-0"));
        let d = sim.step();
        assert_eq!(d.restart, Some(FailureKind::PodEvicted));
        let st = sim.status();
        assert_eq!((st.phase, st.restarts, st.counted_restarts, st.disruptions), (Phase::Restarting, n, 0, n));
        let message = sim.condition(conditions::RESTARTING).2;
        let victim = if n == 1 { "grpo-cpu-gen-0".to_string() } else { format!("grpo-cpu-gen-0-e{}", n - 1) };
        assert_eq!(
            message,
            format!(
                "pod {victim}: disrupted (EvictionByEvictionAPI): Eviction API: evicting; gang restart with epoch {n}, a disruption: {n}/2 of disruptionLimit"
            )
        );
        run_again(&mut sim);
    }
    evict(sim.pod("grpo-cpu-gen-1"));
    sim.step();
    let (status, reason, message) = sim.condition(conditions::FAILED);
    assert_eq!((status.as_str(), reason.as_str()), ("True", reasons::DISRUPTION_LIMIT_EXCEEDED));
    assert!(message.ends_with("; disruptionLimit 2 reached after 2 disruptions"), "{message}");
}

#[test]
fn failure_policy_rules_ignore_count_or_fail_the_job_and_say_which_rule() {
    use rlplane_api::{ExitCodeOperator, ExitCodesMatcher, FailureAction, FailureRule, PodConditionMatcher};
    let rule = |action, values: &[i32]| FailureRule {
        action,
        on_exit_codes: Some(ExitCodesMatcher {
            container_name: Some("rlplane-worker".into()),
            operator: ExitCodeOperator::In,
            values: values.to_vec(),
        }),
        on_pod_conditions: None,
    };
    let mut j = job("rljob-cpu.yaml");
    j.spec.run_policy.backoff_limit = 1;
    j.spec.run_policy.failure_policy.rules = vec![
        rule(FailureAction::FailJob, &[42]),
        rule(FailureAction::Ignore, &[75]),
        FailureRule {
            action: FailureAction::Count,
            on_exit_codes: None,
            on_pod_conditions: Some(vec![PodConditionMatcher { type_: "DisruptionTarget".into() }]),
        },
    ];
    let mut sim = Sim::running(j);

    // Ignore: a restart that counts nowhere.
    fail_container(sim.pod("grpo-cpu-trainer-0"), 75, "Error", 31);
    sim.step();
    let st = sim.status();
    assert_eq!((st.restarts, st.counted_restarts, st.disruptions), (1, 0, 0));
    assert!(
        sim.condition(conditions::RESTARTING)
            .2
            .ends_with("; gang restart with epoch 1, not counted (failurePolicy rule 1: Ignore)"),
        "{:?}",
        sim.condition(conditions::RESTARTING)
    );
    run_again(&mut sim);

    // Count: this disruption counts against backoffLimit, as the rule says.
    evict(sim.pod("grpo-cpu-gen-0"));
    sim.step();
    let st = sim.status();
    assert_eq!((st.restarts, st.counted_restarts, st.disruptions), (2, 1, 0));
    assert!(
        sim.condition(conditions::RESTARTING)
            .2
            .ends_with("; gang restart 1/1 with epoch 2 (failurePolicy rule 2: Count)"),
        "{:?}",
        sim.condition(conditions::RESTARTING)
    );
    run_again(&mut sim);

    // FailJob: at once, whatever is left of the limits.
    fail_container(sim.pod("grpo-cpu-gen-1"), 42, "Error", 95);
    let d = sim.step();
    assert_eq!(d.restart, None);
    let (status, reason, message) = sim.condition(conditions::FAILED);
    assert_eq!((status.as_str(), reason.as_str()), ("True", reasons::FAILURE_POLICY));
    assert_eq!(
        message,
        "pod grpo-cpu-gen-1-e2: container rlplane-worker exited with code 42 (Error); the job fails (failurePolicy rule 0: FailJob)"
    );
    assert!(d.events().any(|e| e.warning), "a Warning event");
}

#[test]
fn the_earliest_failure_is_named_as_the_cause() {
    let mut sim = Sim::running(job("rljob-cpu.yaml"));
    // gen-0 died first; the trainer lost its peer afterwards.
    fail_container(sim.pod("grpo-cpu-trainer-0"), 1, "Error", 42);
    fail_container(sim.pod("grpo-cpu-gen-0"), 139, "Error", 40);
    sim.now = t(50);
    sim.step();
    let message = sim.condition(conditions::RESTARTING).2;
    assert!(
        message.starts_with(
            "pod grpo-cpu-gen-0: container rlplane-worker exited with code 139 (Error) (and 1 more pod failed)"
        ),
        "{message}"
    );
}

#[test]
fn within_one_second_the_pod_whose_process_was_killed_is_named() {
    let mut sim = Sim::running(job("rljob-cpu.yaml"));
    // The coordinator (in trainer-0's pod) was killed; gen-0 lost its control channel in the
    // same second, and its pod sorts first by name.
    let gen0 = "pod grpo-cpu-gen-0: gen-0 exited with code 1: the coordinator closed the control channel";
    fail_container_saying(sim.pod("grpo-cpu-gen-0"), 1, 40, gen0);
    let trainer0 = "pod grpo-cpu-trainer-0: coordinator (coordinator) was killed by signal 9";
    fail_container_saying(sim.pod("grpo-cpu-trainer-0"), 1, 40, trainer0);
    sim.now = t(50);
    sim.step();
    let message = sim.condition(conditions::RESTARTING).2;
    assert!(
        message.starts_with(
            "pod grpo-cpu-trainer-0: container rlplane-worker exited with code 1 (Error): pod grpo-cpu-trainer-0: coordinator (coordinator) was killed by signal 9 (and 1 more pod failed)"
        ),
        "{message}"
    );
}

#[test]
fn every_kind_of_pod_failure_restarts_the_gang() {
    type Break = fn(&mut Pod);
    let cases: [(&str, Break, FailureKind); 5] = [
        (
            "a container of a running pod terminated non-zero",
            |p| {
                let st = p.status.get_or_insert_with(Default::default);
                st.container_statuses = Some(vec![terminated("vllm", 2, "Error", 1)]);
            },
            FailureKind::ContainerFailed,
        ),
        (
            "the native sidecar restarted",
            |p| {
                let st = p.status.get_or_insert_with(Default::default);
                st.init_container_statuses = Some(vec![ContainerStatus {
                    name: "rlplane-worker".into(),
                    restart_count: 1,
                    ..Default::default()
                }]);
            },
            FailureKind::ContainerFailed,
        ),
        (
            "preempted (DisruptionTarget)",
            |p| {
                let st = p.status.get_or_insert_with(Default::default);
                st.conditions.get_or_insert_with(Vec::new).push(PodCondition {
                    type_: "DisruptionTarget".into(),
                    status: "True".into(),
                    reason: Some("PreemptionByScheduler".into()),
                    ..Default::default()
                });
            },
            FailureKind::PodEvicted,
        ),
        ("deleted by someone", |p| p.metadata.deletion_timestamp = Some(Time(t(31))), FailureKind::PodDeleted),
        (
            "phase Failed without container details",
            |p| {
                let st = p.status.get_or_insert_with(Default::default);
                st.phase = Some("Failed".into());
                st.reason = Some("UnexpectedAdmissionError".into());
            },
            FailureKind::PodFailed,
        ),
    ];
    for (what, break_pod, kind) in cases {
        let mut sim = Sim::running(job("rljob-cpu.yaml"));
        break_pod(sim.pod("grpo-cpu-gen-1"));
        let d = sim.step();
        assert_eq!(d.restart, Some(kind), "{what}");
        assert_eq!(sim.status().phase, Phase::Restarting, "{what}");
        assert_eq!(sim.condition(conditions::RESTARTING).1, kind.reason(), "{what}");
    }
}

#[test]
fn a_pod_that_vanished_after_creation_counts_as_deleted() {
    let mut sim = Sim::running(job("rljob-cpu.yaml"));
    sim.pods.retain(|p| p.metadata.name.as_deref() != Some("grpo-cpu-gen-0"));
    let d = sim.step();
    assert_eq!(d.restart, Some(FailureKind::PodDeleted));
    assert_eq!(pod_names(&d), ["grpo-cpu-trainer-0", "grpo-cpu-gen-1"]);
    assert!(sim.condition(conditions::RESTARTING).2.starts_with("pod grpo-cpu-gen-0: the pod is gone"));
}

#[test]
fn pods_of_another_epoch_are_deleted_and_never_counted() {
    let mut sim = Sim::running(job("rljob-cpu.yaml"));
    // A straggler of epoch 0 that failed after the gang moved to epoch 1.
    fail_container(sim.pod("grpo-cpu-gen-0"), 1, "Error", 31);
    sim.step();
    sim.kubelet_gc();
    sim.step();
    let mut straggler = sim.pods[0].clone();
    straggler.metadata.name = Some("grpo-cpu-gen-9".into());
    straggler.metadata.uid = Some("old".into());
    straggler.metadata.labels.as_mut().unwrap().insert(labels::EPOCH.into(), "0".into());
    fail_container(&mut straggler, 1, "Error", 60);
    sim.pods.push(straggler);
    let d = sim.step();
    assert_eq!(d.restart, None);
    assert_eq!(sim.status().restarts, 1);
    assert!(matches!(d.steps.last(), Some(Step::DeletePods(p)) if p.len() == 1 && p[0].name == "grpo-cpu-gen-9"));
}

#[test]
fn pods_the_job_does_not_control_are_ignored() {
    let mut sim = Sim::running(job("rljob-cpu.yaml"));
    let mut foreign = sim.pods[0].clone();
    foreign.metadata.name = Some("someone-elses".into());
    foreign.metadata.owner_references.as_mut().unwrap()[0].uid = "another-job".into();
    fail_container(&mut foreign, 1, "Error", 31);
    sim.pods.push(foreign);
    let d = sim.step();
    assert_eq!(d.restart, None);
    assert!(!pod_names(&d).contains(&"someone-elses".to_string()));
}

#[test]
fn the_coordinator_succeeding_is_the_jobs_success_and_the_rest_is_torn_down() {
    let mut sim = Sim::running(job("rljob-cpu.yaml"));
    // A generation rank exiting 0 first is not a failure, and not a success.
    sim.pod("grpo-cpu-gen-1").status.as_mut().unwrap().phase = Some("Succeeded".into());
    let d = sim.step();
    assert_eq!(sim.status().phase, Phase::Running);
    assert_eq!(d.restart, None);

    let coordinator = sim
        .pods
        .iter()
        .find(|p| p.metadata.labels.as_ref().unwrap().get(labels::COORDINATOR).map(String::as_str) == Some("true"))
        .unwrap()
        .metadata
        .name
        .clone()
        .unwrap();
    let p = sim.pod(&coordinator);
    let st = p.status.as_mut().unwrap();
    st.phase = Some("Succeeded".into());
    // Its native sidecar was stopped with SIGTERM: ignored, as the kubelet does.
    st.init_container_statuses = Some(vec![terminated("rlplane-worker", 143, "Error", 70)]);
    sim.now = t(80);
    let d = sim.step();
    assert_eq!(steps(&d), ["WriteStatus", "DeletePods", "Publish"]);
    let st = sim.status();
    assert_eq!((st.phase, st.completion_time.clone()), (Phase::Succeeded, Some(Time(t(80)))));
    let (status, reason, message) = sim.condition(conditions::SUCCEEDED);
    assert_eq!((status.as_str(), reason.as_str()), ("True", "CoordinatorSucceeded"));
    assert!(message.contains(&coordinator));
    assert_eq!(sim.condition(conditions::RUNNING).0, "False");
    assert_eq!(event_reasons(&d), ["CoordinatorSucceeded"]);
}

#[test]
fn a_sidecar_stopped_after_the_users_containers_exited_0_is_the_pod_completing_not_a_failure() {
    // The kubelet's order on a real node: the regular containers exit 0, the kubelet stops the
    // native sidecar (which may exit non-zero), and only then is the pod's phase Succeeded.
    let mut sim = Sim::running(job("rljob-cpu.yaml"));
    let st = sim.pod("grpo-cpu-gen-1").status.as_mut().unwrap();
    st.container_statuses = Some(vec![terminated("generate", 0, "Completed", 70)]);
    st.init_container_statuses = Some(vec![terminated("rlplane-worker", 1, "Error", 71)]);
    sim.now = t(72);
    let d = sim.step();
    assert_eq!(d.restart, None, "{:?}", steps(&d));
    assert_eq!(sim.status().phase, Phase::Running);

    // The same sidecar exit while a user container still runs is a rank gone: the gang restarts.
    let st = sim.pod("grpo-cpu-gen-1").status.as_mut().unwrap();
    st.container_statuses.as_mut().unwrap().push(ContainerStatus {
        name: "generate-2".into(),
        state: Some(ContainerState { running: Some(Default::default()), ..Default::default() }),
        ..Default::default()
    });
    let d = sim.step();
    assert!(d.restart.is_some(), "{:?}", steps(&d));
}

#[test]
fn suspend_deletes_everything_but_the_job_and_resume_recreates_the_gang() {
    let mut sim = Sim::running(job("rljob-cpu.yaml"));
    sim.job.spec.run_policy.suspend = true;
    sim.job.metadata.generation = Some(2);
    sim.now = t(100);
    let d = sim.step();
    assert_eq!(steps(&d), ["WriteStatus", "DeletePods", "Publish"]);
    let st = sim.status();
    assert_eq!((st.phase, st.epoch, st.restarts), (Phase::Suspended, 1, 0), "the torn-down gang's token is retired");
    assert_eq!(st.start_time, None, "the deadline clock stops");
    assert_eq!(st.roles.trainer, RoleCounts { ready: 0, total: 1 });
    assert_eq!(sim.condition(conditions::SUSPENDED).0, "True");
    assert_eq!(sim.condition(conditions::RUNNING).0, "False");
    assert_eq!(event_reasons(&d), ["Suspended"]);

    // Terminating pods: wait. Gone: the other objects, then NoPods. Then quiet.
    let d = sim.step();
    assert!(d.steps.is_empty(), "{:?}", steps(&d));
    sim.kubelet_gc();
    let d = sim.step();
    assert_eq!(steps(&d), ["DeleteObjects", "WriteStatus"]);
    assert_eq!(sim.deleted_objects, 1);
    let d = sim.step();
    assert!(d.steps.is_empty(), "{:?}", steps(&d));
    assert!(!sim.deleted_job);

    sim.job.spec.run_policy.suspend = false;
    sim.job.metadata.generation = Some(3);
    sim.now = t(200);
    let d = sim.step();
    assert_eq!(steps(&d), ["ApplyObjects", "CreatePods", "WriteStatus", "Publish", "Publish"]);
    assert_eq!(event_reasons(&d), ["Resumed", "PodsCreated"]);
    let st = sim.status();
    assert_eq!((st.phase, st.epoch, st.start_time.clone()), (Phase::Starting, 1, Some(Time(t(200)))));
    assert_eq!(sim.condition(conditions::SUSPENDED), ("False".into(), "Resumed".into(), String::new()));
    assert!(sim.pods.iter().all(|p| p.metadata.labels.as_ref().unwrap()[labels::EPOCH] == "1"));
}

#[test]
fn a_kueue_job_created_suspended_waits_without_creating_anything() {
    let mut j = job("rljob-cpu.yaml");
    j.metadata.labels = Some(BTreeMap::from([(labels::KUEUE_QUEUE.to_string(), "team-a".to_string())]));
    j.spec.run_policy.suspend = true;
    let mut sim = Sim::new(j);
    let d = sim.step();
    // Nothing was ever created, so nothing is deleted.
    assert_eq!(steps(&d), ["WriteStatus", "Publish"]);
    let st = sim.status();
    assert_eq!((st.phase, st.epoch), (Phase::Suspended, 0));
    let (status, _, message) = sim.condition(conditions::SUSPENDED);
    assert_eq!(status, "True");
    assert!(message.contains("Kueue (queue team-a)"), "{message}");
    assert!(sim.pods.is_empty());
    // Kueue admits the job: it flips suspend.
    sim.job.spec.run_policy.suspend = false;
    sim.job.metadata.generation = Some(2);
    sim.step();
    assert_eq!((sim.status().phase, sim.pods.len()), (Phase::Starting, 3));
}

#[test]
fn resuming_while_old_pods_terminate_creates_the_new_gang_beside_them() {
    let mut sim = Sim::running(job("rljob-cpu.yaml"));
    sim.job.spec.run_policy.suspend = true;
    sim.step();
    sim.job.spec.run_policy.suspend = false;
    let d = sim.step();
    assert_eq!(sim.status().phase, Phase::Starting);
    assert_eq!(event_reasons(&d), ["Resumed", "PodsCreated"]);
    assert_eq!(pod_names(&d), ["grpo-cpu-trainer-0-e1", "grpo-cpu-gen-0-e1", "grpo-cpu-gen-1-e1"]);
}

#[test]
fn under_a_gang_scheduler_the_new_gang_waits_for_the_old_one_in_pending() {
    // Its PodGroup is one per job: terminating pods of the old gang would count as members.
    for gang in [GangScheduler::Volcano, GangScheduler::Coscheduling] {
        let mut j = job("rljob-cpu.yaml");
        j.spec.scheduling.gang = gang;
        let mut sim = Sim::running(j);
        sim.job.spec.run_policy.suspend = true;
        sim.step();
        sim.job.spec.run_policy.suspend = false;
        let d = sim.step();
        assert_eq!(sim.status().phase, Phase::Pending);
        assert_eq!(sim.condition(conditions::PODS_CREATED).1, reasons::WAITING_FOR_OLD_PODS);
        assert_eq!(event_reasons(&d), ["Resumed"]);
        assert!(!steps(&d).contains(&"CreatePods"));
        sim.kubelet_gc();
        sim.step();
        assert_eq!(sim.status().phase, Phase::Starting);

        // A failure, too: the restart creates nothing until the old gang is gone.
        sim.set_all_ready();
        sim.step();
        fail_container(sim.pod("grpo-cpu-gen-0"), 1, "Error", 60);
        sim.step();
        let d = sim.step();
        assert!(!steps(&d).contains(&"CreatePods"), "{gang:?}: {:?}", steps(&d));
        assert_eq!(sim.condition(conditions::PODS_CREATED).1, reasons::WAITING_FOR_OLD_PODS);
        sim.kubelet_gc();
        let d = sim.step();
        assert_eq!(pod_names(&d), ["grpo-cpu-trainer-0-e2", "grpo-cpu-gen-0-e2", "grpo-cpu-gen-1-e2"]);
    }
}

#[test]
fn the_active_deadline_fails_the_job_and_is_requeued_for() {
    let mut j = job("rljob-cpu.yaml");
    j.spec.run_policy.active_deadline_seconds = Some(600);
    let mut sim = Sim::new(j);
    let d = sim.step();
    assert_eq!(d.requeue_after, Some(RESYNC), "the deadline is further away than the resync");
    sim.now = t(500);
    let d = sim.step();
    assert_eq!(d.requeue_after, Some(Duration::from_secs(100)), "look again exactly at the deadline");
    sim.now = t(600);
    let d = sim.step();
    assert_eq!(steps(&d), ["WriteStatus", "DeletePods", "Publish"]);
    assert_eq!(sim.status().phase, Phase::Failed);
    let (_, reason, message) = sim.condition(conditions::FAILED);
    assert_eq!(reason, "DeadlineExceeded");
    assert!(message.contains("activeDeadlineSeconds=600"), "{message}");
    assert_eq!(event_reasons(&d), ["DeadlineExceeded"]);
}

#[test]
fn a_finished_job_is_deleted_after_its_ttl() {
    let mut j = job("rljob-cpu.yaml");
    j.spec.run_policy.ttl_seconds_after_finished = Some(60);
    let mut sim = Sim::running(j);
    let coordinator = sim.pods[0].metadata.name.clone().unwrap();
    sim.pod(&coordinator).status.as_mut().unwrap().phase = Some("Succeeded".into());
    sim.now = t(100);
    sim.step();
    assert_eq!(sim.status().phase, Phase::Succeeded);
    sim.kubelet_gc();
    sim.now = t(130);
    let d = sim.step();
    assert_eq!(steps(&d), ["DeleteObjects", "WriteStatus"]);
    assert_eq!(d.requeue_after, Some(Duration::from_secs(30)), "look again when the TTL expires");
    sim.now = t(160);
    let d = sim.step();
    assert_eq!(steps(&d), ["Publish", "DeleteJob"], "the Event is published while the job still exists");
    assert!(sim.deleted_job);
    assert_eq!(event_reasons(&d), ["TTLExpired"]);
}

#[test]
fn an_invalid_spec_fails_with_every_message_and_is_not_retried_until_it_changes() {
    let mut j = job("rljob-cpu.yaml");
    j.spec.trainer.parallelism.data = 3;
    j.spec.refit.align_bytes = 3;
    let mut sim = Sim::new(j);
    let d = sim.step();
    assert_eq!(steps(&d), ["WriteStatus", "Publish"]);
    assert_eq!(d.requeue_after, None, "no retry");
    let st = sim.status();
    assert_eq!((st.phase, st.observed_generation), (Phase::Failed, Some(1)));
    let (status, reason, message) = sim.condition(conditions::FAILED);
    assert_eq!((status.as_str(), reason.as_str()), ("True", "InvalidSpec"));
    assert!(message.contains("spec.trainer.parallelism") && message.contains("spec.refit.alignBytes"), "{message}");
    assert_eq!(message.lines().count(), 2, "one line per message: {message}");
    let ev = d.events().next().unwrap();
    assert!(ev.warning && ev.reason == "InvalidSpec");

    // The same generation again (a pod event, a resync): nothing, not even an Event.
    let d = sim.step();
    assert!(d.steps.is_empty(), "{:?}", steps(&d));

    // A fixed spec (new generation) runs.
    sim.job.spec.trainer.parallelism.data = 2;
    sim.job.spec.refit.align_bytes = 256;
    sim.job.metadata.generation = Some(2);
    sim.now = t(10);
    let d = sim.step();
    assert_eq!(steps(&d), ["ApplyObjects", "CreatePods", "WriteStatus", "Publish"]);
    let st = sim.status();
    assert_eq!((st.phase, st.completion_time.clone()), (Phase::Starting, None));
    assert_eq!(sim.condition(conditions::FAILED).0, "False");
}

#[test]
fn a_running_job_whose_spec_turns_invalid_fails_and_loses_its_pods() {
    let mut sim = Sim::running(job("rljob-cpu.yaml"));
    sim.job.spec.trainer.parallelism.data = 3;
    sim.job.metadata.generation = Some(2);
    let d = sim.step();
    assert_eq!(steps(&d), ["WriteStatus", "DeletePods", "Publish"]);
    assert_eq!(sim.condition(conditions::FAILED).1, "InvalidSpec");
}

#[test]
fn a_spec_change_restarts_the_gang_without_counting_a_restart() {
    let mut sim = Sim::running(job("rljob-cpu.yaml"));
    // runPolicy only: the gang keeps running.
    sim.job.spec.run_policy.backoff_limit = 5;
    sim.job.metadata.generation = Some(2);
    let d = sim.step();
    assert_eq!(sim.status().phase, Phase::Running);
    assert_eq!(sim.status().observed_generation, Some(2));
    assert!(!steps(&d).contains(&"DeletePods"));

    sim.job.spec.workload.steps = 10;
    sim.job.metadata.generation = Some(3);
    let d = sim.step();
    assert_eq!(steps(&d), ["WriteStatus", "DeletePods", "DeletePodGroups", "Publish"]);
    let st = sim.status();
    assert_eq!((st.phase, st.epoch, st.restarts, st.observed_generation), (Phase::Restarting, 1, 0, Some(3)));
    assert_eq!(sim.condition(conditions::RESTARTING).1, "SpecChanged");
    assert_eq!(d.restart, None);
}

#[test]
fn a_job_being_deleted_is_left_to_garbage_collection() {
    let mut sim = Sim::running(job("rljob-cpu.yaml"));
    sim.job.metadata.deletion_timestamp = Some(Time(t(40)));
    fail_container(sim.pod("grpo-cpu-gen-0"), 1, "Error", 40);
    let d = sim.step();
    assert!(d.steps.is_empty());
    assert_eq!(d.requeue_after, None);
}

#[test]
fn a_create_failure_is_recorded_in_pods_created() {
    let j = job("rljob-cpu.yaml");
    let st = create_failed(&j, "pods \"x\" is forbidden: exceeded quota", t(5)).unwrap();
    let c = conditions::find(&st.conditions, conditions::PODS_CREATED).unwrap();
    assert_eq!((c.status.as_str(), c.reason.as_str()), ("False", "CreateFailed"));
    assert!(c.message.contains("exceeded quota"));
    // The same failure again changes nothing (no write).
    let mut again = j.clone();
    again.status = Some(st);
    assert!(create_failed(&again, "pods \"x\" is forbidden: exceeded quota", t(9)).is_none());
    // A running gang whose Service could not be re-applied stays created: a pod that goes
    // missing from it must still count as a failure.
    let sim = Sim::running(j);
    assert!(create_failed(&sim.job, "services \"x\" is forbidden", t(40)).is_none());
}

#[test]
fn the_coordinators_fields_are_never_part_of_the_operators_status() {
    let mut j = job("rljob-cpu.yaml");
    j.status = Some(RLJobStatus {
        step: Some(3),
        last_refit: Some(LastRefit { version: 3, seconds: 0.5, bytes: 10, summary: "v3 0.50s".into() }),
        scalars: Some(rlplane_api::StepScalars { step: 3, values: [("kl".to_string(), 0.01)].into() }),
        ..Default::default()
    });
    let d = decide(&j, &[], t(0), &cfg());
    let st = d.status().unwrap();
    assert_eq!((st.step, &st.last_refit, &st.scalars), (None, &None, &None));
    let json = serde_json::to_value(st).unwrap();
    for field in ["step", "lastRefit", "scalars", "stall", "checkpoint"] {
        assert!(json.get(field).is_none(), "{field} is the coordinator's: {json}");
    }
}

#[test]
fn a_gang_restart_resumes_from_the_newest_checkpoint_and_the_new_plan_says_so() {
    let mut long = job("rljob-cpu.yaml");
    long.spec.workload.steps = 100;
    let mut sim = Sim::running(long);
    let checkpoint = CheckpointRef { step: 20, uri: "s3://ckpt/grpo-cpu/step-20".into() };
    sim.job.status.as_mut().unwrap().checkpoint = Some(checkpoint.clone());
    fail_container(sim.pod("grpo-cpu-gen-1"), 137, "OOMKilled", 40);
    sim.now = t(45);
    sim.step();
    let st = sim.status();
    assert_eq!((st.epoch, st.resumed_from.as_ref()), (1, Some(&checkpoint)), "fixed when the epoch begins");
    assert_eq!(st.checkpoint.as_ref(), Some(&checkpoint), "the coordinator's field is untouched");

    // The plan of epoch 1 (built once the old pods are gone) resumes there.
    sim.now = t(46);
    let d = sim.step();
    let Step::ApplyObjects(objects) = &d.steps[0] else { unreachable!("{:?}", steps(&d)) };
    assert_eq!((objects.plan.job.epoch, objects.plan.resume.as_ref()), (1, Some(&checkpoint)));
    assert_eq!(objects.plan.first_version(), 20);

    // A newer checkpoint reported while epoch 1 runs changes neither its plan nor its resume
    // point; the next restart takes it.
    sim.kubelet_gc();
    sim.now = t(50);
    sim.step();
    let newer = CheckpointRef { step: 30, uri: "s3://ckpt/grpo-cpu/step-30".into() };
    sim.job.status.as_mut().unwrap().checkpoint = Some(newer.clone());
    sim.now = t(51);
    let d = sim.step();
    for s in &d.steps {
        if let Step::ApplyObjects(objects) = s {
            assert_eq!(objects.plan.resume.as_ref(), Some(&checkpoint), "epoch 1's plan stays");
        }
    }
    assert_eq!(sim.status().resumed_from.as_ref(), Some(&checkpoint));
    for p in ["grpo-cpu-trainer-0", "grpo-cpu-gen-0", "grpo-cpu-gen-1"] {
        set_ready(sim.pod(p), true);
    }
    fail_container(sim.pod("grpo-cpu-gen-0"), 1, "Error", 60);
    sim.now = t(61);
    sim.step();
    let st = sim.status();
    assert_eq!((st.epoch, st.resumed_from.as_ref()), (2, Some(&newer)));
}
