//! The coordinator's report of progress into its RLJob's status.
//!
//! The operator owns the RLJob's status except five fields the coordinator owns: `status.step`,
//! `status.lastRefit`, `status.stall` (what a wait of the coordinator's that has lasted
//! [`crate::patience::REPORT_EVERY`] waits for; gone when it ends), `status.checkpoint` (the
//! newest checkpoint the trainer reported; a resumed epoch starts with the one it resumed from,
//! so that the field is never lost between epochs) and `status.scalars` (the scalars of the last
//! step that reported any). The coordinator writes them
//! with a server-side-apply patch of the status subresource under its own field manager
//! (`rlplane-coordinator`), so the two writers never fight over fields; the pod's ServiceAccount
//! may patch only its own job's status. Every patch carries all five as they stand (a field left
//! out of an apply is removed). Reports are throttled (at most one a second, the last one always)
//! and best-effort: a failed report is logged, never fatal to the job.

use std::time::Duration;

use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use rlplane_api::{CheckpointRef, RLJob, StepScalars};
use tokio::sync::mpsc;

use crate::coordinator::{Observer, Progress, StepRecord};
use crate::patience::Stall;

/// Field manager of the coordinator's status writes.
pub const FIELD_MANAGER: &str = "rlplane-coordinator";

/// What the coordinator has to say in the status: the last finished step, the current stall and
/// the newest checkpoint.
#[derive(Clone, Debug, Default)]
pub struct CoordinatorStatus {
    /// The last finished step.
    pub step: Option<StepRecord>,
    /// What a long wait waits for right now.
    pub stall: Option<Stall>,
    /// The newest checkpoint the trainer reported.
    pub checkpoint: Option<CheckpointRef>,
    /// The scalars of the last step that reported any.
    pub scalars: Option<StepScalars>,
}

/// The status patch for what the coordinator has to say.
pub fn status_patch(now: &CoordinatorStatus) -> serde_json::Value {
    let mut status = serde_json::Map::new();
    // Before an epoch's first step, the last finished step is the checkpoint's it resumed from:
    // an apply without `step` would remove it, and an epoch resumed from the last step's
    // checkpoint (a coordinator killed after it) finishes without running one.
    if let (None, Some(cp)) = (&now.step, &now.checkpoint) {
        status.insert("step".into(), cp.step.into());
    }
    if let Some(step) = &now.step {
        status.insert("step".into(), step.step.into());
        status.insert(
            "lastRefit".into(),
            serde_json::json!({
                "version": step.version,
                "seconds": step.refit_s,
                "bytes": step.refit_bytes_per_receiver,
                "summary": format!("v{} {:.3}s", step.version, step.refit_s),
            }),
        );
    }
    if let Some(stall) = &now.stall {
        status.insert(
            "stall".into(),
            serde_json::json!({
                "phase": stall.phase,
                "waitingFor": stall.waiting_for,
                "seconds": stall.seconds.round() as u64,
                "message": stall.message(),
            }),
        );
    }
    if let Some(cp) = &now.checkpoint {
        status.insert("checkpoint".into(), serde_json::json!({"step": cp.step, "uri": cp.uri}));
    }
    if let Some(s) = &now.scalars {
        status.insert("scalars".into(), serde_json::json!({"step": s.step, "values": s.values}));
    }
    serde_json::json!({"apiVersion": "rlplane.dev/v1alpha1", "kind": "RLJob", "status": status})
}

/// One change to report.
enum Report {
    Step(Box<StepRecord>),
    Stall(Option<Stall>),
    Checkpoint(CheckpointRef),
}

/// Reports steps and stalls into an RLJob's status from a background task.
pub struct StatusReporter {
    tx: mpsc::UnboundedSender<Report>,
    task: tokio::task::JoinHandle<()>,
}

