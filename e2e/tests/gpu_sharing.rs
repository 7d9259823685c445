//! `spec.gpus.sharing: ResourceClaim` against the real API server, scheduler and
//! controller-manager: the operator's ResourceClaimTemplate is accepted, the resource-claim
//! controller makes each pod its claim, and the scheduler's Dynamic Resource Allocation allocates
//! it on the node it binds the pod to — one claim per pod, which the worker and the user's
//! container both use, so they get the same devices.
//!
//! The fake GPU nodes run no DRA driver, so this test publishes what a driver's kubelet plugin
//! would: one ResourceSlice of 8 devices per fake node, under a DeviceClass of its own. No
//! kubelet runs these pods (they are scheduled, not started): what a container sees of its
//! devices is the driver's part, tested by NVIDIA's own driver, not here.

use std::collections::BTreeSet;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use kube::api::{Api, DeleteParams, PostParams};
use kube::{Client, ResourceExt};
use rlplane_api::{GpuSharing, GpuSpec};
use rlplane_e2e::Env;
use rlplane_operator::desired::{GPU_CLAIM, OperatorConfig, WORKER_CONTAINER, desired, gpu_claim_template_name};
use serde_json::json;

const DRIVER: &str = "fake-gpu.e2e.rlplane.dev";
const CLASS: &str = "fake-gpu.e2e.rlplane.dev";
const NODES: [&str; 4] = ["gpu-node-0", "gpu-node-1", "gpu-node-2", "gpu-node-3"];
const WAIT: Duration = Duration::from_secs(60);

/// The DeviceClass and one ResourceSlice of 8 devices per fake node, as a DRA driver publishes.
async fn publish_fake_devices(client: &Client) -> anyhow::Result<()> {
    let pp = PostParams::default();
    let classes: Api<DeviceClass> = Api::all(client.clone());
    let class = serde_json::from_value(json!({
        "metadata": {"name": CLASS},
        "spec": {"selectors": [{"cel": {"expression": format!("device.driver == '{DRIVER}'")}}]}
    }))?;
    classes.create(&pp, &class).await?;
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    for node in NODES {
        let devices: Vec<_> = (0..8)
            .map(|i| json!({"name": format!("gpu-{i}"), "attributes": {"uuid": {"string": format!("GPU-{node}-{i}")}}}))
            .collect();
        let slice = serde_json::from_value(json!({
            "metadata": {"name": format!("{node}-fake-gpus")},
            "spec": {"driver": DRIVER, "nodeName": node, "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                     "devices": devices}
        }))?;
        slices.create(&pp, &slice).await?;
    }
    Ok(())
}

async fn remove_fake_devices(client: &Client) {
    let dp = DeleteParams::default();
    for node in NODES {
        let _ = Api::<ResourceSlice>::all(client.clone()).delete(&format!("{node}-fake-gpus"), &dp).await;
    }
    let _ = Api::<DeviceClass>::all(client.clone()).delete(CLASS, &dp).await;
}

#[tokio::test]
async fn each_pod_gets_one_allocated_claim_that_the_worker_and_the_users_container_share() -> anyhow::Result<()> {
    let Some(env) = Env::start("gpu-claims").await? else { return Ok(()) };
    remove_fake_devices(&env.client).await;
    publish_fake_devices(&env.client).await?;
    let outcome = run(&env).await;
    remove_fake_devices(&env.client).await;
    outcome?;
    env.cleanup().await
}

async fn run(env: &Env) -> anyhow::Result<()> {
    let job = env
        .apply_manifest("rljob-llama3-8b-fsdp-vllm.yaml", |j| {
            rlplane_e2e::without_site_dependencies(j);
            j.spec.gpus = GpuSpec { sharing: GpuSharing::ResourceClaim, device_class_name: Some(CLASS.into()) };
            for t in [&mut j.spec.trainer.template, &mut j.spec.generation.template].into_iter().flatten() {
                let mut pt = t.pod_template().unwrap();
                for c in pt.spec.iter_mut().flat_map(|s| s.containers.iter_mut()) {
                    c.resources = None; // the claim gives the GPUs, not the device plugin
                }
                *t = serde_json::from_value(serde_json::to_value(pt).unwrap()).unwrap();
            }
        })
        .await?;
    let name = job.name_any();
    let n = desired(&job, 0, &OperatorConfig::default())?.pods.len();
    let pods = env.wait_pods(&name, "the gang", WAIT, |p| p.len() == n).await?;
    let claims: Api<ResourceClaim> = Api::namespaced(env.client.clone(), &env.namespace);
    let mut devices_seen = BTreeSet::new();
    for p in &pods {
        let pod = p.name_any();
        let node = env.wait_scheduled(&pod, WAIT).await?;
        let p: Pod = env.pods().get(&pod).await?;
        let spec = p.spec.as_ref().unwrap();
        let template = spec.resource_claims.as_ref().unwrap()[0].resource_claim_template_name.clone();
        assert_eq!(template, Some(gpu_claim_template_name(&name, 8)), "{pod}");
        // The worker and the user's container both use the pod's one claim.
        let users: Vec<_> = spec.containers.iter().collect();
        let worker = spec.init_containers.iter().flatten().find(|c| c.name == WORKER_CONTAINER).unwrap();
        for c in users.iter().copied().chain([worker]) {
            let used: Vec<_> =
                c.resources.iter().flat_map(|r| r.claims.iter().flatten()).map(|x| x.name.clone()).collect();
            assert_eq!(used, [GPU_CLAIM], "{pod}/{}", c.name);
        }
        // The controller made the claim from the template; the scheduler allocated 8 devices of
        // the pod's node to it and reserved it for the pod.
        let status = p.status.as_ref().and_then(|s| s.resource_claim_statuses.clone()).unwrap_or_default();
        let claim_name = status.first().and_then(|s| s.resource_claim_name.clone()).expect("the pod's claim");
        let claim = claims.get(&claim_name).await?;
        let st = claim.status.as_ref().expect("an allocated claim");
        let results = st.allocation.as_ref().and_then(|a| a.devices.as_ref()).and_then(|d| d.results.clone()).unwrap();
        assert_eq!(results.len(), 8, "{pod}: {results:?}");
        assert!(results.iter().all(|r| r.driver == DRIVER && r.pool == node && r.request == GPU_CLAIM), "{results:?}");
        let reserved = st.reserved_for.iter().flatten().map(|r| r.name.clone()).collect::<Vec<_>>();
        assert_eq!(reserved, std::slice::from_ref(&pod));
        println!("{pod} on {node}: claim {claim_name}: {:?}", results.iter().map(|r| &r.device).collect::<Vec<_>>());
        for r in &results {
            assert!(devices_seen.insert((r.pool.clone(), r.device.clone())), "a device allocated twice: {r:?}");
        }
    }
    env.jobs().delete(&name, &DeleteParams::background()).await?;
    Ok(())
}
