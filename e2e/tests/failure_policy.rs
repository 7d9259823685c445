//! `spec.runPolicy.failurePolicy` through the real cluster (issue 28 part 2): a pod evicted through
//! the Eviction API (the API server marks it `DisruptionTarget`, then deletes it; the kubelet
//! stops its containers) restarts the gang as a disruption, which does not burn
//! `backoffLimit`; a rule with action FailJob fails the job at once, naming the rule.
//! Without KUBECONFIG every test prints that it skipped and passes (CI makes that an error).

use anyhow::Context as _;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, EvictParams};
use rlplane_api::Phase;
use rlplane_e2e::jobs::Cluster;
use rlplane_e2e::{epoch_of, phase_of};

/// `manifests/rljob-cpu.yaml`, long enough to be interrupted, with `run_policy` appended to its
/// spec (YAML lines indented under `runPolicy:`).
fn long_job(text: String, run_policy: &str) -> String {
    let text = text.replace("steps: 3", "steps: 200");
    format!("{}\n  runPolicy:\n{run_policy}", text.trim_end())
}

#[tokio::test]
async fn an_evicted_pod_restarts_the_gang_as_a_disruption_without_burning_the_backoff_limit() -> anyhow::Result<()> {
    let Some(c) = Cluster::start("failure-evict").await? else { return Ok(()) };
    // backoffLimit 0: had the eviction counted as a failure, the job would fail.
    let name = c.apply("rljob-cpu.yaml", |t| long_job(t, "    backoffLimit: 0\n"))?;
    c.wait(&name, "the first step", |j| j.status.as_ref().and_then(|s| s.step).is_some_and(|s| s >= 1)).await?;

    let victim = format!("{name}-gen-0");
    let pods: Api<Pod> = Api::namespaced(c.env.client.clone(), &c.env.namespace);
    pods.evict(&victim, &EvictParams::default()).await.context("the Eviction API")?;
    println!("evicted {victim} through the Eviction API");

    let job = c.wait(&name, "a gang restart", |j| epoch_of(j) == 1).await?;
    let st = job.status.clone().unwrap_or_default();
    assert_eq!((st.restarts, st.counted_restarts, st.disruptions), (1, 0, 1), "{st:?}");
    let notes = rlplane_e2e::wait_gang_restart_naming(&c.env, &name, &victim).await?;
    println!("GangRestart: {notes:?}");
    assert!(
        notes
            .iter()
            .any(|n| n.contains("disrupted (EvictionByEvictionAPI)")
                && n.contains("a disruption: 1/10 of disruptionLimit")),
        "{notes:?}"
    );
    let job = c.wait(&name, "Succeeded at epoch 1", |j| phase_of(j) == Some(Phase::Succeeded)).await?;
    assert_eq!(job.status.as_ref().and_then(|s| s.step), Some(200), "the new epoch ran every step");
    c.env.cleanup().await
}

#[tokio::test]
async fn a_fail_job_rule_fails_the_job_at_once_and_names_the_rule() -> anyhow::Result<()> {
    let Some(c) = Cluster::start("failure-rule").await? else { return Ok(()) };
    let rules = "    failurePolicy:\n      rules:\n      - action: FailJob\n        onExitCodes: {containerName: rlplane-worker, operator: In, values: [137]}\n";
    let name = c.apply("rljob-cpu.yaml", |t| long_job(t, rules))?;
    c.wait(&name, "the first step", |j| j.status.as_ref().and_then(|s| s.step).is_some_and(|s| s >= 1)).await?;

    let victim = format!("{name}-gen-0");
    c.kill_worker(&victim).await?;
    println!("killed the worker of {victim} (SIGKILL: exit code 137)");
    let job = c.wait(&name, "Failed", |j| phase_of(j) == Some(Phase::Failed)).await?;
    let st = job.status.clone().unwrap_or_default();
    assert_eq!((st.restarts, st.epoch), (0, 0), "no restart: {st:?}");
    let failed =
        st.conditions.iter().find(|c| c.type_ == "Failed" && c.status == "True").context("a Failed condition")?;
    println!("Failed: {}: {}", failed.reason, failed.message);
    assert_eq!(failed.reason, "FailurePolicy");
    assert!(failed.message.ends_with("(failurePolicy rule 0: FailJob)"), "{}", failed.message);
    assert!(failed.message.contains(&victim) && failed.message.contains("code 137"), "{}", failed.message);
    c.env.cleanup().await
}
