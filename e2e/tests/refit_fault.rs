//! A worker pod deleted in the middle of a refit, on the real node: a CPU job's generation pod is
//! cut off from the refit's connections (iptables in its network namespace drops the refit
//! ports' packets both ways), so the next refit starts and cannot finish; once the job's status
//! says the refit waits for that rank, the pod is deleted as a user or a node drain would. The
//! operator restarts the gang with a new epoch, whose engines take the weights afresh, and the
//! job runs every step to Succeeded with that one restart. Every refit is verified in full
//! (`verify: Full`: each engine checks all it received against the senders' digests and fails its
//! rank on a mismatch), so an engine that held mixed weights would have failed the job or added a
//! restart. Without KUBECONFIG, or without a real node, the test says that it skipped (CI makes
//! that an error).

use std::time::Duration;

use anyhow::Context as _;
use kube::api::{Api, DeleteParams};
use rlplane_api::plan::ports;
use rlplane_api::{Phase, RLJob};
use rlplane_e2e::real_node::Setup;
use rlplane_e2e::{epoch_of, kubectl_stdin, phase_of, wait_for_job, workspace};
use rlplane_operator::cluster::{OperatorProcess, operator_binary};
use rlplane_operator::desired::WORKER_CONTAINER;

/// Enough that the refit is cut off long before the job could end on its own.
const STEPS: u64 = 400;

/// Waits for `done` (at most `within`); a Failed job ends the wait at once.
async fn wait(
    jobs: &Api<RLJob>,
    name: &str,
    what: &str,
    within: Duration,
    done: impl Fn(&RLJob) -> bool,
) -> anyhow::Result<RLJob> {
    let failed = |j: &RLJob| phase_of(j) == Some(Phase::Failed);
    let j = wait_for_job(jobs, name, what, within, |j| done(j) || failed(j)).await?;
    anyhow::ensure!(!failed(&j) || done(&j), "RLJob {name} failed before {what}: {:?}", j.status);
    Ok(j)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_generation_pod_deleted_mid_refit_restarts_the_gang_and_the_job_succeeds() -> anyhow::Result<()> {
    let Some(setup) = Setup::start("real-refit-fault").await? else { return Ok(()) };
    let (client, ns) = (&setup.client, &setup.namespace);
    let mut operator = OperatorProcess::start(&operator_binary(&workspace())?, ns, &["--image-pull-policy", "Never"])?;
    let result = scenario(&setup, client, ns).await;
    operator.terminate();
    setup.cleanup().await?;
    result
}

async fn scenario(setup: &Setup, client: &kube::Client, ns: &str) -> anyhow::Result<()> {
    let name = "refit-fault";
    let manifest = std::fs::read_to_string(workspace().join("manifests/rljob-cpu.yaml"))?
        .replace("name: grpo-cpu\n", &format!("name: {name}\n"))
        .replace("steps: 3", &format!("steps: {STEPS}"))
        .replace("    timeoutSeconds: 30\n", "    timeoutSeconds: 30\n    verify: Full\n");
    anyhow::ensure!(manifest.contains("verify: Full"), "the manifest's refit section changed: {manifest}");
    let (ok, out, err) = kubectl_stdin(&["apply", "-n", ns, "-f", "-"], &manifest)?;
    anyhow::ensure!(ok, "kubectl apply: {err}{out}");
    let jobs: Api<RLJob> = Api::namespaced(client.clone(), ns);
    let step = |j: &RLJob| j.status.as_ref().and_then(|s| s.step).unwrap_or(0);
    wait(&jobs, name, "step 3", Duration::from_secs(180), |j| step(j) >= 3).await?;

    // Cut gen-0 off from the refit: its relay listener and the trainer's rendezvous port, both
    // directions, so the connections already open carry nothing more.
    let victim = format!("{name}-gen-0");
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), ns);
    let pod = pods.get(&victim).await?;
    let port = ports::REFIT_BASE.to_string();
    for (chain, side) in [("INPUT", "--dport"), ("INPUT", "--sport"), ("OUTPUT", "--dport"), ("OUTPUT", "--sport")] {
        let rule = ["iptables", "-I", chain, "-p", "tcp", side, port.as_str(), "-j", "DROP"];
        setup.node.in_network_of(&pod, WORKER_CONTAINER, &rule)?;
    }
    let cut_at = step(&jobs.get(name).await?);
    println!("at step {cut_at}: {victim}'s refit port {port} dropped both ways");

    // The refit waits: the coordinator says so in the job's status.
    let stalled = wait(&jobs, name, "a refit waiting", Duration::from_secs(60), |j| {
        j.status.as_ref().and_then(|s| s.stall.as_ref()).is_some_and(|s| s.phase.contains("refit"))
    })
    .await?;
    let stall = stalled.status.as_ref().and_then(|s| s.stall.clone()).context("a stall")?;
    println!("status.stall: {stall:?}");
    anyhow::ensure!(epoch_of(&stalled) == 0, "the gang restarted before the pod was deleted");

    pods.delete(&victim, &DeleteParams::default()).await?;
    println!("deleted {victim} mid-refit (step {})", step(&stalled));
    let done =
        wait(&jobs, name, "Succeeded", Duration::from_secs(240), |j| phase_of(j) == Some(Phase::Succeeded)).await?;
    let st = done.status.as_ref().context("a status")?;
    println!("{name}: Succeeded at epoch {}, {} restart(s), step {:?}", st.epoch, st.restarts, st.step);
    assert_eq!((st.epoch, st.restarts), (1, 1), "one gang restart, for the deleted pod: {st:?}");
    assert_eq!(st.step, Some(STEPS), "the new epoch ran every step");
    Ok(())
}
