//! What the operator reads from a live pod: its epoch, role, readiness, and whether (and why) it
//! failed. Pure: no I/O, so the gang rules in [`crate::decide`] can be tested on plain `Pod`s.

use k8s_openapi::api::core::v1::{ContainerStatus, Pod};
use k8s_openapi::jiff::Timestamp;

use crate::desired::{SPEC_HASH_ANNOTATION, labels};

/// Why a pod counts as failed. Each kind is also the reason of the `Restarting` condition and the
/// `reason` label of `rlplane_operator_restarts_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FailureKind {
    /// The pod's phase is Failed (and no container says more).
    PodFailed,
    /// A container terminated with a non-zero exit code, or a (sidecar) container restarted.
    ContainerFailed,
    /// The kubelet evicted the pod, or it was preempted, drained or hit by a taint
    /// (phase Failed with reason Evicted, or a `DisruptionTarget` condition).
    PodEvicted,
    /// The pod was deleted while the job ran (terminating, or gone after it was created).
    PodDeleted,
}

impl FailureKind {
    /// The condition reason (CamelCase).
    pub fn reason(self) -> &'static str {
        match self {
            FailureKind::PodFailed => "PodFailed",
            FailureKind::ContainerFailed => "ContainerFailed",
            FailureKind::PodEvicted => "PodEvicted",
            FailureKind::PodDeleted => "PodDeleted",
        }
    }

    /// Every kind, for metrics.
    pub const ALL: [FailureKind; 4] =
        [FailureKind::PodFailed, FailureKind::ContainerFailed, FailureKind::PodEvicted, FailureKind::PodDeleted];
}

/// A failed pod: the kind, a human-readable detail, and when it happened (the earliest failure of
/// a gang is usually the cause; the others are ranks that lost their peers).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodFailure {
    /// What kind of failure.
    pub kind: FailureKind,
    /// What happened, e.g. `container rlplane-worker exited with code 137 (OOMKilled)`.
    pub detail: String,
    /// When, where the pod says.
    pub at: Option<Timestamp>,
    /// Non-zero exit codes of the pod's containers, by container name (the last termination of a
    /// restarted one): what `failurePolicy` rules' `onExitCodes` match.
    pub exit_codes: Vec<(String, i32)>,
    /// The pod's condition types that are True: what rules' `onPodConditions` match.
    pub conditions: Vec<String>,
}

impl PodFailure {
    /// Whether a process of the pod was killed (SIGKILL of a container, 137, or a rank the
    /// worker saw killed by a signal) rather than failing on its own: the likelier cause when
    /// several pods fail at once.
    pub fn killed(&self) -> bool {
        self.exit_codes.iter().any(|(_, c)| *c == 137) || self.detail.contains("was killed by signal")
    }

    /// A disruption (eviction, preemption, drain, node shutdown) rather than a fault of the job.
    pub fn disruption(&self) -> bool {
        self.kind == FailureKind::PodEvicted
    }
}

/// The facts the operator uses about one pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObservedPod {
    /// Pod name.
    pub name: String,
    /// Pod uid (a delete is conditioned on it, so a newer pod of the same name is never hit).
    pub uid: Option<String>,
    /// The `rlplane.dev/epoch` label, when it parses.
    pub epoch: Option<u32>,
    /// The `rlplane.dev/role` label (`trainer`, `gen`, `tq`).
    pub role: Option<String>,
    /// Whether the pod runs the coordinator (`rlplane.dev/coordinator=true`).
    pub coordinator: bool,
    /// The pod's Ready condition is True (and it is not terminating).
    pub ready: bool,
    /// Phase Succeeded: every container exited 0.
    pub succeeded: bool,
    /// The pod has a deletionTimestamp.
    pub terminating: bool,
    /// The spec hash the pod was built from ([`SPEC_HASH_ANNOTATION`]).
    pub spec_hash: Option<String>,
    /// Why the pod failed, if it did.
    pub failure: Option<PodFailure>,
    /// The scheduler's word when it cannot place the pod (`PodScheduled=False`, reason
    /// `Unschedulable`), e.g. `0/4 nodes are available: 4 Insufficient nvidia.com/gpu.`
    pub unschedulable: Option<String>,
    /// A container (or init container) the kubelet cannot start, in its words: `container
    /// trainer: ErrImageNeverPull: Container image "…" is not present with pull policy of Never`.
    pub not_starting: Option<String>,
}

