//! The Helm chart with real Helm against the real API server: `helm lint --strict`, `helm
//! template` over a values matrix with every object accepted by a server-side dry run (strict
//! field validation), bad values refused naming the field, `helm install`, then the operator run
//! as the chart's ServiceAccount (a TokenRequest token in a kubeconfig: exactly the RBAC the chart
//! grants) through a job's whole lifecycle, what that account may not do, and `helm uninstall`
//! leaving nothing but the CRD. Without KUBECONFIG every test prints that it skipped and passes
//! (CI makes that an error).

use std::path::PathBuf;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret, Service, ServiceAccount};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams};
use rlplane_api::{Phase, RLJob};
use rlplane_e2e::{
    Env, client_with_token, coordinator, epoch_of, helm, is_true, kubectl_stdin, namespace, phase_of,
    service_account_token, skip_without_cluster, token_kubeconfig, workspace,
};
use rlplane_operator::cluster::{OperatorProcess, operator_binary};
use rlplane_operator::conditions::{RUNNING, SUCCEEDED};

const STEP: Duration = Duration::from_secs(60);

fn chart() -> String {
    workspace().join("charts/rlplane").display().to_string()
}

/// `helm` that must succeed; returns its stdout.
fn helm_ok(args: &[&str]) -> anyhow::Result<String> {
    let (success, out, err) = helm(args)?;
    anyhow::ensure!(success, "helm {} failed:\n{err}{out}", args.join(" "));
    Ok(out)
}

/// The label helm puts on every object of a release.
fn instance(release: &str) -> String {
    format!("app.kubernetes.io/instance={release}")
}

#[tokio::test]
async fn helm_lints_and_every_rendering_passes_a_server_side_dry_run() -> anyhow::Result<()> {
    if skip_without_cluster()? {
        return Ok(());
    }
    let Some((_, watched)) = namespace("chart-render").await? else { return Ok(()) };
    let Some((_, release_ns)) = namespace("chart-render-sys").await? else { return Ok(()) };
    println!("{}", helm_ok(&["version", "--short"])?.trim());
    println!("{}", helm_ok(&["lint", "--strict", &chart()])?.trim());

    // One namespace / every namespace × monitors off / on (their CRDs are prometheus-operator's,
    // absent here: .ci/chart_check.py validates those two kinds against its types).
    let watch = format!("watchNamespace={watched}");
    let matrix: [(&str, Vec<&str>); 4] = [
        ("all namespaces", vec![]),
        ("all namespaces, monitors", vec!["serviceMonitor.enabled=true", "podMonitor.enabled=true"]),
        ("one namespace", vec![&watch]),
        (
            "one namespace, monitors, one replica",
            vec![&watch, "serviceMonitor.enabled=true", "podMonitor.enabled=true", "replicaCount=1"],
        ),
    ];
    for (what, sets) in &matrix {
        let chart_path = chart();
        let mut args = vec!["template", "rlplane-render", &chart_path, "--namespace", &release_ns];
        for s in sets {
            args.extend(["--set", s]);
        }
        args.extend(["--set", "dashboard.namespace="]);
        let rendered = helm_ok(&args)?;
        let (built_in, monitors): (Vec<&str>, Vec<&str>) = rendered
            .split("\n---")
            .filter(|d| d.lines().any(|l| l.starts_with("kind:")))
            .partition(|d| !d.contains("apiVersion: monitoring.coreos.com/"));
        let kinds: Vec<&str> =
            built_in.iter().filter_map(|d| d.lines().find_map(|l| l.strip_prefix("kind: "))).collect();
        // The API server validates every field (kubectl's default --validate=strict) and runs
        // admission, RBAC escalation checks of the (Cluster)Role included, without persisting.
        let (ok, out, err) =
            kubectl_stdin(&["apply", "--dry-run=server", "--validate=strict", "-f", "-"], &built_in.join("\n---\n"))?;
        assert!(ok, "{what}: the API server refused the chart's objects:\n{err}");
        println!("{what}: {} objects accepted by the API server: {kinds:?}", out.lines().count());
        let expect_monitors = if sets.iter().any(|s| s.contains("Monitor")) { 2 } else { 0 };
        assert_eq!(monitors.len(), expect_monitors, "{what}: monitors rendered");
        let cluster_scoped = kinds.contains(&"ClusterRole");
        assert_eq!(cluster_scoped, !sets.contains(&watch.as_str()), "{what}: a ClusterRole only for every namespace");
    }

    // Bad values: values.schema.json makes helm refuse them, naming the field.
    for (set, field) in [("replicaCount=-1", "replicaCount"), ("logFormat=xml", "logFormat")] {
        let (ok, _, err) = helm(&["template", "x", &chart(), "--set", set])?;
        assert!(!ok && err.contains(field), "--set {set}: expected a refusal naming {field}, got:\n{err}");
        println!("--set {set}: {}", err.lines().find(|l| l.contains(field)).unwrap_or_default().trim());
    }
    for ns in [watched, release_ns] {
        let (ok, _, err) = rlplane_e2e::kubectl(&["delete", "namespace", &ns, "--wait=false"])?;
        assert!(ok, "{err}");
    }
    Ok(())
}

