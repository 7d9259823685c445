//! The coordinator's report of progress into its RLJob's status.
//!
//! The operator owns the RLJob's status except two fields the coordinator owns: `status.step`
//! and `status.lastRefit`. The coordinator writes them with a server-side-apply patch of the
//! status subresource under its own field manager (`rlplane-coordinator`), so the two writers
//! never fight over fields; the pod's ServiceAccount may patch only its own job's status. Reports
//! are throttled (at most one a second, the last one always) and best-effort: a failed report is
//! logged, never fatal to the job.

use std::time::Duration;

use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use rlplane_api::RLJob;
use tokio::sync::mpsc;

use crate::coordinator::{Observer, Progress, StepRecord};

/// Field manager of the coordinator's status writes.
pub const FIELD_MANAGER: &str = "rlplane-coordinator";

/// The status patch for a finished step.
pub fn status_patch(step: &StepRecord) -> serde_json::Value {
    let bytes = step.refit_bytes_per_receiver;
    serde_json::json!({
        "apiVersion": "rlplane.dev/v1alpha1",
        "kind": "RLJob",
        "status": {
            "step": step.step,
            "lastRefit": {
                "version": step.version,
                "seconds": step.refit_s,
                "bytes": bytes,
                "summary": format!("v{} {:.3}s", step.version, step.refit_s),
            }
        }
    })
}

/// Reports steps into an RLJob's status from a background task.
pub struct StatusReporter {
    tx: mpsc::UnboundedSender<StepRecord>,
    task: tokio::task::JoinHandle<()>,
}

impl StatusReporter {
    /// A reporter for job `name` in `namespace`, when running inside a cluster (in-cluster
    /// credentials); `None` elsewhere (e.g. `rlplane local`).
    pub async fn in_cluster(namespace: &str, name: &str) -> Option<StatusReporter> {
        std::env::var_os("KUBERNETES_SERVICE_HOST")?;
        let client = match Client::try_default().await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "cannot reach the API server; the job's status will not show progress");
                return None;
            }
        };
        let api: Api<RLJob> = Api::namespaced(client, namespace);
        let (tx, mut rx) = mpsc::unbounded_channel::<StepRecord>();
        let name = name.to_string();
        let task = tokio::spawn(async move {
            let params = PatchParams::apply(FIELD_MANAGER);
            while let Some(mut latest) = rx.recv().await {
                // Coalesce whatever else arrived meanwhile: only the newest step matters.
                while let Ok(newer) = rx.try_recv() {
                    latest = newer;
                }
                if let Err(e) = api.patch_status(&name, &params, &Patch::Apply(status_patch(&latest))).await {
                    tracing::warn!(error = %e, step = latest.step, "reporting progress into the RLJob status failed");
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        });
        Some(StatusReporter { tx, task })
    }

    /// Sends what is still queued (waiting at most `within`), then stops.
    pub async fn finish(self, within: Duration) {
        drop(self.tx);
        let _ = tokio::time::timeout(within, self.task).await;
    }
}

/// Logs progress and, when a reporter is present, reports finished steps.
pub struct ReportingObserver<O> {
    /// The observer that logs.
    pub inner: O,
    /// The status reporter.
    pub reporter: Option<StatusReporter>,
}

impl<O: Observer> Observer for ReportingObserver<O> {
    fn progress(&self, event: Progress) {
        if let (Progress::StepDone(r), Some(rep)) = (&event, &self.reporter) {
            let _ = rep.tx.send((**r).clone());
        }
        self.inner.progress(event);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_patch_carries_only_the_coordinators_fields() {
        let rec = StepRecord {
            step: 7,
            version: 7,
            refit_s: 0.0441,
            refit_bytes_per_receiver: 16_060_522_496,
            ..Default::default()
        };
        let p = status_patch(&rec);
        let status = p["status"].as_object().unwrap();
        let mut keys: Vec<&String> = status.keys().collect();
        keys.sort();
        assert_eq!(keys, ["lastRefit", "step"], "never the operator's fields");
        assert_eq!(p["status"]["lastRefit"]["summary"], "v7 0.044s");
        assert_eq!(p["kind"], "RLJob");
        // The patch is a valid RLJobStatus fragment.
        let parsed: rlplane_api::RLJobStatus = serde_json::from_value(p["status"].clone()).unwrap();
        assert_eq!(parsed.step, Some(7));
    }
}