/// The kubelet's reasons for a waiting container that mean it will not start by itself soon: the
/// image cannot be had, or the container's config or runtime refuses it.
const NOT_STARTING: [&str; 7] = [
    "ErrImagePull",
    "ImagePullBackOff",
    "ErrImageNeverPull",
    "InvalidImageName",
    "CreateContainerConfigError",
    "CreateContainerError",
    "RunContainerError",
];

/// The first container of `pod` waiting for one of the [`NOT_STARTING`] reasons, in words.
fn not_starting(pod: &Pod) -> Option<String> {
    containers(pod).find_map(|c| {
        let w = c.state.as_ref()?.waiting.as_ref()?;
        let reason = w.reason.as_deref().filter(|r| NOT_STARTING.contains(r))?;
        Some(join(&format!("container {}: {reason}", c.name), w.message.as_deref().unwrap_or_default()))
    })
}

/// Whether `pod` is controlled by the RLJob with `uid` (a user's pod that merely carries the
/// `rlplane.dev/job` label is never touched).
pub fn owned_by(pod: &Pod, uid: &str) -> bool {
    pod.metadata
        .owner_references
        .iter()
        .flatten()
        .any(|o| o.uid == uid && o.controller == Some(true) && o.kind == "RLJob")
}

/// Reads the facts of one pod.
pub fn observe(pod: &Pod) -> ObservedPod {
    let meta = &pod.metadata;
    let label = |k: &str| meta.labels.as_ref().and_then(|l| l.get(k)).cloned();
    let status = pod.status.as_ref();
    let phase = status.and_then(|s| s.phase.as_deref()).unwrap_or("Pending");
    let terminating = meta.deletion_timestamp.is_some();
    let ready = !terminating
        && status
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
    ObservedPod {
        name: meta.name.clone().unwrap_or_default(),
        uid: meta.uid.clone(),
        epoch: label(labels::EPOCH).and_then(|e| e.parse().ok()),
        role: label(labels::ROLE),
        coordinator: label(labels::COORDINATOR).as_deref() == Some("true"),
        ready,
        succeeded: phase == "Succeeded",
        terminating,
        spec_hash: meta.annotations.as_ref().and_then(|a| a.get(SPEC_HASH_ANNOTATION)).cloned(),
        failure: failure(pod, phase),
        unschedulable: status
            .and_then(|s| s.conditions.as_ref())
            .and_then(|cs| {
                cs.iter().find(|c| {
                    c.type_ == "PodScheduled" && c.status == "False" && c.reason.as_deref() == Some("Unschedulable")
                })
            })
            .map(|c| c.message.clone().unwrap_or_default()),
        not_starting: not_starting(pod),
    }
}

fn failure(pod: &Pod, phase: &str) -> Option<PodFailure> {
    let (kind, detail, at) = failure_kind(pod, phase)?;
    let status = pod.status.as_ref();
    let exit_codes = containers(pod)
        .filter_map(|c| {
            let now = c.state.as_ref().and_then(|s| s.terminated.as_ref());
            let last = c.last_state.as_ref().and_then(|s| s.terminated.as_ref());
            let code = now.filter(|t| t.exit_code != 0).or(last.filter(|t| t.exit_code != 0))?.exit_code;
            Some((c.name.clone(), code))
        })
        .collect();
    let conditions = status
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten()
        .filter(|c| c.status == "True")
        .map(|c| c.type_.clone())
        .collect();
    Some(PodFailure { kind, detail, at, exit_codes, conditions })
}

fn containers(pod: &Pod) -> impl Iterator<Item = &ContainerStatus> {
    pod.status
        .as_ref()
        .into_iter()
        .flat_map(|s| s.init_container_statuses.iter().flatten().chain(s.container_statuses.iter().flatten()))
}