/// Installs the chart as `release` into `release_ns` (watching `watched`, or every namespace),
/// runs the operator as the chart's ServiceAccount, takes a job through its lifecycle with it,
/// checks what the account may not do, and uninstalls.
async fn install_and_run(release: &str, single_namespace: bool) -> anyhow::Result<()> {
    let Some((client, watched)) = namespace(&format!("{release}-jobs")).await? else { return Ok(()) };
    let Some((_, release_ns)) = namespace(&format!("{release}-sys")).await? else { return Ok(()) };
    let chart_path = chart();
    let mut args = vec!["install", release, &chart_path, "--namespace", &release_ns, "--set", "replicaCount=1"];
    let watch = format!("watchNamespace={watched}");
    if single_namespace {
        args.extend(["--set", &watch]);
    }
    println!("{}", helm_ok(&args)?.lines().take(6).collect::<Vec<_>>().join("\n"));
    println!("{}", helm_ok(&["status", release, "-n", &release_ns])?.lines().take(4).collect::<Vec<_>>().join("\n"));

    // The operator, as the chart's ServiceAccount, with the chart's leader-election settings.
    let token = service_account_token(&client, &release_ns, release).await?;
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(release);
    let kubeconfig = token_kubeconfig(&dir, release, &token).await?;
    let lease = ["--leader-election=true", "--lease-name", "rlplane-operator", "--lease-namespace", &release_ns];
    let operator = OperatorProcess::start_as(
        &operator_binary(&workspace())?,
        &kubeconfig,
        single_namespace.then_some(watched.as_str()),
        &lease,
        true,
    )?;
    let env = Env::new(client.clone(), watched.clone(), operator);
    lifecycle(&env).await?;

    // What the chart's account may not do.
    let as_operator = client_with_token(&token).await?;
    let secrets: Api<Secret> = Api::namespaced(as_operator.clone(), &watched);
    let denied = secrets.list(&ListParams::default()).await;
    assert!(is_forbidden(&denied), "the operator may not read Secrets: {denied:?}");
    let elsewhere: Api<Pod> = Api::namespaced(as_operator.clone(), "default");
    let listed = elsewhere.list(&ListParams::default()).await;
    if single_namespace {
        assert!(is_forbidden(&listed), "single-namespace mode: no pods outside {watched}: {listed:?}");
    } else {
        assert!(listed.is_ok(), "every-namespace mode: pods of any namespace: {listed:?}");
    }
    let crds: Api<CustomResourceDefinition> = Api::all(as_operator.clone());
    let denied = crds.delete("rljobs.rlplane.dev", &DeleteParams::default()).await;
    assert!(is_forbidden(&denied), "the operator may not delete its CRD: {denied:?}");
    println!("{release}: the chart's account may not read Secrets, delete the CRD{}", {
        if single_namespace { ", or see pods outside its namespace" } else { "" }
    });
    env.cleanup().await?;

    // Uninstall: nothing of the release is left but the CRD (helm keeps crds/ on uninstall).
    helm_ok(&["uninstall", release, "-n", &release_ns, "--wait", "--timeout", "60s"])?;
    let sel = ListParams::default().labels(&instance(release));
    let left: Vec<String> = [
        names(Api::<Deployment>::namespaced(client.clone(), &release_ns), &sel, "Deployment").await?,
        names(Api::<Service>::namespaced(client.clone(), &release_ns), &sel, "Service").await?,
        names(Api::<ServiceAccount>::namespaced(client.clone(), &release_ns), &sel, "ServiceAccount").await?,
        names(Api::<ConfigMap>::namespaced(client.clone(), &release_ns), &sel, "ConfigMap").await?,
        names(Api::<PodDisruptionBudget>::namespaced(client.clone(), &release_ns), &sel, "PDB").await?,
        names(Api::<Role>::all(client.clone()), &sel, "Role").await?,
        names(Api::<RoleBinding>::all(client.clone()), &sel, "RoleBinding").await?,
        names(Api::<ClusterRole>::all(client.clone()), &sel, "ClusterRole").await?,
        names(Api::<ClusterRoleBinding>::all(client.clone()), &sel, "ClusterRoleBinding").await?,
    ]
    .concat();
    assert!(left.is_empty(), "helm uninstall left {left:?}");
    let crd = Api::<CustomResourceDefinition>::all(client.clone()).get_opt("rljobs.rlplane.dev").await?;
    assert!(crd.is_some(), "the CRD stays after helm uninstall (RLJobs of other releases may live)");
    rlplane_e2e::kubectl(&["delete", "namespace", &release_ns, "--wait=false"])?;
    Ok(())
}

