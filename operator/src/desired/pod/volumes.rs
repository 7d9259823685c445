//! The pod's volumes, and where the worker and the user's containers mount them.

use k8s_openapi::api::core::v1::{
    ConfigMapVolumeSource, EmptyDirVolumeSource, KeyToPath, SecretVolumeSource, Volume, VolumeMount,
};
use rlplane_api::PodOverrides;
use rlplane_api::plan::{JOB_KEY_SECRET_KEY, POD_KEY_DIR, job_key_secret_name};
use rlplane_api::topology::{POD_IPC_DIR, plan_config_map_name};

use super::PlannedPod;
use crate::desired::{KEY_VOLUME, PLAN_KEY, PLAN_MOUNT};

/// The volume holding the plan.
const PLAN_VOLUME: &str = "plan";
/// The directory of the worker's IPC sockets.
const IPC_VOLUME: &str = "ipc";
/// The pod's memory-backed /dev/shm.
const SHM_VOLUME: &str = "dshm";

/// The worker's mounts: the plan, the epoch's key, the IPC directory, /dev/shm, then the role's
/// overrides' mounts.
pub(super) fn worker_mounts(overrides: Option<&PodOverrides>) -> Vec<VolumeMount> {
    let mut mounts = vec![
        VolumeMount {
            name: PLAN_VOLUME.into(),
            mount_path: PLAN_MOUNT.into(),
            read_only: Some(true),
            ..Default::default()
        },
        // The epoch's key: only the worker container of this epoch's pods mounts it.
        VolumeMount {
            name: KEY_VOLUME.into(),
            mount_path: POD_KEY_DIR.into(),
            read_only: Some(true),
            ..Default::default()
        },
    ];
    mounts.extend(shared_mounts());
    if let Some(o) = overrides {
        mounts.extend(o.volume_mounts.iter().cloned());
    }
    mounts
}

/// The mounts the worker shares with the user's containers: the IPC sockets and /dev/shm.
pub(super) fn shared_mounts() -> [VolumeMount; 2] {
    [
        VolumeMount { name: IPC_VOLUME.into(), mount_path: POD_IPC_DIR.into(), ..Default::default() },
        VolumeMount { name: SHM_VOLUME.into(), mount_path: "/dev/shm".into(), ..Default::default() },
    ]
}

/// The pod's volumes: the plan from its ConfigMap, the epoch's key from its Secret, the IPC
/// directory, a memory-backed /dev/shm, then the role's overrides' volumes.
pub(super) fn pod_volumes(pod: &PlannedPod) -> Vec<Volume> {
    let job_name = &pod.plan.job.name;
    let mut volumes = vec![
        Volume {
            name: PLAN_VOLUME.into(),
            config_map: Some(ConfigMapVolumeSource {
                name: plan_config_map_name(job_name),
                items: Some(vec![KeyToPath { key: PLAN_KEY.into(), path: PLAN_KEY.into(), ..Default::default() }]),
                ..Default::default()
            }),
            ..Default::default()
        },
        Volume {
            name: KEY_VOLUME.into(),
            secret: Some(SecretVolumeSource {
                secret_name: Some(job_key_secret_name(job_name, &pod.plan.job.uid, pod.epoch)),
                items: Some(vec![KeyToPath {
                    key: JOB_KEY_SECRET_KEY.into(),
                    path: JOB_KEY_SECRET_KEY.into(),
                    ..Default::default()
                }]),
                // Readable in the container whatever uid it runs as (the worker image's 65532, a
                // user's image); nothing outside the pod sees the volume.
                default_mode: Some(0o444),
                ..Default::default()
            }),
            ..Default::default()
        },
        Volume { name: IPC_VOLUME.into(), empty_dir: Some(EmptyDirVolumeSource::default()), ..Default::default() },
        Volume {
            name: SHM_VOLUME.into(),
            empty_dir: Some(EmptyDirVolumeSource { medium: Some("Memory".into()), ..Default::default() }),
            ..Default::default()
        },
    ];
    if let Some(o) = pod.role.overrides {
        volumes.extend(o.volumes.iter().cloned());
    }
    volumes
}
