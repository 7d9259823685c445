//! The per-epoch key Secret against a real API server: it exists for each epoch, owned by the
//! RLJob, mounted only into that epoch's worker containers (and named, never held, by the plan);
//! a gang restart replaces it; deleting the RLJob removes it. The job's NetworkPolicy exists
//! beside it. Without KUBECONFIG the test prints that it skipped and passes (CI makes that an
//! error).

use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams};
use rlplane_api::plan::{JOB_KEY_SECRET_KEY, POD_KEY_DIR, POD_KEY_FILE, job_key_secret_name, parse_job_key};
use rlplane_api::{Phase, RLJob};
use rlplane_e2e::{Env, coordinator, live_of_epoch};
use rlplane_operator::desired::{KEY_VOLUME, PLAN_KEY, WORKER_CONTAINER, network_policy_name};
use tokio::time::Instant;

const STEP: Duration = Duration::from_secs(60);

fn epoch(job: &RLJob) -> u32 {
    job.status.as_ref().map(|s| s.epoch).unwrap_or_default()
}

/// Polls until the Secret `name` exists (`exists`) or is gone; returns it when it exists.
async fn wait_secret(api: &Api<Secret>, name: &str, exists: bool) -> anyhow::Result<Option<Secret>> {
    let deadline = Instant::now() + STEP;
    loop {
        let got = api.get_opt(name).await?;
        if got.is_some() == exists {
            return Ok(got);
        }
        if Instant::now() > deadline {
            anyhow::bail!("Secret {name} {} after {STEP:?}", if exists { "never appeared" } else { "is still there" });
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The key a Secret holds, checking its shape and owner.
fn key_of(secret: &Secret, job: &RLJob) -> [u8; 32] {
    let owner = &secret.owner_references()[0];
    assert_eq!((owner.kind.as_str(), Some(owner.uid.clone())), ("RLJob", job.uid()), "owned by the RLJob");
    assert_eq!(secret.immutable, Some(true));
    let text = &secret.data.as_ref().expect("the key is in data")[JOB_KEY_SECRET_KEY].0;
    parse_job_key(std::str::from_utf8(text).unwrap()).expect("64 hex characters")
}

/// Every pod mounts `secret` through the `job-key` volume, into its worker container only.
fn assert_mounted_only_into(pods: &[&Pod], secret: &str) {
    assert!(!pods.is_empty());
    for p in pods {
        let spec = p.spec.as_ref().unwrap();
        let volume = spec.volumes.iter().flatten().find(|v| v.name == KEY_VOLUME).expect("a job-key volume");
        assert_eq!(volume.secret.as_ref().and_then(|s| s.secret_name.as_deref()), Some(secret), "{}", p.name_any());
        for c in spec.containers.iter().chain(spec.init_containers.iter().flatten()) {
            let mount = c.volume_mounts.iter().flatten().find(|m| m.name == KEY_VOLUME);
            if c.name == WORKER_CONTAINER {
                assert_eq!(mount.map(|m| m.mount_path.as_str()), Some(POD_KEY_DIR), "{}", p.name_any());
            } else {
                assert!(mount.is_none(), "{}: container {} mounts the key", p.name_any(), c.name);
            }
        }
    }
}

#[tokio::test]
async fn each_epoch_gets_its_own_key_secret_mounted_only_into_its_pods() -> anyhow::Result<()> {
    let Some(env) = Env::start("job-secret").await? else { return Ok(()) };
    let secrets: Api<Secret> = Api::namespaced(env.client.clone(), &env.namespace);
    let job = env.apply_manifest("rljob-cpu.yaml", |_| {}).await?;
    let name = job.name_any();
    let n = 3;

    // Epoch 0: its Secret, its pods, the plan naming the file, the NetworkPolicy.
    let pods = env.wait_pods(&name, "the epoch-0 gang", STEP, |p| live_of_epoch(p, 0).len() == n).await?;
    let job = env.jobs().get(&name).await?;
    let uid = job.uid().unwrap();
    let first = wait_secret(&secrets, &job_key_secret_name(&name, &uid, 0), true).await?.unwrap();
    let key0 = key_of(&first, &job);
    assert_mounted_only_into(&live_of_epoch(&pods, 0), &job_key_secret_name(&name, &uid, 0));
    let plans: Api<ConfigMap> = Api::namespaced(env.client.clone(), &env.namespace);
    let plan = plans.get(&format!("{name}-plan")).await?.data.unwrap().remove(PLAN_KEY).unwrap();
    assert!(plan.contains(POD_KEY_FILE), "the plan names the key file");
    assert!(!plan.contains(&rlplane_api::plan::encode_job_key(&key0)), "the plan holds no key");
    let policies: Api<NetworkPolicy> = Api::namespaced(env.client.clone(), &env.namespace);
    assert!(policies.get_opt(&network_policy_name(&name)).await?.is_some(), "the job's NetworkPolicy");

    // A rank dies: the gang restarts at epoch 1 with a new key; epoch 0's goes.
    for p in live_of_epoch(&pods, 0) {
        env.set_ready(&p.name_any(), true).await?;
    }
    env.wait_job(&name, "Running", STEP, |j| j.status.as_ref().is_some_and(|s| s.phase == Phase::Running)).await?;
    let victim = pods.iter().find(|p| coordinator(&pods).map(|c| c.name_any()) != Some(p.name_any())).unwrap();
    env.exit(&victim.name_any(), 1).await?;
    env.wait_job(&name, "a gang restart", STEP, |j| epoch(j) == 1).await?;
    let pods =
        env.wait_pods(&name, "the epoch-1 gang only", STEP, |p| live_of_epoch(p, 1).len() == n && p.len() == n).await?;
    let second = wait_secret(&secrets, &job_key_secret_name(&name, &uid, 1), true).await?.unwrap();
    let key1 = key_of(&second, &job);
    assert_ne!(key0, key1, "a new epoch, a new key");
    assert_mounted_only_into(&live_of_epoch(&pods, 1), &job_key_secret_name(&name, &uid, 1));
    wait_secret(&secrets, &job_key_secret_name(&name, &uid, 0), false).await?;

    // The RLJob goes: so does its key.
    env.jobs().delete(&name, &DeleteParams::foreground()).await?;
    wait_secret(&secrets, &job_key_secret_name(&name, &uid, 1), false).await?;
    env.cleanup().await
}
