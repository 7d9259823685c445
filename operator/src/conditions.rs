//! The RLJob's status conditions: their types, the reasons the operator writes, and a setter that
//! moves `lastTransitionTime` only when a condition's status changes.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;

/// `PodsCreated`: every pod of the current epoch has been created.
pub const PODS_CREATED: &str = "PodsCreated";
/// `PodsReady`: every pod of the current epoch is ready.
pub const PODS_READY: &str = "PodsReady";
/// `Running`: the gang came up (every pod was ready) and has not stopped since.
pub const RUNNING: &str = "Running";
/// `Restarting`: the gang is being torn down and recreated with a new epoch.
pub const RESTARTING: &str = "Restarting";
/// `Suspended`: `spec.runPolicy.suspend` is true; no pods.
pub const SUSPENDED: &str = "Suspended";
/// `Succeeded`: the coordinator finished every step.
pub const SUCCEEDED: &str = "Succeeded";
/// `Failed`: the job failed for good (or, reason InvalidSpec, until its spec changes).
pub const FAILED: &str = "Failed";

/// Every condition type, in the order they are written.
pub const ALL: [&str; 7] = [PODS_CREATED, PODS_READY, RUNNING, RESTARTING, SUSPENDED, SUCCEEDED, FAILED];

/// Reasons the operator writes (CamelCase, as Kubernetes requires).
pub mod reasons {
    /// PodsCreated=True: the epoch's pods were created.
    pub const PODS_CREATED: &str = "PodsCreated";
    /// PodsCreated=False: pods of an earlier epoch in the way (holding a new pod's name, or any
    /// under a gang scheduler) must go before the new gang is created.
    pub const WAITING_FOR_OLD_PODS: &str = "WaitingForOldPods";
    /// PodsCreated=False: creating the pods or the objects they need failed (see the message).
    pub const CREATE_FAILED: &str = "CreateFailed";
    /// PodsCreated=False: the gang is being torn down for a restart.
    pub const RESTARTING: &str = "Restarting";
    /// PodsCreated=False: the job is inactive and its pods are being deleted.
    pub const DELETING_PODS: &str = "DeletingPods";
    /// PodsCreated=False: the job is inactive and none of its pods or objects exist.
    pub const NO_PODS: &str = "NoPods";
    /// PodsReady: every pod is ready.
    pub const ALL_PODS_READY: &str = "AllPodsReady";
    /// PodsReady=False while pods exist.
    pub const PODS_NOT_READY: &str = "PodsNotReady";
    /// PodsReady=False: the scheduler cannot place some pods (the message quotes it).
    pub const UNSCHEDULABLE: &str = "Unschedulable";
    /// PodsReady=False: a container cannot start (its image cannot be pulled, its config refers
    /// to something missing…; the message names the pod, the container and the kubelet's reason).
    pub const CONTAINERS_NOT_STARTING: &str = "ContainersNotStarting";
    /// Restarting=True after a spec change.
    pub const SPEC_CHANGED: &str = "SpecChanged";
    /// Restarting=False once the new epoch's pods exist.
    pub const RESTARTED: &str = "Restarted";
    /// Suspended=True.
    pub const SUSPENDED: &str = "Suspended";
    /// Suspended=False after a resume.
    pub const RESUMED: &str = "Resumed";
    /// Succeeded=True.
    pub const COORDINATOR_SUCCEEDED: &str = "CoordinatorSucceeded";
    /// Failed=True: the spec breaks validation rules.
    pub const INVALID_SPEC: &str = "InvalidSpec";
    /// Failed=True: a pod failed after `backoffLimit` restarts.
    pub const BACKOFF_LIMIT_EXCEEDED: &str = "BackoffLimitExceeded";
    /// Failed: disruptions exhausted `runPolicy.failurePolicy.disruptionLimit`.
    pub const DISRUPTION_LIMIT_EXCEEDED: &str = "DisruptionLimitExceeded";
    /// Failed: a `failurePolicy` rule with action FailJob matched.
    pub const FAILURE_POLICY: &str = "FailurePolicy";
    /// Failed=True: the job ran past `activeDeadlineSeconds`.
    pub const DEADLINE_EXCEEDED: &str = "DeadlineExceeded";
}

/// The condition of `type_`, if present.
pub fn find<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}

/// Whether the condition of `type_` is present with status True.
pub fn is_true(conditions: &[Condition], type_: &str) -> bool {
    find(conditions, type_).is_some_and(|c| c.status == "True")
}

/// Whether the condition of `type_` is present with status True and `reason`.
pub fn has_reason(conditions: &[Condition], type_: &str, status: bool, reason: &str) -> bool {
    find(conditions, type_).is_some_and(|c| c.status == status_str(status) && c.reason == reason)
}

fn status_str(status: bool) -> &'static str {
    if status { "True" } else { "False" }
}

/// Sets a condition. `lastTransitionTime` becomes `now` only when the condition is new or its
/// status flips; reason, message and observedGeneration follow the arguments. Conditions are kept
/// in the order of [`ALL`] (others after them, as found) so that equal states serialize equally.
pub fn set(
    conditions: &mut Vec<Condition>,
    type_: &str,
    status: bool,
    reason: &str,
    message: &str,
    generation: Option<i64>,
    now: Timestamp,
) {
    let status = status_str(status);
    match conditions.iter_mut().find(|c| c.type_ == type_) {
        Some(c) => {
            if c.status != status {
                c.status = status.into();
                c.last_transition_time = Time(now);
            }
            c.reason = reason.into();
            c.message = message.into();
            c.observed_generation = generation;
        }
        None => conditions.push(Condition {
            type_: type_.into(),
            status: status.into(),
            reason: reason.into(),
            message: message.into(),
            observed_generation: generation,
            last_transition_time: Time(now),
        }),
    }
    conditions.sort_by_key(|c| ALL.iter().position(|t| *t == c.type_).unwrap_or(ALL.len()));
}