impl StatusReporter {
    /// A reporter for job `name` in `namespace`, when running inside a cluster (in-cluster
    /// credentials); `None` elsewhere (e.g. `rlplane local`). `resumed` is the checkpoint the
    /// epoch resumed from: it stays the reported one until the trainer saves a newer one.
    pub async fn in_cluster(namespace: &str, name: &str, resumed: Option<CheckpointRef>) -> Option<StatusReporter> {
        std::env::var_os("KUBERNETES_SERVICE_HOST")?;
        let client = match Client::try_default().await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "cannot reach the API server; the job's status will not show progress");
                return None;
            }
        };
        let api: Api<RLJob> = Api::namespaced(client, namespace);
        let (tx, mut rx) = mpsc::unbounded_channel::<Report>();
        let name = name.to_string();
        let task = tokio::spawn(async move {
            let params = PatchParams::apply(FIELD_MANAGER);
            let mut now = CoordinatorStatus { checkpoint: resumed, ..Default::default() };
            while let Some(first) = rx.recv().await {
                // Take in whatever else arrived meanwhile: only the newest of each matters.
                let mut next = Some(first);
                while let Some(report) = next.take().or_else(|| rx.try_recv().ok()) {
                    match report {
                        Report::Step(step) => {
                            if !step.scalars.is_empty() {
                                now.scalars =
                                    Some(StepScalars { step: step.step as u64, values: step.scalars.clone() });
                            }
                            now.step = Some(*step);
                        }
                        Report::Stall(stall) => now.stall = stall,
                        Report::Checkpoint(cp) => now.checkpoint = Some(cp),
                    }
                }
                if let Err(e) = api.patch_status(&name, &params, &Patch::Apply(status_patch(&now))).await {
                    tracing::warn!(error = %e, "reporting progress into the RLJob status failed");
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
        if let Some(rep) = &self.reporter {
            match &event {
                Progress::StepDone(r) => {
                    let _ = rep.tx.send(Report::Step(r.clone()));
                }
                Progress::Stalled(stall) => {
                    let _ = rep.tx.send(Report::Stall(stall.clone()));
                }
                Progress::Checkpoint(cp) => {
                    let _ = rep.tx.send(Report::Checkpoint(cp.clone()));
                }
                _ => {}
            }
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
        let stall = Stall { phase: "train".into(), waiting_for: vec!["trainer-1".into()], seconds: 12.4 };
        let checkpoint = Some(CheckpointRef { step: 5, uri: "s3://ckpt/step-5".into() });
        let scalars = Some(StepScalars { step: 6, values: [("reward_mean".to_string(), 0.75)].into() });
        let p = status_patch(&CoordinatorStatus { step: Some(rec), stall: Some(stall), checkpoint, scalars });
        let status = p["status"].as_object().unwrap();
        let mut keys: Vec<&String> = status.keys().collect();
        keys.sort();
        assert_eq!(keys, ["checkpoint", "lastRefit", "scalars", "stall", "step"], "never the operator's fields");
        assert_eq!(p["status"]["scalars"]["values"]["reward_mean"], 0.75);
        assert_eq!(p["status"]["checkpoint"]["uri"], "s3://ckpt/step-5");
        assert_eq!(p["status"]["lastRefit"]["summary"], "v7 0.044s");
        assert_eq!(p["status"]["stall"]["message"], "train: waiting 12s for trainer-1");
        assert_eq!(p["kind"], "RLJob");
        // The patch is a valid RLJobStatus fragment.
        let parsed: rlplane_api::RLJobStatus = serde_json::from_value(p["status"].clone()).unwrap();
        assert_eq!(parsed.step, Some(7));
        assert_eq!(parsed.stall.unwrap().waiting_for, ["trainer-1"]);
    }

    #[test]
    fn a_stall_that_ended_leaves_the_patch_and_so_the_status() {
        let p = status_patch(&CoordinatorStatus { step: Some(StepRecord::default()), ..Default::default() });
        assert!(p["status"].get("stall").is_none(), "an apply without the field removes it");
        let before_any_step = status_patch(&CoordinatorStatus {
            step: None,
            stall: Some(Stall { phase: "connecting".into(), waiting_for: vec!["gen-0".into()], seconds: 5.0 }),
            checkpoint: None,
            scalars: None,
        });
        assert!(before_any_step["status"].get("step").is_none());
        assert_eq!(before_any_step["status"]["stall"]["waitingFor"][0], "gen-0");
    }

    #[test]
    fn a_resumed_epoch_reports_its_checkpoints_step_until_it_finishes_one() {
        let resumed = Some(CheckpointRef { step: 150, uri: "s3://ckpt/step-150".into() });
        let p = status_patch(&CoordinatorStatus { checkpoint: resumed.clone(), ..Default::default() });
        assert_eq!(p["status"]["step"], 150, "the step stays, even if the epoch has none left to run");
        assert!(p["status"].get("lastRefit").is_none());
        let rec = StepRecord { step: 151, ..Default::default() };
        let p = status_patch(&CoordinatorStatus { step: Some(rec), checkpoint: resumed, ..Default::default() });
        assert_eq!(p["status"]["step"], 151);
    }
}
