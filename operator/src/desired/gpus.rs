//! GPUs as `spec.gpus` asks: the device plugin's `nvidia.com/gpu` resource, or dynamic resource
//! allocation through one ResourceClaimTemplate per GPU count.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, EnvVar, PodResourceClaim, PodSpec, ResourceClaim, ResourceRequirements};
use k8s_openapi::api::resource::v1::{
    DeviceClaim, DeviceRequest, ExactDeviceRequest, ResourceClaimSpec, ResourceClaimTemplate, ResourceClaimTemplateSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use rlplane_api::plan::WorkerPlan;
use rlplane_api::{Device, GpuSharing, RLJob};

use super::{JobMeta, WORKER_CONTAINER};

/// The name of the job's ResourceClaimTemplate for pods of `gpus` GPUs.
pub fn gpu_claim_template_name(job: &str, gpus: u32) -> String {
    format!("{job}-gpus-{gpus}")
}

/// The pod's name for its GPU claim, which the worker and every user container reference.
pub const GPU_CLAIM: &str = "gpus";

/// `spec.gpus.sharing: ResourceClaim`: one ResourceClaimTemplate per GPU count among the job's
/// pods, asking its DeviceClass for exactly that many devices.
pub(super) fn gpu_claim_templates(job: &RLJob, plan: &WorkerPlan, meta: &JobMeta) -> Vec<ResourceClaimTemplate> {
    let spec = &job.spec;
    if spec.device != Device::Gpu || spec.gpus.sharing != GpuSharing::ResourceClaim {
        return Vec::new();
    }
    let class = spec.gpus.device_class_name.clone().unwrap_or_default();
    let mut counts: Vec<u32> = plan.pods.iter().map(|p| p.gpus).filter(|&g| g > 0).collect();
    counts.sort_unstable();
    counts.dedup();
    counts
        .into_iter()
        .map(|gpus| ResourceClaimTemplate {
            metadata: meta.object(gpu_claim_template_name(&plan.job.name, gpus), BTreeMap::new()),
            spec: ResourceClaimTemplateSpec {
                metadata: None,
                spec: ResourceClaimSpec {
                    devices: Some(DeviceClaim {
                        requests: Some(vec![DeviceRequest {
                            name: GPU_CLAIM.into(),
                            exactly: Some(ExactDeviceRequest {
                                device_class_name: class.clone(),
                                allocation_mode: Some("ExactCount".into()),
                                count: Some(gpus as i64),
                                ..Default::default()
                            }),
                            ..Default::default()
                        }]),
                        ..Default::default()
                    }),
                },
            },
        })
        .collect()
}

/// Gives the pod's containers its GPUs as `spec.gpus` says. `DevicePlugin`: without user
/// containers the worker requests them; with them, the first user container does (unless one
/// asks itself) and the worker sees the node's GPUs by environment, with the NVIDIA toolkit
/// mounting the driver. `ResourceClaim`: the pod's claim, used by the worker and every user
/// container. Either way every container enumerates devices in PCI order, so that device n is
/// the same GPU in each.
pub(super) fn assign_gpus(pod: &mut PodSpec, job: &RLJob, gpus: u32) {
    let spec = &job.spec;
    if spec.device != Device::Gpu || gpus == 0 {
        return;
    }
    let sidecar = pod.init_containers.iter().flatten().any(|c| c.name == WORKER_CONTAINER);
    match spec.gpus.sharing {
        GpuSharing::DevicePlugin if !sidecar => {
            for w in pod.containers.iter_mut().filter(|c| c.name == WORKER_CONTAINER) {
                w.resources = with_gpus(w.resources.take(), gpus);
            }
        }
        GpuSharing::DevicePlugin => {
            let asks = |c: &Container| {
                c.resources.as_ref().and_then(|r| r.limits.as_ref()).is_some_and(|l| l.contains_key("nvidia.com/gpu"))
            };
            if !pod.containers.iter().any(asks)
                && let Some(first) = pod.containers.first_mut()
            {
                first.resources = with_gpus(first.resources.take(), gpus);
            }
            for w in pod.init_containers.iter_mut().flatten().filter(|c| c.name == WORKER_CONTAINER) {
                set_env_default(w, "NVIDIA_VISIBLE_DEVICES", "all");
                set_env_default(w, "NVIDIA_DRIVER_CAPABILITIES", "compute,utility");
            }
        }
        GpuSharing::ResourceClaim => {
            pod.resource_claims = Some(vec![PodResourceClaim {
                name: GPU_CLAIM.into(),
                resource_claim_template_name: Some(gpu_claim_template_name(
                    job.metadata.name.as_deref().unwrap_or_default(),
                    gpus,
                )),
                ..Default::default()
            }]);
            for c in gpu_containers(pod) {
                let claims = c.resources.get_or_insert_with(Default::default).claims.get_or_insert_with(Vec::new);
                claims.push(ResourceClaim { name: GPU_CLAIM.into(), request: None });
            }
        }
    }
    for c in gpu_containers(pod) {
        set_env_default(c, "CUDA_DEVICE_ORDER", "PCI_BUS_ID");
    }
}

/// The containers that use the pod's GPUs: the worker and every user container (the user's own
/// init containers do not).
fn gpu_containers(pod: &mut PodSpec) -> impl Iterator<Item = &mut Container> {
    pod.containers.iter_mut().chain(pod.init_containers.iter_mut().flatten().filter(|c| c.name == WORKER_CONTAINER))
}

/// Sets `name` in the container's environment unless the user's spec already does.
fn set_env_default(c: &mut Container, name: &str, value: &str) {
    let env = c.env.get_or_insert_with(Vec::new);
    if !env.iter().any(|e| e.name == name) {
        env.push(EnvVar { name: name.into(), value: Some(value.into()), ..Default::default() });
    }
}

/// The user's resources with `nvidia.com/gpu` set to `gpus` in limits and requests (when > 0).
fn with_gpus(resources: Option<ResourceRequirements>, gpus: u32) -> Option<ResourceRequirements> {
    if gpus == 0 {
        return resources;
    }
    let mut r = resources.unwrap_or_default();
    let q = Quantity(gpus.to_string());
    r.limits.get_or_insert_with(BTreeMap::new).insert("nvidia.com/gpu".into(), q.clone());
    r.requests.get_or_insert_with(BTreeMap::new).insert("nvidia.com/gpu".into(), q);
    Some(r)
}
