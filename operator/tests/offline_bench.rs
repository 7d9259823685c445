//! Offline measurements of the operator (no cluster): the reconcile layer against an in-memory
//! API server. Ignored by default; run with
//! `cargo test --release -p rlplane-operator --test offline_bench -- --ignored --nocapture`.
//!
//! What it measures is the operator's own work (deciding, serializing, the HTTP client) with an
//! API server that answers instantly; a real API server adds its latency per request. The RSS is
//! that of this test process, which also holds the in-memory API server's objects: an upper
//! bound of the operator's share. docs/benchmarks.md reports the figures.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::{Method, Request, Response};
use k8s_openapi::jiff::Timestamp;
use kube::client::Body;
use kube::runtime::events::{Recorder, Reporter};
use kube::{Client, ResourceExt};
use prometheus_client::registry::Registry;
use rlplane_api::{Phase, RLJob};
use rlplane_operator::bench::gang_job;
use rlplane_operator::cluster::memory_of;
use rlplane_operator::desired::{OperatorConfig, labels};
use rlplane_operator::metrics::{JobsByPhase, Metrics, PREFIX};
use rlplane_operator::reconcile::{Clock, Context, reconcile};
use serde_json::{Value, json};
use tower_test::mock;

/// Objects by path (`/api/v1/namespaces/ns/pods/name`), kept as compact JSON so that the fake's
/// own memory is just those bytes, and a count of requests.
#[derive(Default)]
struct Store {
    objects: BTreeMap<String, String>,
    requests: u64,
    next_uid: u64,
}

fn respond(code: u16, body: &Value) -> Response<Body> {
    Response::builder().status(code).body(Body::from(serde_json::to_vec(body).unwrap())).unwrap()
}