async fn names<K>(api: Api<K>, sel: &ListParams, kind: &str) -> anyhow::Result<Vec<String>>
where
    K: kube::Resource + Clone + k8s_openapi::serde::de::DeserializeOwned + std::fmt::Debug,
{
    Ok(api.list(sel).await?.items.iter().map(|o| format!("{kind}/{}", o.name_any())).collect())
}

fn is_forbidden<T>(r: &Result<T, kube::Error>) -> bool {
    matches!(r, Err(kube::Error::Api(s)) if s.code == 403)
}

/// create → every object and pod → ready → Running → a pod fails → gang restart at epoch 1 →
/// the coordinator exits 0 → Succeeded, its pods and objects deleted: every write the operator
/// makes, with the chart's RBAC (a Role it may not grant would fail the object apply).
async fn lifecycle(env: &Env) -> anyhow::Result<()> {
    let job = env.apply_manifest("rljob-cpu.yaml", |_| {}).await?;
    let name = job.name_any();
    env.ready_all(&name, 0, 3).await?;
    env.wait_objects(&name, true, STEP).await?;
    let job = env.wait_job(&name, "Running", STEP, |j| phase_of(j) == Some(Phase::Running)).await?;
    assert!(is_true(&job, RUNNING));
    env.exit(&format!("{name}-gen-0"), 1).await?;
    env.wait_job(&name, "a gang restart", STEP, |j| epoch_of(j) == 1).await?;
    env.ready_all(&name, 1, 3).await?;
    env.wait_job(&name, "Running at epoch 1", STEP, |j| phase_of(j) == Some(Phase::Running) && epoch_of(j) == 1)
        .await?;
    let pods = env.pods_of(&name).await?;
    let coordinator = coordinator(&pods).map(|p| p.name_any()).expect("a coordinator pod");
    env.exit(&coordinator, 0).await?;
    let job = env.wait_job(&name, "Succeeded", STEP, |j| phase_of(j) == Some(Phase::Succeeded)).await?;
    assert!(is_true(&job, SUCCEEDED));
    env.wait_pods(&name, "no pods", STEP, |p| p.is_empty()).await?;
    env.wait_objects(&name, false, STEP).await?;
    let jobs: Api<RLJob> = env.jobs();
    jobs.delete(&name, &DeleteParams::background()).await?;
    Ok(())
}

#[tokio::test]
async fn the_chart_installed_for_one_namespace_runs_a_job_with_its_own_rbac_and_uninstalls_clean() -> anyhow::Result<()>
{
    if skip_without_cluster()? {
        return Ok(());
    }
    install_and_run("rlplane-one", true).await
}

#[tokio::test]
async fn the_chart_installed_for_every_namespace_runs_a_job_with_its_own_rbac_and_uninstalls_clean()
-> anyhow::Result<()> {
    if skip_without_cluster()? {
        return Ok(());
    }
    install_and_run("rlplane-all", false).await
}
