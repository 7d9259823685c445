//! The operator against a real cluster (KUBECONFIG; in CI the local control plane of
//! e2e/cluster/up), with the real scheduler placing pods on the fake GPU nodes and the tests
//! standing in for the kubelet: every manifest's lifecycle, pods the scheduler cannot place, gang
//! restart, backoff, suspend/resume, Kueue-style admission, deadline, TTL, garbage collection, the
//! coordinator's status contract, an operator restart mid-job and leader fail-over. Without
//! KUBECONFIG every test prints that it skipped and passes (CI makes that an error).

use std::time::Duration;

use anyhow::Context as _;

use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use rlplane_api::{GangScheduler, Phase, RLJob};
use rlplane_e2e::{
    Env, client_with_token, condition, coordinator, epoch_of, is_true, job_events, live_of_epoch, namespace, phase_of,
    service_account_token, wait_gang_restart_naming, workspace,
};
use rlplane_operator::cluster::{OperatorProcess, operator_binary};
use rlplane_operator::conditions::{FAILED, PODS_CREATED, PODS_READY, RUNNING, SUCCEEDED, SUSPENDED};
use rlplane_operator::desired::{OperatorConfig, desired, labels, worker_service_account_name};
use serde_json::json;

const STEP: Duration = Duration::from_secs(60);

/// Whether the cluster serves the PodGroup API of `gang`.
async fn serves_pod_groups(client: &Client, gang: GangScheduler) -> bool {
    let api = match gang {
        GangScheduler::None => return true,
        GangScheduler::Volcano => "scheduling.volcano.sh/v1beta1",
        GangScheduler::Coscheduling => "scheduling.x-k8s.io/v1alpha1",
    };
    client.list_api_group_resources(api).await.is_ok_and(|l| l.resources.iter().any(|r| r.name == "podgroups"))
}

/// Reasons of the Events on a job.
async fn event_reasons(env: &Env, job: &str) -> anyhow::Result<Vec<String>> {
    Ok(job_events(env, job).await?.into_iter().filter_map(|e| e.reason).collect())
}

