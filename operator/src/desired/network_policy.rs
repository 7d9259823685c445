//! The job's NetworkPolicy: ingress from the job's own pods and from the metrics scrapers only.

use std::collections::BTreeMap;

use k8s_openapi::api::networking::v1::{
    NetworkPolicy, NetworkPolicyIngressRule, NetworkPolicyPeer, NetworkPolicyPort, NetworkPolicySpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use rlplane_api::RLJob;

use super::{JobMeta, selector_labels};

/// Name of the job's NetworkPolicy.
pub fn network_policy_name(job: &str) -> String {
    format!("{job}-ingress")
}

/// Ports of the user's containers that serve metrics: those named `metrics` or `metrics-…` in
/// the job's templates (vLLM's server, a trainer's exporter), which the scrapers may reach too.
fn user_metrics_ports(job: &RLJob) -> Vec<NetworkPolicyPort> {
    let mut ports: Vec<NetworkPolicyPort> = [&job.spec.trainer.template, &job.spec.generation.template]
        .into_iter()
        .flatten()
        .filter_map(|t| t.pod_template().ok()?.spec)
        .flat_map(|s| s.containers)
        .flat_map(|c| c.ports.unwrap_or_default())
        .filter(|p| p.name.as_deref().is_some_and(|n| n == "metrics" || n.starts_with("metrics-")))
        .map(|p| NetworkPolicyPort {
            port: Some(IntOrString::Int(p.container_port)),
            protocol: Some(p.protocol.unwrap_or_else(|| "TCP".into())),
            ..Default::default()
        })
        .collect();
    ports.sort_by_key(|p| {
        p.port.clone().map(|x| match x {
            IntOrString::Int(i) => i,
            IntOrString::String(_) => 0,
        })
    });
    ports.dedup();
    ports
}

/// The job's NetworkPolicy: its pods admit ingress from the job's own pods on every port, and
/// from the metrics scrapers on the metrics port and the user's containers' metrics ports;
/// nothing else.
pub(super) fn network_policy(job: &RLJob, meta: &JobMeta) -> NetworkPolicy {
    let name = meta.job.as_str();
    let np = &job.spec.network_policy;
    let own_pods = LabelSelector { match_labels: Some(selector_labels(name)), ..Default::default() };
    let scrapers = NetworkPolicyPeer {
        pod_selector: Some(LabelSelector {
            match_labels: Some(np.metrics_scraper_labels.clone()).filter(|l| !l.is_empty()),
            ..Default::default()
        }),
        // A namespace selector (empty: every namespace) so that Prometheus may run elsewhere.
        namespace_selector: Some(LabelSelector {
            match_labels: Some(np.metrics_scraper_namespace_labels.clone()).filter(|l| !l.is_empty()),
            ..Default::default()
        }),
        ..Default::default()
    };
    NetworkPolicy {
        metadata: meta.object(network_policy_name(name), BTreeMap::new()),
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(own_pods.clone()),
            policy_types: Some(vec!["Ingress".into()]),
            ingress: Some(vec![
                NetworkPolicyIngressRule {
                    from: Some(vec![NetworkPolicyPeer { pod_selector: Some(own_pods), ..Default::default() }]),
                    ports: None,
                },
                NetworkPolicyIngressRule {
                    from: Some(vec![scrapers]),
                    ports: Some(
                        std::iter::once(NetworkPolicyPort {
                            port: Some(IntOrString::Int(job.spec.observability.metrics_port as i32)),
                            protocol: Some("TCP".into()),
                            ..Default::default()
                        })
                        .chain(user_metrics_ports(job))
                        .collect(),
                    ),
                },
            ]),
            ..Default::default()
        }),
    }
}
