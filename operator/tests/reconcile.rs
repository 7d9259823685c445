//! The reconcile loop against a mocked API server (tower-test): every request the operator makes
//! is asserted (method, path, query, body) and answered, in order, and nothing else may be sent.

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use http::{Method, Request, Response};
use k8s_openapi::api::core::v1::{
    ContainerState, ContainerStateTerminated, ContainerStatus, Pod, PodCondition, PodStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::client::Body;
use kube::runtime::controller::Action;
use kube::runtime::events::{Recorder, Reporter};
use kube::{Client, ResourceExt};
use prometheus_client::registry::Registry;
use rlplane_api::{Phase, RLJob, RLJobStatus, load_rljob};
use rlplane_operator::conditions;
use rlplane_operator::decide::{RESYNC, WAIT_FOR_PODS, decide};
use rlplane_operator::desired::{OperatorConfig, desired, labels};
use rlplane_operator::metrics::{JobsByPhase, Metrics, PREFIX};
use rlplane_operator::reconcile::{Clock, Context, error_policy, reconcile};
use serde_json::{Value, json};
use tower_test::mock::{self, Handle, SendResponse};

const NS: &str = "ml";
const UID: &str = "6f1c-uid";
const APPLY: &str = "?&force=true&fieldManager=rlplane-operator";

fn t(s: i64) -> Timestamp {
    Timestamp::from_second(1_800_000_000 + s).unwrap()
}

fn cfg() -> OperatorConfig {
    OperatorConfig { worker_image: "rlplane-worker:test".into(), image_pull_policy: None }
}

fn job(file: &str) -> RLJob {
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../manifests").join(file)).unwrap();
    let mut job = load_rljob(&text).unwrap();
    job.metadata.namespace = Some(NS.into());
    job.metadata.uid = Some(UID.into());
    job.metadata.generation = Some(1);
    job.metadata.resource_version = Some("1".into());
    job
}

/// The job's pods at `epoch` as the API server would list them: created, Running, ready or not.
fn pods(job: &RLJob, epoch: u32, ready: bool) -> Vec<Pod> {
    desired(job, epoch, &cfg())
        .unwrap()
        .pods
        .into_iter()
        .enumerate()
        .map(|(i, mut p)| {
            p.metadata.uid = Some(format!("pod-uid-{i}"));
            p.status = Some(PodStatus {
                phase: Some("Running".into()),
                conditions: Some(vec![PodCondition {
                    type_: "Ready".into(),
                    status: if ready { "True" } else { "False" }.into(),
                    ..Default::default()
                }]),
                ..Default::default()
            });
            p
        })
        .collect()
}

/// The status the operator wrote when it decided on `job` with `pods` at `now`.
fn status_after(job: &RLJob, pods: &[Pod], now: Timestamp) -> RLJobStatus {
    decide(job, pods, now, &cfg()).status().cloned().unwrap()
}

fn with_status(mut job: RLJob, status: RLJobStatus) -> RLJob {
    job.status = Some(status);
    job
}

/// A job that reached Running at epoch 0 (created at t=0, ready at t=10).
fn running(file: &str) -> (RLJob, Vec<Pod>) {
    let j = job(file);
    let started = with_status(j.clone(), status_after(&j, &[], t(0)));
    let ready = pods(&j, 0, true);
    let running = with_status(j, status_after(&started, &ready, t(10)));
    assert_eq!(running.status.as_ref().unwrap().phase, Phase::Running);
    (running, ready)
}

struct ApiServer {
    handle: Handle<Request<Body>, Response<Body>>,
}

type Exchange = (Method, String, Value, Option<String>, SendResponse<Response<Body>>);

fn respond(code: u16, body: &Value) -> Response<Body> {
    Response::builder().status(code).body(Body::from(serde_json::to_vec(body).unwrap())).unwrap()
}

fn status_error(code: u16, reason: &str, message: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": message, "reason": reason, "code": code})
}

fn success() -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 200})
}

impl ApiServer {
    async fn next(&mut self) -> Exchange {
        let (req, send) = tokio::time::timeout(Duration::from_secs(10), self.handle.next_request())
            .await
            .expect("the operator made no further request")
            .expect("the client is gone");
        let (parts, body) = req.into_parts();
        let bytes = body.collect_bytes().await.unwrap();
        let body = if bytes.is_empty() { Value::Null } else { serde_json::from_slice(&bytes).unwrap() };
        let content_type = parts.headers.get("content-type").map(|v| v.to_str().unwrap().to_string());
        let uri = parts.uri.path_and_query().unwrap().to_string();
        (parts.method, uri, body, content_type, send)
    }