/// create → PodsCreated → all ready → Running → a pod fails → gang restart at epoch 1 → Running
/// → the coordinator exits 0 → Succeeded, pods and objects deleted.
async fn lifecycle(env: &Env, file: &str) -> anyhow::Result<()> {
    let job = env.apply_manifest(file, rlplane_e2e::without_site_dependencies).await?;
    let name = job.name_any();
    let n = desired(&job, 0, &OperatorConfig::default())?.pods.len();
    let gang = job.spec.scheduling.gang;
    if !serves_pod_groups(&env.client, gang).await {
        // Without the gang scheduler's API the job cannot start; the operator says so.
        let job = env
            .wait_job(&name, "PodsCreated=False/CreateFailed", STEP, |j| {
                condition(j, PODS_CREATED)
                    .is_some_and(|(s, r, m)| s == "False" && r == "CreateFailed" && m.contains("PodGroup API"))
            })
            .await?;
        println!(
            "{file}: the cluster has no {gang:?} PodGroup API; the job reports it: {:?}",
            condition(&job, PODS_CREATED)
        );
        env.jobs().delete(&name, &DeleteParams::background()).await?;
        return Ok(());
    }

    let job = env.wait_job(&name, "Starting with PodsCreated", STEP, |j| is_true(j, PODS_CREATED)).await?;
    assert_eq!(phase_of(&job), Some(Phase::Starting), "{file}");
    let pods = env.wait_pods(&name, "the gang", STEP, |p| live_of_epoch(p, 0).len() == n).await?;
    env.wait_objects(&name, true, STEP).await?;
    for p in &pods {
        let spec = p.spec.as_ref().unwrap();
        // The real scheduler places every pod of the gang on a node with room for it.
        let node = env.wait_scheduled(&p.name_any(), STEP).await?;
        println!("  {} -> {node}", p.name_any());
        assert_eq!(p.owner_references()[0].uid, job.uid().unwrap(), "{}", p.name_any());
        if job.spec.trainer.template.is_none() {
            assert_eq!(spec.service_account_name.as_deref(), Some(worker_service_account_name(&name).as_str()));
        }
    }
    assert!(coordinator(&pods).is_some(), "{file}: one pod runs the coordinator");

    env.ready_all(&name, 0, n).await?;
    let job = env.wait_job(&name, "Running", STEP, |j| phase_of(j) == Some(Phase::Running)).await?;
    let roles = &job.status.as_ref().unwrap().roles;
    assert_eq!((roles.trainer.ready + roles.generation.ready + roles.storage.ready) as usize, n);
    assert!(is_true(&job, RUNNING));

    // A rank dies: the whole gang restarts with a new epoch.
    let victim =
        pods.iter().find(|p| coordinator(&pods).map(|c| c.name_any()) != Some(p.name_any())).unwrap_or(&pods[0]);
    env.exit(&victim.name_any(), 1).await?;
    let job = env.wait_job(&name, "a gang restart", STEP, |j| epoch_of(j) == 1).await?;
    let st = job.status.as_ref().unwrap();
    assert_eq!(st.restarts, 1, "{file}");
    // The Restarting condition names the pod only while the restart lasts; the Event stays.
    wait_gang_restart_naming(env, &name, &victim.name_any()).await.with_context(|| file.to_string())?;
    env.wait_pods(&name, "the epoch-1 gang only", STEP, |p| live_of_epoch(p, 1).len() == n && p.len() == n).await?;
    env.ready_all(&name, 1, n).await?;
    env.wait_job(&name, "Running at epoch 1", STEP, |j| phase_of(j) == Some(Phase::Running) && epoch_of(j) == 1)
        .await?;

    // The coordinator finishes: success, and everything but the job goes.
    let pods = env.pods_of(&name).await?;
    let coordinator = coordinator(&pods).unwrap().name_any();
    env.exit(&coordinator, 0).await?;
    let job = env.wait_job(&name, "Succeeded", STEP, |j| phase_of(j) == Some(Phase::Succeeded)).await?;
    assert!(is_true(&job, SUCCEEDED));
    assert!(job.status.as_ref().unwrap().completion_time.is_some());
    env.wait_pods(&name, "no pods", STEP, |p| p.is_empty()).await?;
    env.wait_objects(&name, false, STEP).await?;
    let reasons = event_reasons(env, &name).await?;
    for r in ["PodsCreated", "Running", "GangRestart", "CoordinatorSucceeded"] {
        assert!(reasons.iter().any(|x| x == r), "{file}: no {r} Event in {reasons:?}");
    }
    env.jobs().delete(&name, &DeleteParams::background()).await?;
    Ok(())
}

#[tokio::test]
async fn every_manifest_runs_its_lifecycle() -> anyhow::Result<()> {
    let Some(env) = Env::start("lifecycle").await? else { return Ok(()) };
    let mut files: Vec<String> = std::fs::read_dir(workspace().join("manifests"))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|f| f.ends_with(".yaml"))
        .collect();
    files.sort();
    assert!(!files.is_empty());
    for file in &files {
        println!("lifecycle of manifests/{file}");
        lifecycle(&env, file).await?;
    }
    env.cleanup().await
}

#[tokio::test]
async fn exhausting_the_backoff_limit_fails_the_job() -> anyhow::Result<()> {
    let Some(env) = Env::start("backoff").await? else { return Ok(()) };
    let job = env.apply_manifest("rljob-cpu.yaml", |j| j.spec.run_policy.backoff_limit = 0).await?;
    let name = job.name_any();
    env.ready_all(&name, 0, 3).await?;
    env.exit(&format!("{name}-gen-0"), 3).await?;
    let job = env.wait_job(&name, "Failed", STEP, |j| phase_of(j) == Some(Phase::Failed)).await?;
    let (status, reason, message) = condition(&job, FAILED).unwrap();
    assert_eq!((status.as_str(), reason.as_str()), ("True", "BackoffLimitExceeded"));
    assert!(message.contains(&format!("{name}-gen-0")) && message.contains("exited with code 3"), "{message}");
    env.wait_pods(&name, "no pods", STEP, |p| p.is_empty()).await?;
    env.cleanup().await
}