/// Whether the pod's regular containers (not its init containers or native sidecars) have all
/// terminated with exit code 0.
fn regular_containers_succeeded(pod: &Pod) -> bool {
    let regular = pod.status.as_ref().and_then(|s| s.container_statuses.as_ref());
    regular.is_some_and(|cs| {
        !cs.is_empty()
            && cs.iter().all(|c| c.state.as_ref().and_then(|s| s.terminated.as_ref()).is_some_and(|t| t.exit_code == 0))
    })
}

/// Whether and how the pod failed: the kind, a detail and when.
fn failure_kind(pod: &Pod, phase: &str) -> Option<(FailureKind, String, Option<Timestamp>)> {
    // A pod that succeeded did not fail, even when a native sidecar was stopped with SIGTERM
    // (the kubelet ignores sidecars' exit codes for the pod's phase, and so do we).
    if phase == "Succeeded" {
        return None;
    }
    let status = pod.status.as_ref();
    // Once every regular container has exited 0 the kubelet stops the native sidecars (SIGTERM)
    // and the pod completes as Succeeded: a sidecar's exit in between says nothing.
    let crashed = if regular_containers_succeeded(pod) { None } else { containers(pod).find_map(crashed_container) };
    // Preemption, the Eviction API, taint eviction and node shutdown mark the pod first; its
    // containers then die of the SIGTERM that follows, which is not their fault.
    if let Some(c) = status
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == "DisruptionTarget" && c.status == "True"))
    {
        let what = c.reason.clone().unwrap_or_else(|| "DisruptionTarget".into());
        return Some((
            FailureKind::PodEvicted,
            join(&format!("disrupted ({what})"), c.message.as_deref().unwrap_or_default()),
            c.last_transition_time.as_ref().map(|t| t.0),
        ));
    }
    if phase == "Failed" {
        let reason = status.and_then(|s| s.reason.clone()).unwrap_or_default();
        let message = status.and_then(|s| s.message.clone()).unwrap_or_default();
        if reason == "Evicted" {
            return Some((FailureKind::PodEvicted, join("evicted", &message), crashed.and_then(|(_, at)| at)));
        }
        return Some(match crashed {
            Some((detail, at)) => (FailureKind::ContainerFailed, detail, at),
            None => (
                FailureKind::PodFailed,
                join(
                    &format!("phase Failed{}", if reason.is_empty() { String::new() } else { format!(" ({reason})") }),
                    &message,
                ),
                None,
            ),
        });
    }
    // A running pod with more than one container stays Running after one of them dies: a rank is
    // gone either way.
    if let Some((detail, at)) = crashed {
        return Some((FailureKind::ContainerFailed, detail, at));
    }
    if let Some(t) = &pod.metadata.deletion_timestamp {
        return Some((FailureKind::PodDeleted, "the pod was deleted".into(), Some(t.0)));
    }
    None
}

/// A container that terminated non-zero, or restarted (only native sidecars can: pods run with
/// restartPolicy Never), with a detail and when it happened.
fn crashed_container(c: &ContainerStatus) -> Option<(String, Option<Timestamp>)> {
    if let Some(t) = c.state.as_ref().and_then(|s| s.terminated.as_ref())
        && t.exit_code != 0
    {
        let why = t.reason.as_deref().map(|r| format!(" ({r})")).unwrap_or_default();
        return Some((
            join(
                &format!("container {} exited with code {}{why}", c.name, t.exit_code),
                t.message.as_deref().unwrap_or(""),
            ),
            t.finished_at.as_ref().map(|t| t.0),
        ));
    }
    if c.restart_count > 0 {
        let last = c.last_state.as_ref().and_then(|s| s.terminated.as_ref());
        let code = last.map(|t| format!(", last exit code {}", t.exit_code)).unwrap_or_default();
        let why = last.and_then(|t| t.reason.as_deref()).map(|r| format!(" ({r})")).unwrap_or_default();
        return Some((
            format!("container {} restarted {} times{code}{why}", c.name, c.restart_count),
            last.and_then(|t| t.finished_at.as_ref()).map(|t| t.0),
        ));
    }
    None
}

fn join(what: &str, message: &str) -> String {
    let message = message.trim();
    if message.is_empty() { what.to_string() } else { format!("{what}: {message}") }
}
