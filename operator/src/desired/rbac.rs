//! The worker's identity: a ServiceAccount, a Role that may only read and patch this job's status
//! (the coordinator reports `status.step` and `status.lastRefit`), and the RoleBinding that grants
//! it to the worker's account and to every account a user template names.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use kube::Resource;
use rlplane_api::RLJob;

use super::JobMeta;

/// Name of the job's worker ServiceAccount, Role and RoleBinding.
pub fn worker_service_account_name(job: &str) -> String {
    format!("{job}-worker")
}

/// ServiceAccounts named by the job's user templates (pods built from them run as those).
fn template_service_accounts(job: &RLJob) -> Vec<String> {
    [&job.spec.trainer.template, &job.spec.generation.template]
        .into_iter()
        .flatten()
        .filter_map(|t| t.pod_template().ok()?.spec?.service_account_name)
        .collect()
}

/// `<job>-worker`: the account the job's pods run as unless a user template names its own.
pub(super) fn service_account(meta: &JobMeta) -> ServiceAccount {
    ServiceAccount {
        metadata: meta.object(worker_service_account_name(&meta.job), BTreeMap::new()),
        // Only the coordinator's pod mounts a token (see `pod::default_service_account`); the
        // account itself allows it.
        ..Default::default()
    }
}

/// `<job>-worker`: `get` and `patch` on this job's `rljobs/status`, nothing else.
pub(super) fn role(meta: &JobMeta) -> Role {
    Role {
        metadata: meta.object(worker_service_account_name(&meta.job), BTreeMap::new()),
        rules: Some(vec![PolicyRule {
            api_groups: Some(vec![RLJob::group(&()).into_owned()]),
            resources: Some(vec![format!("{}/status", RLJob::plural(&()))]),
            resource_names: Some(vec![meta.job.clone()]),
            verbs: vec!["get".into(), "patch".into()],
            ..Default::default()
        }]),
    }
}

/// Binds the worker Role to `<job>-worker` and to every ServiceAccount a user template names
/// (each once, the worker's first).
pub(super) fn role_binding(job: &RLJob, meta: &JobMeta) -> RoleBinding {
    let worker_sa = worker_service_account_name(&meta.job);
    let mut subjects = vec![worker_sa.clone()];
    for sa in template_service_accounts(job) {
        if !subjects.contains(&sa) {
            subjects.push(sa);
        }
    }
    RoleBinding {
        metadata: meta.object(worker_sa.clone(), BTreeMap::new()),
        role_ref: RoleRef { api_group: "rbac.authorization.k8s.io".into(), kind: "Role".into(), name: worker_sa },
        subjects: Some(
            subjects
                .into_iter()
                .map(|sa| Subject {
                    kind: "ServiceAccount".into(),
                    name: sa,
                    namespace: Some(meta.namespace.clone()),
                    ..Default::default()
                })
                .collect(),
        ),
    }
}
