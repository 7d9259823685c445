//! The operator's decisions, as a pure function: from an RLJob, its pods and the time, the ordered
//! steps that bring the cluster to the desired state, the status to write, the Events to publish
//! and when to look again. [`crate::reconcile`] executes the steps and does nothing else.
//!
//! The rules (docs/operator.md has the whole contract):
//! - A finished job (Succeeded, or Failed other than InvalidSpec) only loses its pods and objects,
//!   and is deleted `ttlSecondsAfterFinished` after it finished.
//! - An invalid spec fails the job (Failed/InvalidSpec, every validation message) and is not
//!   looked at again until `metadata.generation` changes.
//! - `spec.runPolicy.suspend: true` deletes every pod and object but the RLJob (Suspended).
//! - Otherwise the job runs as a gang: pods of the current epoch are created together; any of them
//!   failing restarts the whole gang with epoch + 1 (up to `backoffLimit`, then Failed); the
//!   coordinator's pod succeeding is the job's success; pods of other epochs are deleted and never
//!   counted; a spec change that shapes pods restarts the gang without counting a restart.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use rlplane_api::{GangScheduler, Phase, RLJob, RLJobStatus, RoleCounts};

use crate::conditions::{self, reasons};
use crate::desired::{Desired, DesiredError, OperatorConfig, desired, labels, spec_hash};
use crate::observe::{FailureKind, ObservedPod, PodFailure, observe, owned_by};
use crate::policy::{Verdict, rule_clause};

/// How long to wait before looking again when nothing else will trigger a reconcile: a safety
/// net for missed watch events (kube-runtime's advice), not a polling loop.
pub const RESYNC: Duration = Duration::from_secs(300);
/// How often to look while pods of an earlier epoch are still terminating (their deletion also
/// triggers a reconcile; this only bounds a missed event).
pub const WAIT_FOR_PODS: Duration = Duration::from_secs(10);
/// Kubernetes caps an Event's note at 1 kB.
const MAX_NOTE_BYTES: usize = 1024;

/// A pod to delete; the delete is conditioned on the uid.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodRef {
    /// Pod name.
    pub name: String,
    /// Pod uid.
    pub uid: Option<String>,
}

/// An Event to publish on the RLJob.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobEvent {
    /// Warning (something went wrong) or Normal.
    pub warning: bool,
    /// CamelCase reason, e.g. `GangRestart`.
    pub reason: String,
    /// CamelCase action the operator took, e.g. `RestartGang`.
    pub action: String,
    /// What happened, at most 1 kB.
    pub note: String,
}

/// One thing to do, in order. The executor stops at the first step that fails.
#[derive(Clone, Debug)]
pub enum Step {
    /// Server-side apply the ServiceAccount, Role, RoleBinding, Service, ConfigMap and PodGroup
    /// (everything in [`Desired`] but the pods; its `pods` is empty).
    ApplyObjects(Box<Desired>),
    /// Server-side apply these pods (they do not exist yet).
    CreatePods(Vec<Pod>),
    /// Server-side apply the operator's part of the status (never `step` nor `lastRefit`).
    WriteStatus(Box<RLJobStatus>),
    /// Delete these pods.
    DeletePods(Vec<PodRef>),
    /// Delete the Service, ConfigMap, ServiceAccount, Role, RoleBinding and PodGroups.
    DeleteObjects,
    /// Delete PodGroups of these gang schedulers (the gang kind changed).
    DeletePodGroups(Vec<GangScheduler>),
    /// Delete the RLJob itself (TTL after finished).
    DeleteJob,
    /// Publish an Event on the RLJob.
    Publish(JobEvent),
}

/// What to do for one RLJob now.
#[derive(Clone, Debug)]
pub struct Decision {
    /// Steps, in order.
    pub steps: Vec<Step>,
    /// When to look again if nothing triggers a reconcile before; None: only on change.
    pub requeue_after: Option<Duration>,
    /// The job's phase once the steps are done.
    pub phase: Phase,
    /// A gang restart caused by a failure (for `rlplane_operator_restarts_total`).
    pub restart: Option<FailureKind>,
}

impl Decision {
    /// The status this decision writes, if it writes one.
    pub fn status(&self) -> Option<&RLJobStatus> {
        self.steps.iter().find_map(|s| match s {
            Step::WriteStatus(st) => Some(&**st),
            _ => None,
        })
    }