    /// Expects exactly this request; returns its body and the responder.
    async fn expect(&mut self, method: Method, uri: &str) -> (Value, SendResponse<Response<Body>>) {
        let (m, u, body, _, send) = self.next().await;
        assert_eq!((&m, u.as_str()), (&method, uri), "unexpected request; body: {body}");
        (body, send)
    }

    async fn get_job(&mut self, job: &RLJob) {
        let (_, send) = self
            .expect(Method::GET, &format!("/apis/rlplane.dev/v1alpha1/namespaces/{NS}/rljobs/{}", job.name_any()))
            .await;
        send.send_response(respond(200, &serde_json::to_value(job).unwrap()));
    }

    async fn list_pods(&mut self, job: &RLJob, pods: &[Pod]) {
        let uri = format!("/api/v1/namespaces/{NS}/pods?&labelSelector=rlplane.dev%2Fjob%3D{}", job.name_any());
        let (_, send) = self.expect(Method::GET, &uri).await;
        send.send_response(respond(
            200,
            &json!({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": pods}),
        ));
    }

    /// Expects server-side applies (field manager rlplane-operator, force) of exactly these
    /// objects, in any order; answers each with what was applied; returns the bodies.
    async fn applies(&mut self, uris: &[String]) -> Vec<Value> {
        let mut expected: BTreeSet<&String> = uris.iter().collect();
        let mut bodies = Vec::new();
        while !expected.is_empty() {
            let (m, u, body, content_type, send) = self.next().await;
            assert_eq!(m, Method::PATCH, "{u}");
            assert_eq!(content_type.as_deref(), Some("application/apply-patch+yaml"), "{u}: server-side apply");
            let path =
                u.strip_suffix(APPLY).unwrap_or_else(|| panic!("{u}: not an apply by rlplane-operator with force"));
            assert!(expected.remove(&path.to_string()), "unexpected apply {path}; still expected {expected:?}");
            send.send_response(respond(200, &body));
            bodies.push(body);
        }
        bodies
    }

    /// The objects every active reconcile applies: one round of concurrent requests, in any
    /// order — the ServiceAccount, Role, Service, plan ConfigMap and NetworkPolicy applied, the
    /// epoch's key Secret created (answered as new, so the previous epoch's is then deleted),
    /// never applied or read — then the RoleBinding, whose escalation check reads the Role.
    async fn apply_objects(&mut self, job: &str) -> Vec<Value> {
        self.apply_objects_with(job, None).await
    }

    /// [`Api::apply_objects`] with a PodGroup applied in the first round and answered with
    /// `(its path, status)`; a refused PodGroup ends the objects there (no RoleBinding). The
    /// bodies come back in the order ServiceAccount, Role, RoleBinding, Service, ConfigMap,
    /// Secret, NetworkPolicy, then the PodGroup.
    async fn apply_objects_with(&mut self, job: &str, pod_group: Option<(String, u16)>) -> Vec<Value> {
        let mut applies: BTreeSet<String> = [
            format!("/api/v1/namespaces/{NS}/serviceaccounts/{job}-worker"),
            format!("/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/roles/{job}-worker"),
            format!("/api/v1/namespaces/{NS}/services/{job}-headless"),
            format!("/api/v1/namespaces/{NS}/configmaps/{job}-plan"),
            format!("/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies/{job}-ingress"),
        ]
        .into();
        if let Some((path, _)) = &pod_group {
            applies.insert(path.clone());
        }
        let secrets = format!("/api/v1/namespaces/{NS}/secrets");
        let (mut bodies, mut created, mut deleted) = (Vec::new(), None, false);
        while !applies.is_empty() || created.is_none() || (created.is_some_and(|e: u32| e > 0) && !deleted) {
            let (m, u, body, content_type, send) = self.next().await;
            if m == Method::POST {
                assert_eq!(u, format!("{secrets}?&fieldManager=rlplane-operator"));
                let epoch: u32 = body["metadata"]["labels"][labels::EPOCH].as_str().unwrap().parse().unwrap();
                // The uid is 6f1c-uid: its first 8 letters and digits.
                assert_eq!(body["metadata"]["name"], format!("{job}-key-6f1cuid-e{epoch}"));
                assert_eq!(body["immutable"], true);
                send.send_response(respond(201, &body));
                created = Some(epoch);
                bodies.push(body);
            } else if m == Method::DELETE {
                let epoch = created.expect("the previous epoch's key is deleted once the new one exists");
                assert_eq!(u, format!("{secrets}/{job}-key-6f1cuid-e{}?", epoch - 1));
                assert_eq!(body["propagationPolicy"], "Background");
                send.send_response(respond(200, &success()));
                deleted = true;
            } else {
                assert_eq!(m, Method::PATCH, "{u}");
                assert_eq!(content_type.as_deref(), Some("application/apply-patch+yaml"), "{u}: server-side apply");
                let path =
                    u.strip_suffix(APPLY).unwrap_or_else(|| panic!("{u}: not an apply by rlplane-operator with force"));
                assert!(
                    applies.remove(path),
                    "unexpected request {path} in the first round; still expected {applies:?}"
                );
                match &pod_group {
                    Some((p, code)) if p == path && *code != 200 => {
                        let why = "the server could not find the requested resource";
                        send.send_response(respond(*code, &status_error(*code, "NotFound", why)));
                        bodies.push(body);
                        continue;
                    }
                    _ => send.send_response(respond(200, &body)),
                }
                bodies.push(body);
            }
        }
        if pod_group.as_ref().is_none_or(|(_, code)| *code == 200) {
            bodies.extend(
                self.applies(&[format!(
                    "/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/rolebindings/{job}-worker"
                )])
                .await,
            );
        }
        let order = ["ServiceAccount", "Role", "RoleBinding", "Service", "ConfigMap", "Secret", "NetworkPolicy"];
        bodies.sort_by_key(|b| order.iter().position(|k| b["kind"] == *k).unwrap_or(order.len()));
        bodies
    }

    /// Expects the operator's status apply; answers with the job carrying it; returns it.
    async fn write_status(&mut self, job: &RLJob) -> RLJobStatus {
        let uri = format!("/apis/rlplane.dev/v1alpha1/namespaces/{NS}/rljobs/{}/status{APPLY}", job.name_any());
        let (m, u, body, content_type, send) = self.next().await;
        assert_eq!((&m, u.as_str()), (&Method::PATCH, uri.as_str()), "body: {body}");
        assert_eq!(content_type.as_deref(), Some("application/apply-patch+yaml"));
        assert_eq!((body["apiVersion"].as_str(), body["kind"].as_str()), (Some("rlplane.dev/v1alpha1"), Some("RLJob")));
        let status = body["status"].clone();
        assert!(status.get("step").is_none() && status.get("lastRefit").is_none(), "coordinator fields in {status}");
        let status: RLJobStatus = serde_json::from_value(status).unwrap();
        send.send_response(respond(200, &serde_json::to_value(with_status(job.clone(), status.clone())).unwrap()));
        status
    }

    /// Expects deletes of exactly these pods (any order), each conditioned on the pod's uid.
    async fn delete_pods(&mut self, pods: &[Pod]) {
        let mut expected: BTreeSet<String> = pods.iter().map(|p| p.name_any()).collect();
        while !expected.is_empty() {
            let (m, u, body, _, send) = self.next().await;
            assert_eq!(m, Method::DELETE, "{u}");
            let name =
                u.strip_prefix(&format!("/api/v1/namespaces/{NS}/pods/")).and_then(|n| n.strip_suffix('?')).unwrap();
            assert!(expected.remove(name), "unexpected delete of {name}");
            let pod = pods.iter().find(|p| p.name_any() == name).unwrap();
            assert_eq!(body["preconditions"]["uid"].as_str(), pod.metadata.uid.as_deref(), "{name}");
            send.send_response(respond(200, &success()));
        }
    }

    /// Expects an Event on the job; returns (type, reason, note).
    async fn event(&mut self, job: &RLJob) -> (String, String, String) {
        let (body, send) = self.expect(Method::POST, &format!("/apis/events.k8s.io/v1/namespaces/{NS}/events?")).await;
        assert_eq!(body["regarding"]["name"].as_str(), Some(job.name_any().as_str()));
        assert_eq!(body["regarding"]["kind"].as_str(), Some("RLJob"));
        assert_eq!(body["reportingController"].as_str(), Some("rlplane.dev/operator"));
        send.send_response(respond(201, &body));
        let s = |k: &str| body[k].as_str().unwrap_or_default().to_string();
        (s("type"), s("reason"), s("note"))
    }

    /// Nothing more was sent.
    fn done(&mut self) {
        if let Some(Some((req, _))) = self.handle.next_request().now_or_never() {
            panic!("unexpected extra request: {} {}", req.method(), req.uri());
        }
    }
}

fn context(now: Timestamp) -> (Arc<Context>, ApiServer, Registry) {
    let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
    let client = Client::new(service, "default");
    let mut registry = Registry::with_prefix(PREFIX);
    let metrics = Metrics::register(&mut registry, JobsByPhase::default());
    let recorder = Recorder::new(
        client.clone(),
        Reporter { controller: "rlplane.dev/operator".into(), instance: Some("test".into()) },
    );
    let ctx = Context::new(client, cfg(), recorder, metrics, Clock::Fixed(now));
    (Arc::new(ctx), ApiServer { handle }, registry)
}

/// Runs one reconcile in the background; awaiting it fails the test after 10 s (a request the
/// test did not answer) instead of hanging.
fn spawn(job: &RLJob, ctx: &Arc<Context>) -> tokio::task::JoinHandle<Result<Action, rlplane_operator::error::Error>> {
    let (job, ctx) = (Arc::new(job.clone()), ctx.clone());
    tokio::spawn(async move {
        tokio::time::timeout(Duration::from_secs(10), reconcile(job, ctx))
            .await
            .expect("the reconcile is waiting for an answer the test never gave")
    })
}

fn metrics_text(registry: &Registry) -> String {
    let mut s = String::new();
    prometheus_client::encoding::text::encode(&mut s, registry).unwrap();
    s
}

fn condition(st: &RLJobStatus, type_: &str) -> (String, String, String) {
    let c = conditions::find(&st.conditions, type_).unwrap();
    (c.status.clone(), c.reason.clone(), c.message.clone())
}

#[tokio::test]
async fn create_applies_the_objects_then_the_pods_then_status_starting() {
    let (ctx, mut api, registry) = context(t(0));
    let j = job("rljob-cpu.yaml");
    let task = spawn(&j, &ctx);
    api.get_job(&j).await;
    api.list_pods(&j, &[]).await;
    let objects = api.apply_objects("grpo-cpu").await;
    let kinds: Vec<_> = objects.iter().map(|o| o["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["ServiceAccount", "Role", "RoleBinding", "Service", "ConfigMap", "Secret", "NetworkPolicy"]);
    assert_eq!(objects[1]["rules"][0]["resourceNames"], json!(["grpo-cpu"]));
    for o in &objects {
        assert_eq!(o["metadata"]["ownerReferences"][0]["uid"], UID, "{}", o["kind"]);
        assert_eq!(o["metadata"]["labels"][labels::JOB], "grpo-cpu");
    }
    let pods = api
        .applies(&["trainer-0", "gen-0", "gen-1"].map(|p| format!("/api/v1/namespaces/{NS}/pods/grpo-cpu-{p}")))
        .await;
    for p in &pods {
        assert_eq!(p["metadata"]["labels"][labels::EPOCH], "0");
        assert_eq!(p["spec"]["serviceAccountName"], "grpo-cpu-worker");
    }
    let st = api.write_status(&j).await;
    assert_eq!((st.phase, st.epoch, st.restarts), (Phase::Starting, 0, 0));
    assert_eq!(condition(&st, conditions::PODS_CREATED).0, "True");
    let (type_, reason, note) = api.event(&j).await;
    assert_eq!(
        (type_.as_str(), reason.as_str(), note.as_str()),
        ("Normal", "PodsCreated", "created 3 pods for epoch 0")
    );
    assert_eq!(task.await.unwrap().unwrap(), Action::requeue(RESYNC));
    api.done();
    let m = metrics_text(&registry);
    assert!(m.contains("rlplane_operator_reconcile_total 1"), "{m}");
    assert!(m.contains("rlplane_operator_phase_transitions_total{phase=\"Starting\"} 1"), "{m}");
    assert!(m.contains("rlplane_operator_reconcile_duration_seconds_count 1"), "{m}");
}

#[tokio::test]
async fn all_pods_ready_makes_the_job_running() {
    let (ctx, mut api, _) = context(t(10));
    let j = job("rljob-cpu.yaml");
    let j = with_status(j.clone(), status_after(&j, &[], t(0)));
    let ready = pods(&j, 0, true);
    let task = spawn(&j, &ctx);
    api.get_job(&j).await;
    api.list_pods(&j, &ready).await;
    api.apply_objects("grpo-cpu").await;
    let st = api.write_status(&j).await;
    assert_eq!(st.phase, Phase::Running);
    assert_eq!((st.roles.trainer.ready, st.roles.generation.ready), (1, 2));
    assert_eq!(condition(&st, conditions::PODS_READY), ("True".into(), "AllPodsReady".into(), "3/3 pods ready".into()));
    let (_, reason, _) = api.event(&j).await;
    assert_eq!(reason, "Running");
    assert_eq!(task.await.unwrap().unwrap(), Action::requeue(RESYNC));
    api.done();
}

#[tokio::test]
async fn a_reconcile_that_changes_nothing_writes_nothing() {
    let (ctx, mut api, _) = context(t(20));
    let (j, ready) = running("rljob-cpu.yaml");
    // The first reconcile of this operator process applies the objects (nothing else changed).
    let task = spawn(&j, &ctx);
    api.get_job(&j).await;
    api.list_pods(&j, &ready).await;
    api.apply_objects("grpo-cpu").await;
    assert_eq!(task.await.unwrap().unwrap(), Action::requeue(RESYNC));
    api.done();
    // The next ones only read: the job, fresh, and its pods. No object, pod or status write.
    for _ in 0..3 {
        let task = spawn(&j, &ctx);
        api.get_job(&j).await;
        api.list_pods(&j, &ready).await;
        assert_eq!(task.await.unwrap().unwrap(), Action::requeue(RESYNC));
        api.done();
    }
}

#[tokio::test]
async fn a_failed_pod_restarts_the_gang_with_a_new_epoch() {
    let (ctx, mut api, registry) = context(t(60));
    let (j, mut live) = running("rljob-cpu.yaml");
    let st = live[2].status.as_mut().unwrap();
    st.phase = Some("Failed".into());
    st.container_statuses = Some(vec![ContainerStatus {
        name: "rlplane-worker".into(),
        state: Some(ContainerState {
            terminated: Some(ContainerStateTerminated {
                exit_code: 1,
                reason: Some("Error".into()),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }]);
    let task = spawn(&j, &ctx);
    api.get_job(&j).await;
    api.list_pods(&j, &live).await;
    let st = api.write_status(&j).await;
    assert_eq!((st.phase, st.epoch, st.restarts), (Phase::Restarting, 1, 1));
    let (_, reason, message) = condition(&st, conditions::RESTARTING);
    assert_eq!(reason, "ContainerFailed");
    assert!(
        message.starts_with("pod grpo-cpu-gen-1: container rlplane-worker exited with code 1 (Error)"),
        "{message}"
    );
    api.delete_pods(&live).await;
    let (type_, reason, note) = api.event(&j).await;
    assert_eq!((type_.as_str(), reason.as_str()), ("Warning", "GangRestart"));
    assert!(note.contains("gang restart 1/3 with epoch 1"), "{note}");
    assert_eq!(task.await.unwrap().unwrap(), Action::requeue(WAIT_FOR_PODS));
    api.done();
    let m = metrics_text(&registry);
    assert!(m.contains("rlplane_operator_restarts_total{reason=\"ContainerFailed\"} 1"), "{m}");
    assert!(m.contains("rlplane_operator_restarts_total{reason=\"PodEvicted\"} 0"), "{m}");

    // The next reconcile creates the gang of epoch 1 under its own names.
    let (ctx, mut api, _) = context(t(70));
    let restarting = with_status(j.clone(), st);
    let task = spawn(&restarting, &ctx);
    api.get_job(&restarting).await;
    api.list_pods(&restarting, &[]).await;
    let objects = api.apply_objects("grpo-cpu").await;
    let plan: Value = serde_json::from_str(objects[4]["data"]["plan.json"].as_str().unwrap()).unwrap();
    assert_eq!(plan["job"]["epoch"], 1, "the plan's token is the new epoch's");
    let created = api
        .applies(&["trainer-0", "gen-0", "gen-1"].map(|p| format!("/api/v1/namespaces/{NS}/pods/grpo-cpu-{p}-e1")))
        .await;
    assert!(created.iter().all(|p| p["metadata"]["labels"][labels::EPOCH] == "1"));
    let st = api.write_status(&restarting).await;
    assert_eq!((st.phase, st.epoch, st.restarts), (Phase::Starting, 1, 1));
    api.event(&restarting).await;
    task.await.unwrap().unwrap();
    api.done();
}

#[tokio::test]
async fn exhausting_the_backoff_limit_fails_the_job_with_the_pod_and_reason() {
    let (ctx, mut api, _) = context(t(60));
    let (mut j, mut live) = running("rljob-cpu.yaml");
    j.spec.run_policy.backoff_limit = 0;
    live[0].metadata.deletion_timestamp = Some(Time(t(55)));
    let task = spawn(&j, &ctx);
    api.get_job(&j).await;
    api.list_pods(&j, &live).await;
    let st = api.write_status(&j).await;
    assert_eq!((st.phase, st.restarts), (Phase::Failed, 0));
    assert_eq!(st.completion_time, Some(Time(t(60))));
    let (status, reason, message) = condition(&st, conditions::FAILED);
    assert_eq!((status.as_str(), reason.as_str()), ("True", "BackoffLimitExceeded"));
    assert_eq!(message, "pod grpo-cpu-trainer-0: the pod was deleted; backoffLimit 0 reached after 0 restarts");
    // The terminating pod is on its way; the others are deleted.
    api.delete_pods(&live[1..]).await;
    let (type_, reason, _) = api.event(&j).await;
    assert_eq!((type_.as_str(), reason.as_str()), ("Warning", "BackoffLimitExceeded"));
    assert_eq!(task.await.unwrap().unwrap(), Action::await_change());
    api.done();
}

#[tokio::test]
async fn suspend_deletes_the_pods_and_resume_recreates_them() {
    let (ctx, mut api, _) = context(t(60));
    let (mut j, live) = running("rljob-cpu.yaml");
    j.spec.run_policy.suspend = true;
    j.metadata.generation = Some(2);
    let task = spawn(&j, &ctx);
    api.get_job(&j).await;
    api.list_pods(&j, &live).await;
    let st = api.write_status(&j).await;
    assert_eq!((st.phase, st.epoch, st.start_time.clone()), (Phase::Suspended, 1, None));
    assert_eq!(condition(&st, conditions::SUSPENDED).0, "True");
    api.delete_pods(&live).await;
    assert_eq!(api.event(&j).await.1, "Suspended");
    assert_eq!(task.await.unwrap().unwrap(), Action::await_change());
    api.done();

    // Pods gone: the other objects are deleted, then PodsCreated=False/NoPods.
    let (ctx, mut api, _) = context(t(70));
    let suspended = with_status(j.clone(), st);
    let task = spawn(&suspended, &ctx);
    api.get_job(&suspended).await;
    api.list_pods(&suspended, &[]).await;
    for uri in [
        // The keys of the last epoch and the one before; the NetworkPolicy.
        format!("/api/v1/namespaces/{NS}/secrets/grpo-cpu-key-6f1cuid-e1?"),
        format!("/api/v1/namespaces/{NS}/secrets/grpo-cpu-key-6f1cuid-e0?"),
        format!("/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies/grpo-cpu-ingress?"),
        format!("/api/v1/namespaces/{NS}/services/grpo-cpu-headless?"),
        format!("/api/v1/namespaces/{NS}/configmaps/grpo-cpu-plan?"),
        format!("/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/rolebindings/grpo-cpu-worker?"),
        format!("/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/roles/grpo-cpu-worker?"),
        format!("/api/v1/namespaces/{NS}/serviceaccounts/grpo-cpu-worker?"),
        format!("/apis/scheduling.volcano.sh/v1beta1/namespaces/{NS}/podgroups/grpo-cpu-gang?"),
        format!("/apis/scheduling.x-k8s.io/v1alpha1/namespaces/{NS}/podgroups/grpo-cpu-gang?"),
    ] {
        let (body, send) = api.expect(Method::DELETE, &uri).await;
        assert_eq!(body["propagationPolicy"], "Background");
        // PodGroup APIs the cluster lacks answer 404: fine.
        let podgroup = uri.contains("podgroups");
        send.send_response(if podgroup {
            respond(404, &status_error(404, "NotFound", "not found"))
        } else {
            respond(200, &success())
        });
    }
    let st = api.write_status(&suspended).await;
    assert_eq!(condition(&st, conditions::PODS_CREATED).1, "NoPods");
    task.await.unwrap().unwrap();
    api.done();

    // Resume.
    let (ctx, mut api, _) = context(t(100));
    let mut resumed = with_status(j.clone(), st);
    resumed.spec.run_policy.suspend = false;
    resumed.metadata.generation = Some(3);
    let task = spawn(&resumed, &ctx);
    api.get_job(&resumed).await;
    api.list_pods(&resumed, &[]).await;
    api.apply_objects("grpo-cpu").await;
    let created = api
        .applies(&["trainer-0", "gen-0", "gen-1"].map(|p| format!("/api/v1/namespaces/{NS}/pods/grpo-cpu-{p}-e1")))
        .await;
    assert!(created.iter().all(|p| p["metadata"]["labels"][labels::EPOCH] == "1"));
    let st = api.write_status(&resumed).await;
    assert_eq!((st.phase, st.start_time.clone()), (Phase::Starting, Some(Time(t(100)))));
    assert_eq!(api.event(&resumed).await.1, "Resumed");
    assert_eq!(api.event(&resumed).await.1, "PodsCreated");
    task.await.unwrap().unwrap();
    api.done();
}

#[tokio::test]
async fn the_active_deadline_fails_the_job() {
    let (mut j, live) = running("rljob-cpu.yaml");
    j.spec.run_policy.active_deadline_seconds = Some(300);
    // Before the deadline: requeued for exactly when it passes.
    let (ctx, mut api, _) = context(t(200));
    let task = spawn(&j, &ctx);
    api.get_job(&j).await;
    api.list_pods(&j, &live).await;
    api.apply_objects("grpo-cpu").await;
    assert_eq!(task.await.unwrap().unwrap(), Action::requeue(Duration::from_secs(100)));
    api.done();

    let (ctx, mut api, _) = context(t(300));
    let task = spawn(&j, &ctx);
    api.get_job(&j).await;
    api.list_pods(&j, &live).await;
    let st = api.write_status(&j).await;
    assert_eq!(st.phase, Phase::Failed);
    assert_eq!(condition(&st, conditions::FAILED).1, "DeadlineExceeded");
    api.delete_pods(&live).await;
    let (type_, reason, _) = api.event(&j).await;
    assert_eq!((type_.as_str(), reason.as_str()), ("Warning", "DeadlineExceeded"));
    task.await.unwrap().unwrap();
    api.done();
}

#[tokio::test]
async fn a_finished_job_is_deleted_when_its_ttl_expires() {
    // Succeeded at t=0, its pods and objects deleted since.
    let (mut j, mut live) = running("rljob-cpu.yaml");
    j.spec.run_policy.ttl_seconds_after_finished = Some(100);
    let coordinator = live.iter_mut().find(|p| p.labels().get(labels::COORDINATOR).is_some()).unwrap();
    coordinator.status.as_mut().unwrap().phase = Some("Succeeded".into());
    let succeeded = with_status(j.clone(), status_after(&j, &live, t(0)));
    let st = status_after(&succeeded, &[], t(0));
    assert_eq!((st.phase, condition(&st, conditions::PODS_CREATED).1.as_str()), (Phase::Succeeded, "NoPods"));
    let j = with_status(j, st);

    let (ctx, mut api, _) = context(t(40));
    let task = spawn(&j, &ctx);
    api.get_job(&j).await;
    api.list_pods(&j, &[]).await;
    assert_eq!(task.await.unwrap().unwrap(), Action::requeue(Duration::from_secs(60)));
    api.done();

    let (ctx, mut api, _) = context(t(100));
    let task = spawn(&j, &ctx);
    api.get_job(&j).await;
    api.list_pods(&j, &[]).await;
    assert_eq!(api.event(&j).await.1, "TTLExpired");
    let (body, send) =
        api.expect(Method::DELETE, &format!("/apis/rlplane.dev/v1alpha1/namespaces/{NS}/rljobs/grpo-cpu?")).await;
    assert_eq!(body["preconditions"]["uid"], UID, "never a newer job of the same name");
    assert_eq!(body["propagationPolicy"], "Background", "the garbage collector deletes the children");
    send.send_response(respond(200, &success()));
    assert_eq!(task.await.unwrap().unwrap(), Action::await_change());
    api.done();
}

#[tokio::test]
async fn a_deleted_job_is_left_alone() {
    let (ctx, mut api, _) = context(t(0));
    let j = job("rljob-cpu.yaml");
    // Gone already (the cache was stale): nothing to do.
    let task = spawn(&j, &ctx);
    let (_, send) =
        api.expect(Method::GET, &format!("/apis/rlplane.dev/v1alpha1/namespaces/{NS}/rljobs/grpo-cpu")).await;
    send.send_response(respond(404, &status_error(404, "NotFound", "rljobs.rlplane.dev \"grpo-cpu\" not found")));
    assert_eq!(task.await.unwrap().unwrap(), Action::await_change());
    api.done();

    // Being deleted: the garbage collector removes the children through their owner references.
    let (ctx, mut api, _) = context(t(0));
    let (mut j, live) = running("rljob-cpu.yaml");
    j.metadata.deletion_timestamp = Some(Time(t(0)));
    j.metadata.finalizers = Some(vec!["example.com/hold".into()]);
    let task = spawn(&j, &ctx);
    api.get_job(&j).await;
    api.list_pods(&j, &live).await;
    assert_eq!(task.await.unwrap().unwrap(), Action::await_change());
    api.done();
}

#[tokio::test]
async fn an_invalid_spec_fails_without_retry() {
    let (ctx, mut api, _) = context(t(0));
    let mut j = job("rljob-cpu.yaml");
    j.spec.trainer.parallelism.data = 3;
    let task = spawn(&j, &ctx);
    api.get_job(&j).await;
    api.list_pods(&j, &[]).await;
    let st = api.write_status(&j).await;
    assert_eq!(st.phase, Phase::Failed);
    let (status, reason, message) = condition(&st, conditions::FAILED);
    assert_eq!((status.as_str(), reason.as_str()), ("True", "InvalidSpec"));
    assert!(message.starts_with("spec.trainer.parallelism:"), "{message}");
    let (type_, reason, note) = api.event(&j).await;
    assert_eq!((type_.as_str(), reason.as_str()), ("Warning", "InvalidSpec"));
    assert!(note.contains("spec.trainer.parallelism"));
    assert_eq!(task.await.unwrap().unwrap(), Action::await_change(), "not requeued");
    api.done();

    // Reconciled again (a resync, a pod event) at the same generation: read-only.
    let (ctx, mut api, _) = context(t(50));
    let failed = with_status(j, st);
    let task = spawn(&failed, &ctx);
    api.get_job(&failed).await;
    api.list_pods(&failed, &[]).await;
    assert_eq!(task.await.unwrap().unwrap(), Action::await_change());
    api.done();
}

#[tokio::test]
async fn a_refused_pod_is_reported_in_status_and_an_event_and_retried_with_backoff() {
    let (ctx, mut api, registry) = context(t(0));
    let j = job("rljob-cpu.yaml");
    let task = spawn(&j, &ctx);
    api.get_job(&j).await;
    api.list_pods(&j, &[]).await;
    api.apply_objects("grpo-cpu").await;
    // Every pod is refused (a ResourceQuota); the operator may stop after the first refusal.
    let quota = "pods \"grpo-cpu-trainer-0\" is forbidden: exceeded quota: gpu, requested: pods=1, used: pods=8, limited: pods=8";
    let status = loop {
        let (m, u, body, _, send) = api.next().await;
        if u.ends_with(&format!("/rljobs/grpo-cpu/status{APPLY}")) {
            let st: RLJobStatus = serde_json::from_value(body["status"].clone()).unwrap();
            send.send_response(respond(200, &serde_json::to_value(with_status(j.clone(), st.clone())).unwrap()));
            break st;
        }
        assert_eq!(m, Method::PATCH, "{u}");
        assert!(u.starts_with(&format!("/api/v1/namespaces/{NS}/pods/")), "{u}");
        send.send_response(respond(403, &status_error(403, "Forbidden", quota)));
    };
    let (_, reason, message) = condition(&status, conditions::PODS_CREATED);
    assert_eq!(reason, "CreateFailed");
    assert!(message.contains("exceeded quota"), "{message}");
    let (type_, reason, _) = api.event(&j).await;
    assert_eq!((type_.as_str(), reason.as_str()), ("Warning", "CreateFailed"));
    let (_, reason, note) = api.event(&j).await;
    assert_eq!(reason, "ReconcileError");
    assert!(note.contains("exceeded quota"));
    let err = task.await.unwrap().unwrap_err();
    assert_eq!(err.kind(), "forbidden");
    let job = Arc::new(j);
    assert_eq!(error_policy(job.clone(), &err, ctx.clone()), Action::requeue(Duration::from_secs(2)));
    assert_eq!(error_policy(job.clone(), &err, ctx.clone()), Action::requeue(Duration::from_secs(4)));
    let m = metrics_text(&registry);
    assert!(m.contains("rlplane_operator_reconcile_errors_total{error=\"forbidden\"} 1"), "{m}");
}

#[tokio::test]
async fn a_gang_scheduler_the_cluster_lacks_is_named_in_the_error() {
    let (ctx, mut api, _) = context(t(0));
    let j = job("rljob-split.yaml");
    let task = spawn(&j, &ctx);
    api.get_job(&j).await;
    api.list_pods(&j, &[]).await;
    let group = format!("/apis/scheduling.volcano.sh/v1beta1/namespaces/{NS}/podgroups/llama3-8b-split-gang");
    let bodies = api.apply_objects_with("llama3-8b-split", Some((group, 404))).await;
    let pod_group = bodies.iter().find(|b| b["kind"] == "PodGroup").expect("the PodGroup applied");
    assert_eq!(pod_group["spec"]["minMember"], 3);
    let st = api.write_status(&j).await;
    let (_, reason, message) = condition(&st, conditions::PODS_CREATED);
    assert_eq!(reason, "CreateFailed");
    assert!(message.contains("install Volcano"), "{message}");
    api.event(&j).await;
    api.event(&j).await;
    let err = task.await.unwrap().unwrap_err();
    assert_eq!(err.kind(), "gang_scheduler_missing");
}