#[tokio::test]
async fn suspend_deletes_everything_but_the_job_and_resume_recreates_it() -> anyhow::Result<()> {
    let Some(env) = Env::start("suspend").await? else { return Ok(()) };
    let mut job = env.apply_manifest("rljob-cpu.yaml", |_| {}).await?;
    let name = job.name_any();
    env.ready_all(&name, 0, 3).await?;
    env.wait_job(&name, "Running", STEP, |j| phase_of(j) == Some(Phase::Running)).await?;

    job.spec.run_policy.suspend = true;
    env.apply(&job).await?;
    let suspended = env.wait_job(&name, "Suspended", STEP, |j| phase_of(j) == Some(Phase::Suspended)).await?;
    assert!(is_true(&suspended, SUSPENDED));
    assert!(suspended.status.as_ref().unwrap().start_time.is_none());
    env.wait_pods(&name, "no pods", STEP, |p| p.is_empty()).await?;
    env.wait_objects(&name, false, STEP).await?;
    env.wait_job(&name, "PodsCreated=False/NoPods", STEP, |j| {
        condition(j, PODS_CREATED).is_some_and(|c| c.1 == "NoPods")
    })
    .await?;

    job.spec.run_policy.suspend = false;
    env.apply(&job).await?;
    let resumed = env.wait_job(&name, "resumed", STEP, |j| is_true(j, PODS_CREATED)).await?;
    assert_eq!(epoch_of(&resumed), 1, "the suspended gang's token is retired");
    env.wait_pods(&name, "the gang again", STEP, |p| live_of_epoch(p, 1).len() == 3).await?;
    env.wait_objects(&name, true, STEP).await?;
    env.cleanup().await
}

#[tokio::test]
async fn a_kueue_job_created_suspended_starts_when_admitted() -> anyhow::Result<()> {
    let Some(env) = Env::start("kueue").await? else { return Ok(()) };
    let mut job = env
        .apply_manifest("rljob-cpu.yaml", |j| {
            j.metadata.labels.get_or_insert_with(Default::default).insert(labels::KUEUE_QUEUE.into(), "team-a".into());
            j.spec.run_policy.suspend = true;
        })
        .await?;
    let name = job.name_any();
    let queued = env.wait_job(&name, "Suspended", STEP, |j| phase_of(j) == Some(Phase::Suspended)).await?;
    assert!(condition(&queued, SUSPENDED).unwrap().2.contains("Kueue (queue team-a)"));
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(env.pods_of(&name).await?.is_empty(), "no pod before admission");
    // What Kueue does when it admits the workload.
    job.spec.run_policy.suspend = false;
    env.apply(&job).await?;
    env.wait_pods(&name, "the gang", STEP, |p| live_of_epoch(p, 0).len() == 3).await?;
    env.cleanup().await
}

#[tokio::test]
async fn the_active_deadline_fails_the_job() -> anyhow::Result<()> {
    let Some(env) = Env::start("deadline").await? else { return Ok(()) };
    let job = env.apply_manifest("rljob-cpu.yaml", |j| j.spec.run_policy.active_deadline_seconds = Some(3)).await?;
    let name = job.name_any();
    let job = env.wait_job(&name, "DeadlineExceeded", STEP, |j| phase_of(j) == Some(Phase::Failed)).await?;
    assert_eq!(condition(&job, FAILED).unwrap().1, "DeadlineExceeded");
    env.wait_pods(&name, "no pods", STEP, |p| p.is_empty()).await?;
    env.cleanup().await
}