/// Answers one request the way the API server would, for the calls the operator makes.
fn serve(store: &mut Store, method: &Method, path: &str, query: &str, body: Value) -> Response<Body> {
    store.requests += 1;
    let not_found = || {
        respond(
            404,
            &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404, "reason": "NotFound", "message": "not found"}),
        )
    };
    match *method {
        Method::GET if path.ends_with("/pods") => {
            let job = query.split("%3D").nth(1).unwrap_or_default().to_string();
            let items: Vec<Value> = store
                .objects
                .range(format!("{path}/")..)
                .take_while(|(k, _)| k.starts_with(&format!("{path}/")))
                // Cheap pre-filter on the text, so that the fake's cost stays out of the figures.
                .filter(|(_, v)| v.contains(&format!("\"{}\":\"{job}\"", labels::JOB)))
                .map(|(_, v)| serde_json::from_str::<Value>(v).unwrap())
                .filter(|p| p["metadata"]["labels"][labels::JOB] == job.as_str())
                .collect();
            respond(200, &json!({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items}))
        }
        Method::GET => match store.objects.get(path) {
            Some(o) => respond(200, &serde_json::from_str(o).unwrap()),
            None => not_found(),
        },
        Method::PATCH => {
            if let Some(object) = path.strip_suffix("/status") {
                let Some(o) = store.objects.get_mut(object) else { return not_found() };
                let mut v: Value = serde_json::from_str(o).unwrap();
                v["status"] = body["status"].clone();
                *o = v.to_string();
                return respond(200, &v);
            }
            store.next_uid += 1;
            let mut v: Value = match store.objects.get(path) {
                Some(o) => serde_json::from_str(o).unwrap(),
                None => {
                    let mut created = body.clone();
                    created["metadata"]["uid"] = json!(format!("uid-{}", store.next_uid));
                    created
                }
            };
            for (k, val) in body.as_object().into_iter().flatten() {
                if k != "metadata" {
                    v[k] = val.clone();
                }
            }
            store.objects.insert(path.to_string(), v.to_string());
            respond(200, &v)
        }
        Method::DELETE => match store.objects.remove(path) {
            Some(_) => respond(200, &json!({"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 200})),
            None => not_found(),
        },
        Method::POST => respond(201, &body),
        _ => not_found(),
    }
}

fn fake_api() -> (Client, Arc<Mutex<Store>>) {
    let (service, mut handle) = mock::pair::<Request<Body>, Response<Body>>();
    let store = Arc::new(Mutex::new(Store::default()));
    let served = store.clone();
    tokio::spawn(async move {
        while let Some((req, send)) = handle.next_request().await {
            let (parts, body) = req.into_parts();
            let bytes = body.collect_bytes().await.unwrap_or_default();
            let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
            let path = parts.uri.path().to_string();
            let query = parts.uri.query().unwrap_or_default().to_string();
            let response = serve(&mut served.lock().unwrap(), &parts.method, &path, &query, body);
            send.send_response(response);
        }
    });
    (Client::new(service, "default"), store)
}

fn job_path(name: &str) -> String {
    format!("/apis/rlplane.dev/v1alpha1/namespaces/bench/rljobs/{name}")
}

fn insert_job(store: &Mutex<Store>, mut job: RLJob, uid: &str) -> RLJob {
    job.metadata.uid = Some(uid.into());
    job.metadata.generation = Some(1);
    store.lock().unwrap().objects.insert(job_path(&job.name_any()), serde_json::to_string(&job).unwrap());
    job
}

fn set_all_pods_ready(store: &Mutex<Store>) {
    for (path, pod) in store.lock().unwrap().objects.iter_mut() {
        if path.contains("/pods/") {
            let mut v: Value = serde_json::from_str(pod).unwrap();
            v["status"] = json!({"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]});
            *pod = v.to_string();
        }
    }
}

fn phase(store: &Mutex<Store>, name: &str) -> Phase {
    let s = store.lock().unwrap();
    let job: Value = serde_json::from_str(&s.objects[&job_path(name)]).unwrap();
    serde_json::from_value(job["status"]["phase"].clone()).unwrap_or_default()
}

fn mb(bytes: u64) -> f64 {
    bytes as f64 / 1e6
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement; run with --ignored --nocapture (release build)"]
async fn offline_reconcile_costs_and_memory() {
    let pid = std::process::id();
    let (client, store) = fake_api();
    let mut registry = Registry::with_prefix(PREFIX);
    let metrics = Metrics::register(&mut registry, JobsByPhase::default());
    let recorder = Recorder::new(client.clone(), Reporter { controller: "bench".into(), instance: None });
    let ctx =
        Arc::new(Context::new(client, OperatorConfig::default(), recorder, metrics, Clock::Fixed(Timestamp::now())));
    let baseline = memory_of(pid);

    // 1. 100 RLJobs of 3 pods: created, then Running, then steady reconciles.
    let names: Vec<String> = (0..100).map(|i| format!("small-{i}")).collect();
    for (i, name) in names.iter().enumerate() {
        let mut job = gang_job(name, "bench", 2, false).unwrap();
        job.spec.generation.engines = 2;
        insert_job(&store, job, &format!("small-uid-{i}"));
    }
    let get = |name: &str| -> RLJob { serde_json::from_str(&store.lock().unwrap().objects[&job_path(name)]).unwrap() };
    let mut timings: BTreeMap<&str, Duration> = BTreeMap::new();
    for pass in ["create", "running", "steady"] {
        if pass == "running" {
            set_all_pods_ready(&store);
        }
        let started = Instant::now();
        for name in &names {
            reconcile(Arc::new(get(name)), ctx.clone()).await.unwrap();
        }
        timings.insert(pass, started.elapsed());
    }
    assert!(names.iter().all(|n| phase(&store, n) == Phase::Running));
    let loaded = memory_of(pid);
    let (objects, json_bytes) = {
        let s = store.lock().unwrap();
        (s.objects.len(), s.objects.values().map(String::len).sum::<usize>())
    };
    for (pass, d) in &timings {
        println!("100 RLJobs × 3 pods, {pass} pass: {:.2} ms per reconcile", d.as_secs_f64() * 1e3 / 100.0);
    }
    if let (Some(b), Some(l)) = (baseline, loaded) {
        println!(
            "RSS of this process: {:.1} MB before, {:.1} MB with 100 RLJobs reconciled (peak {:.1} MB); the fake API server holds {objects} objects in {:.2} MB of JSON",
            mb(b.rss),
            mb(l.rss),
            mb(l.peak),
            mb(json_bytes as u64)
        );
    }
    // 2. The operator's share of "64-pod RLJob applied → all objects exist": one reconcile that
    //    reads the job, applies 5 objects and 64 pods, writes status and publishes an Event.
    let mut create = Vec::new();
    for round in 0..20 {
        let name = format!("gang-{round}");
        let job = insert_job(&store, gang_job(&name, "bench", 64, false).unwrap(), &format!("job-uid-{round}"));
        let before = store.lock().unwrap().requests;
        let started = Instant::now();
        reconcile(Arc::new(job), ctx.clone()).await.unwrap();
        create.push(started.elapsed());
        let requests = store.lock().unwrap().requests - before;
        assert_eq!(requests, 2 + 5 + 64 + 1 + 1, "GET, LIST, 5 objects, 64 pods, status, Event");
        assert_eq!(phase(&store, &name), Phase::Starting);
    }
    create.sort();
    let median = create[create.len() / 2];
    println!(
        "64-pod RLJob, one creating reconcile (73 API calls, instant API server): median {:.1} ms, max {:.1} ms",
        median.as_secs_f64() * 1e3,
        create.last().unwrap().as_secs_f64() * 1e3
    );
}

#[test]
fn the_benchmark_jobs_have_the_sizes_it_reports() {
    let mut job = gang_job("gang", "bench", 64, false).unwrap();
    job.metadata.uid = Some("uid".into());
    let d = rlplane_operator::desired::desired(&job, 0, &OperatorConfig::default()).unwrap();
    assert_eq!(d.pods.len(), 64);
    for p in &d.pods {
        let spec = p.spec.as_ref().unwrap();
        let selector = spec.node_selector.as_ref().expect("benchmark pods never schedule");
        assert_eq!(selector.get(rlplane_operator::bench::UNSCHEDULABLE_LABEL.0).map(String::as_str), Some("none"));
    }
    let mut small = gang_job("small", "bench", 2, false).unwrap();
    small.spec.generation.engines = 2;
    small.metadata.uid = Some("uid".into());
    assert_eq!(rlplane_operator::desired::desired(&small, 0, &OperatorConfig::default()).unwrap().pods.len(), 3);
    let odd = gang_job("odd", "bench", 63, false).unwrap_err().to_string();
    assert!(odd.contains("--pods must be even"), "{odd}");
}