    /// The events this decision publishes.
    pub fn events(&self) -> impl Iterator<Item = &JobEvent> {
        self.steps.iter().filter_map(|s| match s {
            Step::Publish(e) => Some(e),
            _ => None,
        })
    }
}

/// The operator's part of a status ([`RLJobStatus::operator_part`]): the coordinator's fields
/// are never part of what the operator writes or compares.
pub fn operator_status(status: Option<&RLJobStatus>) -> RLJobStatus {
    status.map(RLJobStatus::operator_part).unwrap_or_default()
}

/// Decides what to do for `job`, given the pods that carry its label (pods it does not control
/// are ignored) and the time.
pub fn decide(job: &RLJob, pods: &[Pod], now: Timestamp, cfg: &OperatorConfig) -> Decision {
    // Status times have a resolution of seconds; deciding with the same keeps comparisons exact.
    let now = Timestamp::from_second(now.as_second()).unwrap_or(now);
    let uid = job.metadata.uid.as_deref().unwrap_or_default();
    let observed: Vec<ObservedPod> = pods.iter().filter(|p| owned_by(p, uid)).map(observe).collect();
    let mut d = Draft::new(job, observed, now);
    if job.metadata.deletion_timestamp.is_some() {
        // Garbage collection removes the children through their owner references.
        return d.finish(None);
    }
    if is_final(&d.old, d.generation) {
        return d.finished();
    }
    let epoch = d.observed.iter().filter_map(|p| p.epoch).fold(d.old.epoch, u32::max);
    let desired = match desired(job, epoch, cfg) {
        Ok(desired) => desired,
        Err(e) => return d.invalid(&e),
    };
    d.set_totals(&desired);
    if job.spec.run_policy.suspend {
        return d.suspended(epoch);
    }
    d.active(epoch, desired)
}

/// Succeeded, or Failed for a reason other than a spec the user may still fix.
fn is_final(st: &RLJobStatus, generation: Option<i64>) -> bool {
    match st.phase {
        Phase::Succeeded => true,
        Phase::Failed => {
            !conditions::has_reason(&st.conditions, conditions::FAILED, true, reasons::INVALID_SPEC)
                || st.observed_generation == generation
        }
        _ => false,
    }
}

/// True when none of the job's pods or objects exist: the status was never written (nothing was
/// created), or a cleanup finished (PodsCreated=False/NoPods).
fn cleaned(st: &RLJobStatus) -> bool {
    st.conditions.is_empty()
        || conditions::has_reason(&st.conditions, conditions::PODS_CREATED, false, reasons::NO_PODS)
}

/// Messages of an invalid spec, one line each (`path: what to do`; a message may contain `;`).
fn invalid_message(e: &DesiredError) -> String {
    match e {
        DesiredError::InvalidSpec(v) => v.lines().join("\n"),
        other => other.to_string(),
    }
}

fn truncate(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut cut = max.saturating_sub(3);
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push_str("...");
    }
    s
}

fn secs(d: i64) -> Duration {
    Duration::from_secs(d.max(1) as u64)
}

/// A decision being built: the old and new status and the steps so far.
struct Draft<'a> {
    job: &'a RLJob,
    old: RLJobStatus,
    st: RLJobStatus,
    observed: Vec<ObservedPod>,
    now: Timestamp,
    generation: Option<i64>,
    steps: Vec<Step>,
    events: Vec<JobEvent>,
    restart: Option<FailureKind>,
}

impl<'a> Draft<'a> {
    fn new(job: &'a RLJob, observed: Vec<ObservedPod>, now: Timestamp) -> Self {
        let old = operator_status(job.status.as_ref());
        Draft {
            job,
            st: old.clone(),
            old,
            observed,
            now,
            generation: job.metadata.generation,
            steps: Vec::new(),
            events: Vec::new(),
            restart: None,
        }
    }

    fn set(&mut self, type_: &str, status: bool, reason: &str, message: &str) {
        conditions::set(&mut self.st.conditions, type_, status, reason, message, self.generation, self.now);
    }

