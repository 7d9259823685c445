//! The transfer queue end to end with real processes: put / claim / get / write-back / clear with
//! checksums, exactly-once claims per consumer group, token refusal, follower write-back refusal.

mod tq_support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use rlplane::net::JobAuth;
use rlplane::tq::client::{ClientConfig, WriteRole};
use rlplane::tq::{Column, TqClient, TqError};
use rlplane_api::topology::{ClusterAddressing, JobIdentity, build_plan};
use rlplane_api::{RLJobSpec, TqPlacement};
use serde_json::json;
use tq_support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn put_claim_get_write_back_clear_across_processes() {
    let mut c = Cluster::start(2, 64 << 20, Duration::from_secs(30), 5_000).await;
    let mut gen0 = c.client("gen-0", &[]);
    let mut gen1 = c.client("gen-1", &[]);
    // Two producers, 64 samples each, in parallel.
    gen0.send("put step-0 0 64 10 300 16 1").await.unwrap();
    gen1.send("put step-0 64 64 10 300 16 2").await.unwrap();
    let p0 = gen0.recv(T).await.unwrap();
    let p1 = gen1.recv(T).await.unwrap();
    assert_eq!(p0["ok"], json!(true), "{p0}");
    assert_eq!(p1["ok"], json!(true), "{p1}");
    let mut expected = sums(&p0);
    expected.extend(sums(&p1));
    assert_eq!(expected.len(), 128);
    let put_bytes = p0["bytes"].as_u64().unwrap() + p1["bytes"].as_u64().unwrap();
    let status = c.controller.status("step-0").unwrap();
    assert_eq!(status.samples, 128);
    assert_eq!(status.units, vec![0, 1], "keys are hashed across both dedicated units");

    // Two consumers of group `train` split the step; nothing is handed out twice.
    let mut a = c.client("trainer-0", &[]);
    let mut b = c.client("trainer-1", &[]);
    let ca = a.call_ok("claim step-0 train 50 0 input_ids", T).await.unwrap();
    let cb = b.call_ok("claim step-0 train 1000 0 input_ids", T).await.unwrap();
    let (ka, kb) = (keys(&ca), keys(&cb));
    assert_eq!((ka.len(), kb.len()), (50, 78));
    let union: BTreeSet<&String> = ka.iter().chain(&kb).collect();
    assert_eq!(union.len(), 128, "every sample claimed exactly once");
    let mut e = c.client("eval-0", &[]);
    assert!(keys(&e.call_ok("claim step-0 train 10 0 input_ids", T).await.unwrap()).is_empty());
    // Another group sees every sample once more.
    assert_eq!(keys(&e.call_ok("claim step-0 eval 1000 0 -", T).await.unwrap()).len(), 128);

    // Bytes match what the producers put, sample by sample.
    for (peer, claimed) in [(&mut a, &ka), (&mut b, &kb)] {
        let g = peer.call_ok("get input_ids,logprobs,loss_mask,reward", T).await.unwrap();
        let got = sums(&g);
        assert_eq!(got.keys().collect::<BTreeSet<_>>(), claimed.iter().collect::<BTreeSet<_>>());
        for (k, s) in &got {
            assert_eq!(Some(s), expected.get(k), "sample {k}");
        }
    }

    // A writes back a field for its samples; a group requiring it sees exactly those.
    let wb = a.call_ok("writeback old_logprobs", T).await.unwrap();
    let wb_sums = sums(&wb);
    let mut r = c.client("ref-0", &[]);
    let cr = r.call_ok("claim step-0 ref 1000 0 input_ids,old_logprobs", T).await.unwrap();
    assert_eq!(keys(&cr).iter().collect::<BTreeSet<_>>(), ka.iter().collect::<BTreeSet<_>>());
    let gr = r.call_ok("get old_logprobs", T).await.unwrap();
    assert_eq!(sums(&gr), wb_sums, "written-back bytes read back intact");
    let wb_bytes = gr["bytes"].as_u64().unwrap();

    // Acks.
    assert_eq!(a.call_ok("ack", T).await.unwrap()["acked"], json!(50));
    assert_eq!(b.call_ok("ack", T).await.unwrap()["acked"], json!(78));
    let st = c.controller.status("step-0").unwrap();
    let train = st.groups.iter().find(|g| g.group == "train").unwrap();
    assert_eq!((train.acked, train.claimed), (128, 0));

    // Clear frees every byte in every unit.
    let cl = a.call_ok("clear step-0", T).await.unwrap();
    assert_eq!(cl["freed"].as_u64().unwrap(), put_bytes + wb_bytes);
    assert_eq!(cl["units"], json!(2));
    assert!(c.controller.status("step-0").is_none());
    for s in c.storage.iter_mut() {
        assert_eq!(s.call_ok("stats", T).await.unwrap()["used"], json!(0));
    }
    // Reading a cleared step is a clear error naming the partition and the unit.
    let g = b.call("get input_ids", T).await.unwrap();
    assert_eq!(g["ok"], json!(false));
    let msg = g["error"].as_str().unwrap();
    assert!(msg.contains("step-0") && msg.contains("storage unit"), "{msg}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_of_another_job_or_epoch_is_refused() {
    let mut c = Cluster::start(1, 1 << 20, Duration::from_secs(30), 5_000).await;
    let mut stale = c.client_with("gen-old", "e7-ffffffffffffffff", &key_file_of([7; 32]), &[]);
    let v = stale.call("put step-0 0 4 4 8 4 1", T).await.unwrap();
    assert_eq!(v["ok"], json!(false), "{v}");
    let msg = v["error"].as_str().unwrap();
    assert!(msg.contains("another job or epoch"), "{msg}");
    let v = stale.call("claim step-0 train 4 0 -", T).await.unwrap();
    assert!(v["error"].as_str().unwrap().contains("another job or epoch"), "{v}");
    // Nothing reached the store or the controller.
    assert!(c.controller.status("step-0").is_none());
    assert_eq!(c.storage[0].call_ok("stats", T).await.unwrap()["used"], json!(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_write_back_is_refused_and_stores_nothing() {
    let mut c = Cluster::start(1, 8 << 20, Duration::from_secs(30), 5_000).await;
    let mut producer = c.client("gen-0", &[]);
    let put = producer.call_ok("put step-0 0 8 4 16 4 1", T).await.unwrap();
    let mut f = c.client("trainer-1", &["--follower-of", "trainer-0"]);
    f.call_ok("claim step-0 train 8 0 -", T).await.unwrap();
    f.call_ok("get input_ids", T).await.unwrap();
    let v = f.call("writeback old_logprobs", T).await.unwrap();
    assert_eq!(v["kind"], json!("FollowerWriteBack"), "{v}");
    assert!(v["error"].as_str().unwrap().contains("trainer-0"), "{v}");
    assert_eq!(c.controller.status("step-0").unwrap().fields, vec!["input_ids", "logprobs", "loss_mask", "reward"]);
    assert_eq!(c.storage[0].call_ok("stats", T).await.unwrap()["used"], put["bytes"]);
}

fn spec(tp: u32, dp: u32, placement: TqPlacement) -> RLJobSpec {
    let yaml = format!(
        "mode: Split\nmodel: {{preset: tiny}}\ntrainer: {{nodes: 1, gpusPerNode: {}, parallelism: {{tensor: {tp}, data: {dp}}}}}\ngeneration: {{engines: 2, tensorParallel: 2}}\nworkload: {{promptsPerStep: 8}}\n",
        tp * dp
    );
    let mut s: RLJobSpec = serde_saphyr::from_str(&yaml).unwrap();
    s.transfer_queue.placement = placement;
    s
}

#[tokio::test]
async fn roles_come_from_the_plan_and_followers_cannot_write() {
    let id = JobIdentity { name: "job".into(), namespace: "ns".into(), uid: "u".into(), epoch: 3, resume: None };
    let addr = ClusterAddressing { job: "job".into(), namespace: "ns".into() };
    let plan = build_plan(&spec(2, 2, TqPlacement::ProducerLocal), &id, &addr).unwrap();
    let mut roles = BTreeMap::new();
    for g in &plan.fanout_groups {
        for &m in &g.members {
            let cfg = ClientConfig::from_plan(&plan, m, &JobAuth::new(&plan.job.token, &KEY)).unwrap();
            assert_eq!(cfg.auth.token(), plan.job.token);
            roles.insert(plan.process(m).name.clone(), cfg.role.clone());
            if m == g.leader {
                assert_eq!(cfg.role, WriteRole::Writer);
            } else {
                assert_eq!(cfg.role, WriteRole::Follower { leader: plan.process(g.leader).name.clone() });
                let client = TqClient::new(cfg, None).unwrap();
                let meta = rlplane::tq::BatchMeta::new("p", vec![]);
                let e = client.write_back(&meta, "old_logprobs", &Column::scalars::<f32>("x", &[])).await.unwrap_err();
                assert!(matches!(e, TqError::FollowerWriteBack { .. }), "{e}");
            }
        }
    }
    assert_eq!(roles.len(), 4);
    // ProducerLocal: every engine's producer hosts its own unit and puts there.
    for u in &plan.storage_units {
        let cfg = ClientConfig::from_plan(&plan, u.process, &auth()).unwrap();
        assert_eq!(cfg.home_unit, Some(u.id));
        let client = TqClient::new(cfg, None).unwrap();
        assert_eq!(client.unit_for_key("any_g0").unwrap(), u.id);
    }
    // Dedicated: keys spread over the storage pods.
    let mut s = spec(1, 2, TqPlacement::Dedicated);
    s.transfer_queue.storage_units = 3;
    let plan = build_plan(&s, &id, &addr).unwrap();
    let client =
        TqClient::new(ClientConfig::from_plan(&plan, plan.generation_ranks()[0], &auth()).unwrap(), None).unwrap();
    let used: BTreeSet<u32> = (0..64).map(|i| client.unit_for_key(&format!("{i}_g0")).unwrap()).collect();
    assert_eq!(used, BTreeSet::from([0, 1, 2]));
}