#[tokio::test]
async fn a_finished_job_is_deleted_after_its_ttl_with_everything_it_owned() -> anyhow::Result<()> {
    let Some(env) = Env::start("ttl").await? else { return Ok(()) };
    let job = env.apply_manifest("rljob-cpu.yaml", |j| j.spec.run_policy.ttl_seconds_after_finished = Some(2)).await?;
    let name = job.name_any();
    env.ready_all(&name, 0, 3).await?;
    let pods = env.pods_of(&name).await?;
    env.exit(&coordinator(&pods).unwrap().name_any(), 0).await?;
    env.wait_job(&name, "Succeeded", STEP, |j| phase_of(j) == Some(Phase::Succeeded)).await?;
    let deadline = std::time::Instant::now() + STEP;
    while env.jobs().get_opt(&name).await?.is_some() {
        assert!(std::time::Instant::now() < deadline, "the RLJob was not deleted after its TTL");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    env.wait_pods(&name, "no pods", STEP, |p| p.is_empty()).await?;
    env.wait_objects(&name, false, STEP).await?;
    env.cleanup().await
}

#[tokio::test]
async fn deleting_a_running_job_garbage_collects_everything_it_owned() -> anyhow::Result<()> {
    let Some(env) = Env::start("gc").await? else { return Ok(()) };
    let job = env.apply_manifest("rljob-cpu-colocated.yaml", |_| {}).await?;
    let name = job.name_any();
    let n = desired(&job, 0, &OperatorConfig::default())?.pods.len();
    env.ready_all(&name, 0, n).await?;
    env.wait_objects(&name, true, STEP).await?;
    env.jobs().delete(&name, &DeleteParams::background()).await?;
    // The garbage collector follows the owner references (kube-controller-manager).
    env.wait_pods(&name, "pods collected", STEP, |p| p.is_empty()).await?;
    env.wait_objects(&name, false, STEP).await?;
    env.cleanup().await
}

/// A client acting as the job's coordinator: a token of `<job>-worker`.
async fn coordinator_client(env: &Env, job: &str) -> anyhow::Result<Client> {
    let token = service_account_token(&env.client, &env.namespace, &worker_service_account_name(job)).await?;
    client_with_token(&token).await
}

#[tokio::test]
async fn the_coordinator_may_report_its_own_status_and_nothing_else() -> anyhow::Result<()> {
    let Some(env) = Env::start("coordinator").await? else { return Ok(()) };
    let job = env.apply_manifest("rljob-cpu.yaml", |_| {}).await?;
    let other = env.apply_manifest("rljob-cpu.yaml", |j| j.metadata.name = Some("other".into())).await?;
    let name = job.name_any();
    env.wait_job(&name, "Starting", STEP, |j| is_true(j, PODS_CREATED)).await?;
    env.wait_objects(&name, true, STEP).await?;

    let as_coordinator: Api<RLJob> = Api::namespaced(coordinator_client(&env, &name).await?, &env.namespace);
    let report = json!({
        "apiVersion": "rlplane.dev/v1alpha1", "kind": "RLJob",
        "status": {"step": 5, "lastRefit": {"version": 5, "seconds": 0.25, "bytes": 1024, "summary": "v5 0.25s"}},
    });
    let pp = PatchParams::apply("rlplane-coordinator");
    as_coordinator.patch_status(&name, &pp, &Patch::Apply(&report)).await?;
    let denied = as_coordinator.patch_status(&other.name_any(), &pp, &Patch::Apply(&report)).await;
    assert!(matches!(denied, Err(kube::Error::Api(ref s)) if s.code == 403), "another job's status: {denied:?}");
    let denied =
        as_coordinator.patch(&name, &pp, &Patch::Merge(json!({"spec": {"runPolicy": {"suspend": true}}}))).await;
    assert!(matches!(denied, Err(kube::Error::Api(ref s)) if s.code == 403), "the spec: {denied:?}");

    // The operator's own status writes leave the coordinator's fields alone.
    env.ready_all(&name, 0, 3).await?;
    let running = env.wait_job(&name, "Running", STEP, |j| phase_of(j) == Some(Phase::Running)).await?;
    let st = running.status.unwrap();
    assert_eq!(st.step, Some(5));
    assert_eq!(st.last_refit.map(|r| r.summary), Some("v5 0.25s".to_string()));
    env.cleanup().await
}

#[tokio::test]
async fn a_job_asking_more_gpus_than_any_node_has_stays_pending_and_says_why() -> anyhow::Result<()> {
    let Some(env) = Env::start("unschedulable").await? else { return Ok(()) };
    // One trainer pod of 16 GPUs: the fake nodes have 8 each.
    let job = env
        .apply_manifest("rljob-gpu-4.yaml", |j| {
            j.spec.trainer.gpus_per_node = 16;
            j.spec.trainer.parallelism.data = 8;
        })
        .await?;
    let name = job.name_any();
    let job = env
        .wait_job(&name, "PodsReady=False/Unschedulable", STEP, |j| {
            condition(j, PODS_READY).is_some_and(|c| c.1 == "Unschedulable")
        })
        .await?;
    let (_, _, message) = condition(&job, PODS_READY).unwrap();
    println!("PodsReady: {message}");
    assert!(message.contains("nvidia.com/gpu"), "the scheduler's reason is quoted: {message}");
    assert_eq!(phase_of(&job), Some(Phase::Starting), "waiting for room is not a failure");
    assert_eq!(job.status.as_ref().unwrap().restarts, 0);
    env.cleanup().await
}

#[tokio::test]
async fn an_operator_restarted_mid_job_keeps_the_restart_count_and_the_gang() -> anyhow::Result<()> {
    let Some(mut env) = Env::start("restart").await? else { return Ok(()) };
    let job = env.apply_manifest("rljob-cpu.yaml", |_| {}).await?;
    let name = job.name_any();
    env.ready_all(&name, 0, 3).await?;
    env.exit(&format!("{name}-gen-0"), 1).await?;
    env.wait_job(&name, "a gang restart", STEP, |j| epoch_of(j) == 1).await?;
    env.ready_all(&name, 1, 3).await?;
    env.wait_job(&name, "Running at epoch 1", STEP, |j| phase_of(j) == Some(Phase::Running)).await?;
    let uids: Vec<_> = env.pods_of(&name).await?.iter().map(|p| p.uid()).collect();

    // A crash, then a new operator process: everything it knows comes from the API server.
    env.operator.kill();
    env.operator = OperatorProcess::start(&operator_binary(&workspace())?, &env.namespace, &[])?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let job = env.wait_job(&name, "Running", STEP, |j| phase_of(j) == Some(Phase::Running)).await?;
    let st = job.status.as_ref().unwrap();
    assert_eq!((st.restarts, st.epoch), (1, 1), "the restart count and epoch survive the operator");
    let after: Vec<_> = env.pods_of(&name).await?.iter().map(|p| p.uid()).collect();
    assert_eq!(uids, after, "the new operator adopts the running gang instead of recreating it");
    env.cleanup().await
}

#[tokio::test]
async fn a_standby_replica_takes_over_when_the_leader_stops() -> anyhow::Result<()> {
    let Some((client, ns)) = namespace("leader").await? else { return Ok(()) };
    let binary = operator_binary(&workspace())?;
    // A short lease: the standby looks at the lease when the one it saw would expire.
    let lease = ["--lease-duration-seconds", "4"];
    let mut first = OperatorProcess::start(&binary, &ns, &lease)?;
    let second = OperatorProcess::start_standby(&binary, &ns, &lease)?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(first.is_leader() && !second.is_leader(), "exactly one replica leads");
    // SIGTERM releases the lease; the standby takes it within a lease duration (plus a renewal).
    assert!(first.terminate(), "graceful exit");
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !second.is_leader() {
        assert!(std::time::Instant::now() < deadline, "the standby did not take over within 20 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let env = Env::new(client, ns, second);
    let job = env.apply_manifest("rljob-cpu.yaml", |_| {}).await?;
    env.wait_pods(&job.name_any(), "the new leader's pods", STEP, |p| live_of_epoch(p, 0).len() == 3).await?;
    env.cleanup().await
}

#[tokio::test]
async fn killing_the_leader_hands_a_running_job_to_the_standby_within_the_lease() -> anyhow::Result<()> {
    let Some((client, ns)) = namespace("leader-kill").await? else { return Ok(()) };
    let binary = operator_binary(&workspace())?;
    let lease_seconds = 4;
    let lease = ["--lease-duration-seconds", "4"];
    let leader = OperatorProcess::start(&binary, &ns, &lease)?;
    let standby = OperatorProcess::start_standby(&binary, &ns, &lease)?;
    let mut env = Env::new(client, ns, leader);
    let job = env.apply_manifest("rljob-cpu.yaml", |_| {}).await?;
    let name = job.name_any();
    env.ready_all(&name, 0, 3).await?;
    env.wait_job(&name, "Running", STEP, |j| phase_of(j) == Some(Phase::Running)).await?;

    // SIGKILL: the lease is not released; the standby must wait for it to expire, no longer.
    let killed = std::time::Instant::now();
    env.operator.kill();
    env.operator = standby;
    while !env.operator.is_leader() {
        // One lease duration, plus the standby's retry period (a lease duration / 3) and slack.
        assert!(
            killed.elapsed() < Duration::from_secs(2 * lease_seconds + 2),
            "no takeover after {:?}",
            killed.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!("the standby led {:?} after the leader was killed (lease {lease_seconds} s)", killed.elapsed());

    // The job keeps running under the new leader, and a failure is handled by it.
    let job = env.wait_job(&name, "Running", STEP, |j| phase_of(j) == Some(Phase::Running)).await?;
    assert_eq!(epoch_of(&job), 0, "the takeover did not restart the gang");
    env.exit(&format!("{name}-gen-1"), 1).await?;
    env.wait_job(&name, "a restart by the new leader", STEP, |j| epoch_of(j) == 1).await?;
    env.cleanup().await
}