    /// Sets every condition for an inactive or transitional `phase`: the one named `true_type`
    /// True with `reason` and `message`, the rest False with the phase as reason.
    fn set_phase(&mut self, phase: Phase, true_type: Option<&str>, reason: &str, message: &str) {
        self.st.phase = phase;
        for t in conditions::ALL {
            if Some(t) == true_type {
                self.set(t, true, reason, message);
            } else {
                self.set(t, false, phase.as_str(), "");
            }
        }
    }

    fn event(&mut self, warning: bool, reason: &str, action: &str, note: String) {
        self.events.push(JobEvent {
            warning,
            reason: reason.into(),
            action: action.into(),
            note: truncate(note, MAX_NOTE_BYTES),
        });
    }

    /// Writes the status here in the step order, if it differs from the stored one.
    fn write_status(&mut self) {
        if self.st != self.old {
            self.steps.push(Step::WriteStatus(Box::new(self.st.clone())));
        }
    }

    fn set_totals(&mut self, desired: &Desired) {
        let count = |role: &str| {
            desired
                .pods
                .iter()
                .filter(|p| {
                    p.metadata.labels.as_ref().and_then(|l| l.get(labels::ROLE)).map(String::as_str) == Some(role)
                })
                .count() as u32
        };
        self.st.roles.trainer.total = count("trainer");
        self.st.roles.generation.total = count("gen");
        self.st.roles.storage.total = count("tq");
    }

    fn clear_ready(&mut self) {
        for r in [&mut self.st.roles.trainer, &mut self.st.roles.generation, &mut self.st.roles.storage] {
            r.ready = 0;
        }
    }

    /// Pods still to delete (a terminating pod is already on its way).
    fn live_pods(&self) -> Vec<PodRef> {
        self.observed
            .iter()
            .filter(|p| !p.terminating)
            .map(|p| PodRef { name: p.name.clone(), uid: p.uid.clone() })
            .collect()
    }

    fn finish(mut self, requeue_after: Option<Duration>) -> Decision {
        let events = std::mem::take(&mut self.events);
        self.steps.extend(events.into_iter().map(Step::Publish));
        Decision { steps: self.steps, requeue_after, phase: self.st.phase, restart: self.restart }
    }

    /// The tail of every inactive decision (finished, invalid, suspended): the status first (so
    /// that deleted pods are never mistaken for failures), then the pods; once none are left,
    /// the other objects, then PodsCreated=False/NoPods.
    fn tear_down(&mut self) {
        let reason_when_empty = reasons::NO_PODS;
        if !self.observed.is_empty() {
            self.set(conditions::PODS_CREATED, false, reasons::DELETING_PODS, "deleting the pods");
            self.write_status();
            let live = self.live_pods();
            if !live.is_empty() {
                self.steps.push(Step::DeletePods(live));
            }
        } else {
            if !cleaned(&self.old) {
                self.steps.push(Step::DeleteObjects);
            }
            self.set(conditions::PODS_CREATED, false, reason_when_empty, "no pods or objects of this job exist");
            self.write_status();
        }
    }

    /// Succeeded, or Failed for good: delete what is left, then the job after its TTL.
    fn finished(mut self) -> Decision {
        let policy = &self.job.spec.run_policy;
        if let (Some(ttl), Some(done)) = (policy.ttl_seconds_after_finished, self.old.completion_time.as_ref()) {
            let expires = done.0.as_second().saturating_add(ttl as i64);
            let left = expires - self.now.as_second();
            if left <= 0 {
                self.event(
                    false,
                    "TTLExpired",
                    "DeleteJob",
                    format!(
                        "deleting the RLJob: it finished {}s ago (ttlSecondsAfterFinished={ttl})",
                        ttl as i64 - left
                    ),
                );
                // The Event first: once the job is gone, nothing can be published on it.
                let events = std::mem::take(&mut self.events);
                self.steps.extend(events.into_iter().map(Step::Publish));
                self.steps.push(Step::DeleteJob);
                return Decision { steps: self.steps, requeue_after: None, phase: self.st.phase, restart: None };
            }
            self.tear_down();
            return self.finish(Some(secs(left)));
        }
        self.tear_down();
        self.finish(None)
    }

