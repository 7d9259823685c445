//! The pod's containers: the worker, and the user's containers wired to it.

use k8s_openapi::api::core::v1::{
    Container, ContainerPort, EnvVar, EnvVarSource, HTTPGetAction, ObjectFieldSelector, Probe,
};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use rlplane_api::plan::IPC_DIR_ENV;
use rlplane_api::topology::POD_IPC_DIR;
use rlplane_api::{RLJobSpec, UserTemplate};

use super::PlannedPod;
use super::volumes::{shared_mounts, worker_mounts};
use crate::desired::{OperatorConfig, PLAN_KEY, PLAN_MOUNT, WORKER_CONTAINER};

/// The worker container: `rlplane worker` on the mounted plan, serving its processes' ports,
/// ready once its `/readyz` says so.
pub(super) fn worker_container(pod: &PlannedPod, cfg: &OperatorConfig) -> Container {
    let overrides = pod.role.overrides;
    let mut env = vec![env_field("RLPLANE_POD", "metadata.name"), env_field("RLPLANE_NAMESPACE", "metadata.namespace")];
    if let Some(o) = overrides {
        env.extend(o.env.iter().cloned());
    }
    Container {
        name: WORKER_CONTAINER.into(),
        image: Some(pod.role.image.clone().unwrap_or_else(|| cfg.worker_image.clone())),
        image_pull_policy: cfg.image_pull_policy.clone(),
        command: Some(vec!["rlplane".into(), "worker".into(), "--plan".into(), format!("{PLAN_MOUNT}/{PLAN_KEY}")]),
        env: Some(env),
        ports: Some(worker_ports(pod)),
        volume_mounts: Some(worker_mounts(overrides)),
        resources: pod.role.resources.clone(),
        readiness_probe: Some(Probe {
            http_get: Some(HTTPGetAction {
                path: Some("/readyz".into()),
                port: IntOrString::String("metrics".into()),
                ..Default::default()
            }),
            period_seconds: Some(2),
            failure_threshold: Some(3),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The worker's ports: metrics, and every port of the pod's processes, in port order, each once.
fn worker_ports(pod: &PlannedPod) -> Vec<ContainerPort> {
    let plan = pod.plan;
    let mut ports = vec![ContainerPort {
        name: Some("metrics".into()),
        container_port: pod.job.spec.observability.metrics_port as i32,
        ..Default::default()
    }];
    for &p in &pod.procs {
        let pr = &plan.process(p).ports;
        for (kind, port) in [
            ("control", pr.control),
            ("tq", pr.tq_controller),
            ("refit", pr.refit),
            ("fanout", pr.fanout),
            ("storage", pr.storage),
        ] {
            if let Some(port) = port {
                ports.push(ContainerPort {
                    // Port names are at most 15 characters: kind + local index.
                    name: Some(format!("{kind}-{}", plan.process(p).local)),
                    container_port: port as i32,
                    ..Default::default()
                });
            }
        }
    }
    ports.sort_by_key(|p| p.container_port);
    ports.dedup_by_key(|p| p.container_port);
    ports
}

/// A container of the user's template `t`, given the IPC directory and /dev/shm it shares with
/// the worker (unless it mounts something at those paths itself) and the environment that tells
/// the client library where the worker is.
pub(super) fn user_container(mut c: Container, spec: &RLJobSpec, t: &UserTemplate) -> Container {
    let m = c.volume_mounts.get_or_insert_with(Vec::new);
    m.extend(
        shared_mounts().into_iter().filter(|s| !m.iter().any(|x| x.mount_path == s.mount_path)).collect::<Vec<_>>(),
    );
    let e = c.env.get_or_insert_with(Vec::new);
    e.push(env_field("RLPLANE_POD", "metadata.name"));
    e.push(EnvVar { name: IPC_DIR_ENV.into(), value: Some(POD_IPC_DIR.into()), ..Default::default() });
    // The pod's /dev/shm is its own memory-backed volume, and the user's container
    // may run as another user than the worker: the client's shared-memory files are
    // created readable and writable by both (docs/local-api.md).
    e.push(EnvVar { name: "RLPLANE_SHM_MODE".into(), value: Some("0666".into()), ..Default::default() });
    e.extend(spec.template_env(t).into_iter().map(|(name, value)| EnvVar {
        name: name.into(),
        value: Some(value),
        ..Default::default()
    }));
    c
}

/// An environment variable holding a field of the pod (`metadata.name`, say).
fn env_field(name: &str, path: &str) -> EnvVar {
    EnvVar {
        name: name.into(),
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector { field_path: path.into(), ..Default::default() }),
            ..Default::default()
        }),
        ..Default::default()
    }
}
