//! The gang scheduler's PodGroup (Volcano or scheduler-plugins coscheduling), which holds the
//! job's pods until all of them can be placed.

use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
use rlplane_api::{GangScheduler, RLJob};

use super::{JobMeta, common_labels};

/// Name of the job's PodGroup.
pub fn pod_group_name(job: &str) -> String {
    format!("{job}-gang")
}

/// The PodGroup of `scheduling.gang`, asking for all `pods` at once; None without a gang
/// scheduler. A dynamic object: the scheduler's API may not be installed.
pub(super) fn pod_group(job: &RLJob, meta: &JobMeta, pods: usize) -> Option<DynamicObject> {
    let (group, version) = match job.spec.scheduling.gang {
        GangScheduler::None => return None,
        GangScheduler::Volcano => ("scheduling.volcano.sh", "v1beta1"),
        GangScheduler::Coscheduling => ("scheduling.x-k8s.io", "v1alpha1"),
    };
    let ar = ApiResource::from_gvk(&GroupVersionKind::gvk(group, version, "PodGroup"));
    let mut spec = serde_json::json!({ "minMember": pods });
    if let Some(pc) = &job.spec.scheduling.priority_class_name
        && job.spec.scheduling.gang == GangScheduler::Volcano
    {
        spec["priorityClassName"] = pc.clone().into();
    }
    let mut obj = DynamicObject::new(&pod_group_name(&meta.job), &ar)
        .within(&meta.namespace)
        .data(serde_json::json!({ "spec": spec }));
    obj.metadata.labels = Some(common_labels(&meta.job));
    obj.metadata.owner_references = Some(vec![meta.owner.clone()]);
    Some(obj)
}