    /// The spec cannot run: Failed/InvalidSpec, every message, no retry until the spec changes.
    fn invalid(mut self, e: &DesiredError) -> Decision {
        let message = invalid_message(e);
        let already_failed = self.old.phase == Phase::Failed;
        self.set_phase(Phase::Failed, Some(conditions::FAILED), reasons::INVALID_SPEC, &message);
        self.clear_ready();
        self.st.observed_generation = self.generation;
        if !already_failed {
            self.st.completion_time = Some(Time(self.now));
        }
        self.event(
            true,
            reasons::INVALID_SPEC,
            "Validate",
            format!("the spec is invalid and will not run until it changes: {message}"),
        );
        self.tear_down();
        // No requeue: the next look comes with a new generation (or a TTL, decided then).
        self.finish(None)
    }

    fn suspended(mut self, epoch: u32) -> Decision {
        let job = self.job;
        let queue = job.metadata.labels.as_ref().and_then(|l| l.get(labels::KUEUE_QUEUE)).or(job
            .spec
            .scheduling
            .queue_name
            .as_ref());
        let message = match queue {
            Some(q) => {
                format!("spec.runPolicy.suspend is true; Kueue (queue {q}) sets it to false when it admits the job")
            }
            None => "spec.runPolicy.suspend is true; set it to false to resume".to_string(),
        };
        if self.old.phase != Phase::Suspended {
            // A gang that had pods is torn down for good: its epoch's token is retired so that
            // none of its ranks can join the resumed gang.
            if conditions::is_true(&self.old.conditions, conditions::PODS_CREATED) {
                self.st.epoch = epoch + 1;
                self.resume_from_checkpoint();
            }
            self.st.start_time = None;
            self.event(false, reasons::SUSPENDED, "Suspend", format!("deleting the pods: {message}"));
        }
        self.set_phase(Phase::Suspended, Some(conditions::SUSPENDED), reasons::SUSPENDED, &message);
        self.clear_ready();
        self.st.observed_generation = self.generation;
        self.tear_down();
        self.finish(None)
    }

    /// A finished or failed transition from the active state: status, then tear-down.
    fn end(mut self, phase: Phase, reason: &str, message: String, warning: bool) -> Decision {
        let true_type = if phase == Phase::Succeeded { conditions::SUCCEEDED } else { conditions::FAILED };
        self.set_phase(phase, Some(true_type), reason, &message);
        self.clear_ready();
        self.st.completion_time = Some(Time(self.now));
        self.st.observed_generation = self.generation;
        self.event(warning, reason, if warning { "FailJob" } else { "CompleteJob" }, message);
        self.tear_down();
        // The next reconcile (our own status write triggers it) handles the TTL.
        self.finish(None)
    }

    /// The gang failed (`summary` names the pod and what happened): a restart, counted as the
    /// failure policy's `verdict` says, or the end when its limit is reached or a rule fails the job.
    fn failed(mut self, epoch: u32, kind: FailureKind, verdict: Verdict, summary: String) -> Decision {
        let job = self.job;
        let (limit, fp) = (job.spec.run_policy.backoff_limit, &job.spec.run_policy.failure_policy);
        let next = epoch + 1;
        let message = match verdict {
            Verdict::FailJob { rule } => {
                let message = format!("{summary}; the job fails ({})", rule_clause(fp, rule));
                return self.end(Phase::Failed, reasons::FAILURE_POLICY, message, true);
            }
            Verdict::Ignore { rule } => {
                format!("{summary}; gang restart with epoch {next}, not counted ({})", rule_clause(fp, rule))
            }
            Verdict::Disruption => {
                let dlimit = fp.disruption_limit;
                if self.old.disruptions >= dlimit {
                    let message = format!(
                        "{summary}; disruptionLimit {dlimit} reached after {} disruptions",
                        self.old.disruptions
                    );
                    return self.end(Phase::Failed, reasons::DISRUPTION_LIMIT_EXCEEDED, message, true);
                }
                self.st.disruptions = self.old.disruptions + 1;
                format!(
                    "{summary}; gang restart with epoch {next}, a disruption: {}/{dlimit} of disruptionLimit",
                    self.st.disruptions
                )
            }
            Verdict::Count { rule } => {
                if self.old.counted_restarts >= limit {
                    let message =
                        format!("{summary}; backoffLimit {limit} reached after {} restarts", self.old.counted_restarts);
                    return self.end(Phase::Failed, reasons::BACKOFF_LIMIT_EXCEEDED, message, true);
                }
                self.st.counted_restarts = self.old.counted_restarts + 1;
                let by = rule.map(|r| format!(" ({})", rule_clause(fp, r))).unwrap_or_default();
                format!("{summary}; gang restart {}/{limit} with epoch {next}{by}", self.st.counted_restarts)
            }
        };
        self.st.restarts = self.old.restarts + 1;
        self.restart = Some(kind);
        self.event(true, "GangRestart", "RestartGang", message.clone());
        self.restart(next, kind.reason(), message, Vec::new())
    }

