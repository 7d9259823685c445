//! The job's headless Service, which gives every pod a stable DNS name.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use rlplane_api::RLJob;
use rlplane_api::topology::headless_service_name;

use super::{JobMeta, selector_labels};

/// `<job>-headless`: selects the job's pods and publishes their addresses before they are ready.
pub(super) fn headless_service(job: &RLJob, meta: &JobMeta) -> Service {
    Service {
        metadata: meta.object(headless_service_name(&meta.job), BTreeMap::new()),
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".into()),
            // Ranks rendezvous before they are ready: their DNS names must resolve at once.
            publish_not_ready_addresses: Some(true),
            selector: Some(selector_labels(&meta.job)),
            ports: Some(vec![ServicePort {
                name: Some("metrics".into()),
                port: job.spec.observability.metrics_port as i32,
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    }
}
