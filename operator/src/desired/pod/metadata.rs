//! A pod's labels and annotations: the operator's (role, index, epoch, ranks, gang and queue
//! groups, spec hash) and the user's (from the role's templates and overrides).

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use rlplane_api::GangScheduler;
use rlplane_api::plan::ProcessRole;

use super::{PlannedPod, RoleSettings};
use crate::desired::{JobMeta, SPEC_HASH_ANNOTATION, kueue_pod_group_name, kueue_queue, labels, pod_group_name};

/// The pod's metadata: its name, the operator's labels and annotations, and the user's labels
/// and annotations beside them.
pub(super) fn pod_metadata(pod: &PlannedPod, spec_hash: &str, meta: &JobMeta) -> ObjectMeta {
    let kueue_queue = kueue_queue(pod.job);
    let mut metadata = meta.object(pod.entry.name.clone(), operator_labels(pod, kueue_queue.as_deref()));
    let mut annotations: BTreeMap<String, String> = BTreeMap::new();
    add_user_metadata(metadata.labels.get_or_insert_with(BTreeMap::new), &mut annotations, &pod.role);
    add_operator_annotations(&mut annotations, pod, kueue_queue.is_some(), spec_hash);
    metadata.annotations = Some(annotations);
    metadata
}

/// The operator's labels on a pod: its role, index, epoch and first rank, whether it runs the
/// coordinator, and the gang scheduler's and Kueue's group labels.
fn operator_labels(pod: &PlannedPod, kueue_queue: Option<&str>) -> BTreeMap<String, String> {
    let (plan, entry, job_name) = (pod.plan, pod.entry, &pod.plan.job.name);
    let first_rank = pod.procs.iter().find_map(|&p| match plan.process(p).role {
        ProcessRole::Trainer(c) => Some(c.rank),
        ProcessRole::Generation(c) => Some(c.rank),
        ProcessRole::Storage { unit } => Some(unit),
        ProcessRole::Coordinator => None,
    });
    let mut pod_labels = BTreeMap::from([
        (labels::ROLE.to_string(), entry.role.short().to_string()),
        (labels::INDEX.to_string(), entry.index.to_string()),
        (labels::EPOCH.to_string(), pod.epoch.to_string()),
        ("app.kubernetes.io/component".to_string(), entry.role.short().to_string()),
    ]);
    if let Some(r) = first_rank {
        pod_labels.insert(labels::FIRST_RANK.into(), r.to_string());
    }
    if pod.runs_coordinator() {
        pod_labels.insert(labels::COORDINATOR.into(), "true".into());
    }
    match pod.job.spec.scheduling.gang {
        GangScheduler::Coscheduling => {
            pod_labels.insert("scheduling.x-k8s.io/pod-group".into(), pod_group_name(job_name));
        }
        GangScheduler::Volcano | GangScheduler::None => {}
    }
    if let Some(q) = kueue_queue {
        // Kueue's plain-pod group integration: pods carrying the queue and a group name are held
        // behind Kueue's scheduling gate and admitted together, as one workload of all the pods.
        pod_labels.insert(labels::KUEUE_QUEUE.into(), q.to_string());
        pod_labels.insert(labels::KUEUE_POD_GROUP.into(), kueue_pod_group_name(job_name, pod.epoch));
    }
    pod_labels
}

/// Adds the labels and annotations of the role's templates, then of its overrides. A user's
/// label never replaces one already there (the operator's, or an earlier template's); a later
/// annotation replaces an earlier one.
fn add_user_metadata(
    pod_labels: &mut BTreeMap<String, String>,
    annotations: &mut BTreeMap<String, String>,
    role: &RoleSettings,
) {
    for t in &role.templates {
        if let Ok(pt) = t.pod_template()
            && let Some(m) = pt.metadata
        {
            annotations.extend(m.annotations.unwrap_or_default());
            for (k, v) in m.labels.unwrap_or_default() {
                pod_labels.entry(k).or_insert(v);
            }
        }
    }
    if let Some(o) = role.overrides {
        annotations.extend(o.annotations.clone());
        for (k, v) in &o.labels {
            pod_labels.entry(k.clone()).or_insert(v.clone());
        }
    }
}

/// Adds the operator's annotations, over the user's: Volcano's group name, Kueue's group size,
/// the pod's processes and the hash of the spec it was built from.
fn add_operator_annotations(
    annotations: &mut BTreeMap<String, String>,
    pod: &PlannedPod,
    queued: bool,
    spec_hash: &str,
) {
    let plan = pod.plan;
    if pod.job.spec.scheduling.gang == GangScheduler::Volcano {
        annotations.insert("scheduling.k8s.io/group-name".into(), pod_group_name(&plan.job.name));
    }
    if queued {
        annotations.insert(labels::KUEUE_POD_GROUP_COUNT.into(), plan.pods.len().to_string());
    }
    annotations.insert(
        "rlplane.dev/processes".into(),
        pod.procs.iter().map(|&p| plan.process(p).name.as_str()).collect::<Vec<_>>().join(","),
    );
    annotations.insert(SPEC_HASH_ANNOTATION.into(), spec_hash.into());
}