    /// The next epoch resumes from the newest checkpoint the trainer reported (the coordinator's
    /// `status.checkpoint`), or from where this epoch resumed when it reported none. Fixed here,
    /// once per epoch, so that the plan of an epoch never changes while it runs.
    fn resume_from_checkpoint(&mut self) {
        let reported = self.job.status.as_ref().and_then(|s| s.checkpoint.clone());
        if let Some(cp) = reported.or_else(|| self.old.resumed_from.clone()) {
            self.st.resumed_from = Some(cp);
        }
    }

    /// Tears the gang down for a new epoch: status first, then every pod, then `extra`.
    fn restart(mut self, new_epoch: u32, reason: &str, message: String, extra: Vec<Step>) -> Decision {
        self.st.epoch = new_epoch;
        self.resume_from_checkpoint();
        self.set_phase(Phase::Restarting, Some(conditions::RESTARTING), reason, &message);
        self.set(conditions::PODS_CREATED, false, reasons::RESTARTING, "deleting the pods of the previous epoch");
        self.clear_ready();
        self.st.observed_generation = self.generation;
        self.write_status();
        let live = self.live_pods();
        if !live.is_empty() {
            self.steps.push(Step::DeletePods(live));
        }
        self.steps.extend(extra);
        self.finish(Some(WAIT_FOR_PODS))
    }

    /// The job should run at `epoch`: restart the gang for a new spec, end it (the coordinator
    /// succeeded, the deadline passed), restart or fail it for a failure, or else keep it going.
    fn active(self, epoch: u32, desired: Desired) -> Decision {
        let created = conditions::is_true(&self.old.conditions, conditions::PODS_CREATED) && self.old.epoch == epoch;
        let current: Vec<ObservedPod> = self.observed.iter().filter(|p| p.epoch == Some(epoch)).cloned().collect();

        if self.spec_changed(&current) {
            return self.restart_for_new_spec(epoch);
        }

        if let Some(c) = current.iter().find(|p| p.coordinator && p.succeeded) {
            let message = format!("the coordinator (pod {}) finished every step and exited 0", c.name);
            return self.end(Phase::Succeeded, reasons::COORDINATOR_SUCCEEDED, message, false);
        }

        let deadline = self.deadline();
        if let Some(d) = &deadline
            && self.now.as_second() >= d.at
        {
            let message =
                format!("the job was active longer than activeDeadlineSeconds={} (it started at {})", d.limit, d.start);
            return self.end(Phase::Failed, reasons::DEADLINE_EXCEEDED, message, true);
        }

        let failures = gang_failures(&current, &desired, created);
        if !failures.is_empty() {
            return self.gang_failed(epoch, failures);
        }
        self.keep_gang(epoch, &desired, &current, created, deadline)
    }

    /// A spec change that shapes pods: a gang cannot change pod by pod, so it restarts with
    /// the new spec. Changes to runPolicy only (deadline, TTL, backoffLimit) keep the gang; so
    /// does an operator upgrade (same generation).
    fn spec_changed(&self, current: &[ObservedPod]) -> bool {
        let hash = spec_hash(&self.job.spec);
        self.old.observed_generation.is_some()
            && self.old.observed_generation != self.generation
            && current.iter().any(|p| !p.terminating && p.spec_hash.as_deref() != Some(hash.as_str()))
    }

    /// Restarts the gang with the new spec at `epoch + 1`, deleting PodGroups of any other gang
    /// scheduler. Not a failure; restarts is unchanged.
    fn restart_for_new_spec(mut self, epoch: u32) -> Decision {
        let gangs = [GangScheduler::Volcano, GangScheduler::Coscheduling]
            .into_iter()
            .filter(|g| *g != self.job.spec.scheduling.gang)
            .collect();
        let message = format!(
            "the spec changed (generation {} to {}); restarting the gang with epoch {}",
            self.old.observed_generation.unwrap_or_default(),
            self.generation.unwrap_or_default(),
            epoch + 1
        );
        self.event(false, reasons::SPEC_CHANGED, "RestartGang", message.clone());
        self.restart(epoch + 1, reasons::SPEC_CHANGED, message, vec![Step::DeletePodGroups(gangs)])
    }

    /// The job's active deadline, once it has started and has one.
    fn deadline(&self) -> Option<Deadline> {
        match (self.job.spec.run_policy.active_deadline_seconds, self.old.start_time.as_ref()) {
            (Some(limit), Some(start)) => {
                Some(Deadline { limit, start: start.0, at: start.0.as_second().saturating_add(limit as i64) })
            }
            _ => None,
        }
    }

    /// The gang failed: the earliest failure names the pod and what happened, and decides, by
    /// the failure policy, whether the gang restarts or the job fails. Times are whole seconds,
    /// and the ranks that lose a killed peer fail within the same one: among failures of the
    /// same second, one whose process was killed ([`PodFailure::killed`]) is named first.
    fn gang_failed(self, epoch: u32, mut failures: Vec<(String, PodFailure)>) -> Decision {
        failures.sort_by_key(|(pod, f)| (f.at.is_none(), f.at, !f.killed(), pod.clone()));
        let (pod, first) = &failures[0];
        let more = match failures.len() - 1 {
            0 => String::new(),
            1 => " (and 1 more pod failed)".into(),
            n => format!(" (and {n} more pods failed)"),
        };
        let summary = format!("pod {pod}: {}{more}", first.detail);
        let (kind, verdict) = (first.kind, crate::policy::judge(&self.job.spec.run_policy.failure_policy, first));
        self.failed(epoch, kind, verdict, summary)
    }

    /// The gang lives: its objects are applied every time (drift is repaired), pods of other
    /// epochs are deleted, the pods are created once, and the status follows their readiness.
    fn keep_gang(
        mut self,
        epoch: u32,
        desired: &Desired,
        current: &[ObservedPod],
        created: bool,
        deadline: Option<Deadline>,
    ) -> Decision {
        self.st.observed_generation = self.generation;
        self.st.completion_time = None;
        let resumed = self.old.phase == Phase::Suspended;
        let mut objects = desired.clone();
        objects.pods = Vec::new();
        self.steps.push(Step::ApplyObjects(Box::new(objects)));
        let stale: Vec<PodRef> = self
            .observed
            .iter()
            .filter(|p| p.epoch != Some(epoch) && !p.terminating)
            .map(|p| PodRef { name: p.name.clone(), uid: p.uid.clone() })
            .collect();
        let in_the_way = self.old_pods_in_the_way(epoch, desired);

        let mut requeue = RESYNC;
        if !created && in_the_way > 0 {
            self.wait_for_old_pods(in_the_way, resumed);
            requeue = WAIT_FOR_PODS;
        } else if !created {
            self.create_pods(epoch, desired, current, resumed);
        }
        self.follow_readiness(epoch, desired, current);
        self.write_status();
        if !stale.is_empty() {
            self.steps.push(Step::DeletePods(stale));
        }
        if let Some(d) = deadline {
            requeue = requeue.min(secs(d.at - self.now.as_second()));
        }
        self.finish(Some(requeue))
    }

    /// How many pods of earlier epochs must be gone before this epoch's pods are created. Each
    /// epoch names its pods apart (`topology::pod_name`), so the new gang is normally created
    /// while the old one terminates: its sandboxes and containers start during the old pods'
    /// grace period instead of after it. Two cases still wait: a pod that holds one of the new
    /// names, and a gang scheduler's PodGroup, which is one per job and would count the
    /// terminating members of the old gang as members of the new one.
    fn old_pods_in_the_way(&self, epoch: u32, desired: &Desired) -> usize {
        let grouped = self.job.spec.scheduling.gang != GangScheduler::None;
        let names: Vec<&str> = desired.pods.iter().filter_map(|p| p.metadata.name.as_deref()).collect();
        self.observed.iter().filter(|p| p.epoch != Some(epoch) && (grouped || names.contains(&p.name.as_str()))).count()
    }

    /// The new pods are created once the `old_left` pods of an earlier epoch in their way are
    /// gone ([`Self::old_pods_in_the_way`]). Until then the job is Pending (or still Restarting).
    fn wait_for_old_pods(&mut self, old_left: usize, resumed: bool) {
        self.st.phase = if self.old.phase == Phase::Restarting { Phase::Restarting } else { Phase::Pending };
        self.set(
            conditions::PODS_CREATED,
            false,
            reasons::WAITING_FOR_OLD_PODS,
            &format!("waiting for {old_left} pods of an earlier epoch to terminate"),
        );
        let phase = self.st.phase.as_str();
        for t in [conditions::PODS_READY, conditions::RUNNING, conditions::SUCCEEDED, conditions::FAILED] {
            self.set(t, false, phase, "");
        }
        // While restarting, Restarting=True keeps the reason and message of the restart.
        if self.st.phase != Phase::Restarting {
            self.set(conditions::RESTARTING, false, phase, "");
        }
        self.set(conditions::SUSPENDED, false, if resumed { reasons::RESUMED } else { phase }, "");
        if resumed {
            self.event(false, reasons::RESUMED, "Resume", "spec.runPolicy.suspend is false".into());
        }
    }

    /// Creates the epoch's pods that do not exist yet: the job is Starting, PodsCreated=True.
    fn create_pods(&mut self, epoch: u32, desired: &Desired, current: &[ObservedPod], resumed: bool) {
        let missing: Vec<Pod> = desired
            .pods
            .iter()
            .filter(|p| !current.iter().any(|c| Some(&c.name) == p.metadata.name.as_ref()))
            .cloned()
            .collect();
        if !missing.is_empty() {
            self.steps.push(Step::CreatePods(missing));
        }
        self.st.phase = Phase::Starting;
        self.st.start_time = self.st.start_time.clone().or(Some(Time(self.now)));
        let n = desired.pods.len();
        self.set(conditions::PODS_CREATED, true, reasons::PODS_CREATED, &format!("created {n} pods for epoch {epoch}"));
        let restarted = self.old.phase == Phase::Restarting;
        self.set(conditions::RESTARTING, false, if restarted { reasons::RESTARTED } else { "Starting" }, "");
        self.set(conditions::SUSPENDED, false, if resumed { reasons::RESUMED } else { "Starting" }, "");
        self.set(conditions::SUCCEEDED, false, "Starting", "");
        self.set(conditions::FAILED, false, "Starting", "");
        if resumed {
            self.event(false, reasons::RESUMED, "Resume", "spec.runPolicy.suspend is false".into());
        }
        self.event(false, reasons::PODS_CREATED, "CreatePods", format!("created {n} pods for epoch {epoch}"));
    }

    /// Readiness, per role and as a whole: the ready counts, and for a starting or running gang
    /// PodsReady (saying why pods are not ready, when known) and Running.
    fn follow_readiness(&mut self, epoch: u32, desired: &Desired, current: &[ObservedPod]) {
        let (counts, all_ready) = role_counts(desired, current);
        [self.st.roles.trainer, self.st.roles.generation, self.st.roles.storage] = counts;
        if self.st.phase != Phase::Starting && self.st.phase != Phase::Running {
            return;
        }
        let n_ready: u32 = counts.iter().map(|c| c.ready).sum();
        let n = desired.pods.len();
        self.set_pods_ready(n_ready, n, all_ready, current);
        // Running is sticky within an epoch: a pod that goes unready (or a rank that finished
        // before the coordinator) does not make a running gang "starting" again.
        if all_ready || self.old.phase == Phase::Running {
            if self.old.phase != Phase::Running {
                self.event(false, "Running", "StartGang", format!("all {n} pods of epoch {epoch} are ready"));
            }
            self.st.phase = Phase::Running;
            self.set(
                conditions::RUNNING,
                true,
                reasons::ALL_PODS_READY,
                &format!("all {n} pods of epoch {epoch} became ready"),
            );
        } else {
            self.set(conditions::RUNNING, false, "Starting", "");
        }
    }

    /// PodsReady: True when all `n` pods are ready, else False with the first reason known
    /// (pods that cannot be scheduled, containers that will not start) or just the count.
    fn set_pods_ready(&mut self, n_ready: u32, n: usize, all_ready: bool, current: &[ObservedPod]) {
        if all_ready {
            self.set(conditions::PODS_READY, true, reasons::ALL_PODS_READY, &format!("{n}/{n} pods ready"));
        } else if let Some((pod, why)) = current.iter().find_map(|c| c.unschedulable.as_ref().map(|why| (&c.name, why)))
        {
            // The gang cannot start until every pod is placed: say why, in the scheduler's words.
            let unplaced = current.iter().filter(|c| c.unschedulable.is_some()).count();
            self.set(
                conditions::PODS_READY,
                false,
                reasons::UNSCHEDULABLE,
                &format!("{n_ready}/{n} pods ready; {unplaced} cannot be scheduled (pod {pod}: {why})"),
            );
        } else if let Some((pod, why)) = current.iter().find_map(|c| c.not_starting.as_ref().map(|why| (&c.name, why)))
        {
            // Pods that will not start by themselves (an image that cannot be pulled, say):
            // the gang waits, as a Job's pods do; the condition says which and why.
            self.set(
                conditions::PODS_READY,
                false,
                reasons::CONTAINERS_NOT_STARTING,
                &format!("{n_ready}/{n} pods ready; pod {pod}: {why}"),
            );
        } else {
            self.set(conditions::PODS_READY, false, reasons::PODS_NOT_READY, &format!("{n_ready}/{n} pods ready"));
        }
    }
}

/// `spec.runPolicy.activeDeadlineSeconds` of a started job.
struct Deadline {
    /// The limit, in seconds.
    limit: u64,
    /// When the job started.
    start: Timestamp,
    /// When the limit is reached, in seconds since the epoch.
    at: i64,
}

/// Failures of the current epoch, by pod name; a pod that is gone after its epoch was `created`
/// was deleted. Pods of other epochs never count.
fn gang_failures(current: &[ObservedPod], desired: &Desired, created: bool) -> Vec<(String, PodFailure)> {
    let mut failures: Vec<(String, PodFailure)> =
        current.iter().filter_map(|p| p.failure.clone().map(|f| (p.name.clone(), f))).collect();
    if created {
        for p in &desired.pods {
            let name = p.metadata.name.clone().unwrap_or_default();
            if !current.iter().any(|c| c.name == name) {
                let failure = PodFailure {
                    kind: FailureKind::PodDeleted,
                    detail: "the pod is gone".into(),
                    at: None,
                    exit_codes: Vec::new(),
                    conditions: Vec::new(),
                };
                failures.push((name, failure));
            }
        }
    }
    failures
}

/// Total and ready pods per role (trainer, generation, storage), and whether every pod of the
/// epoch is ready (never when it has none).
fn role_counts(desired: &Desired, current: &[ObservedPod]) -> ([RoleCounts; 3], bool) {
    let ready = |name: &str| current.iter().any(|c| c.name == name && c.ready);
    let mut counts = [RoleCounts::default(); 3];
    let mut all_ready = !desired.pods.is_empty();
    for p in &desired.pods {
        let name = p.metadata.name.as_deref().unwrap_or_default();
        let role = p.metadata.labels.as_ref().and_then(|l| l.get(labels::ROLE)).map(String::as_str);
        let i = match role {
            Some("gen") => 1,
            Some("tq") => 2,
            _ => 0,
        };
        counts[i].total += 1;
        if ready(name) {
            counts[i].ready += 1;
        } else {
            all_ready = false;
        }
    }
    (counts, all_ready)
}

/// The status after a failure to create the pods or their objects: PodsCreated=False/CreateFailed
/// with the error (the executor writes it, then retries with backoff). None when nothing is to
/// be written: the same error again, or an epoch whose pods were all created already (a failed
/// re-apply of the Service, say, must not make the running gang look uncreated: a pod missing
/// from a created epoch is a failure, and must stay one).
pub fn create_failed(job: &RLJob, error: &str, now: Timestamp) -> Option<RLJobStatus> {
    let now = Timestamp::from_second(now.as_second()).unwrap_or(now);
    let old = operator_status(job.status.as_ref());
    if conditions::is_true(&old.conditions, conditions::PODS_CREATED) {
        return None;
    }
    let mut st = old.clone();
    let message = truncate(error.to_string(), 4096);
    conditions::set(
        &mut st.conditions,
        conditions::PODS_CREATED,
        false,
        reasons::CREATE_FAILED,
        &message,
        job.metadata.generation,
        now,
    );
    (st != old).then_some(st)
}
