//! Leader fetch and fan-out with real processes: the data-parallel leader fetches its shard and
//! every follower receives identical bytes; strangers and clients of another job are refused.

mod tq_support;

use rlplane::bench::tq::PeerProcess;
use serde_json::json;
use tq_support::*;

fn follower(name: &str, token: &str, key_file: &str, leader: &str) -> PeerProcess {
    PeerProcess::spawn(
        exe(),
        name,
        &[
            "follower".into(),
            "--name".into(),
            name.into(),
            "--token".into(),
            token.into(),
            "--key-file".into(),
            key_file.into(),
            "--leader".into(),
            leader.into(),
        ],
    )
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_fans_out_identical_bytes_to_every_follower() {
    let c = Cluster::start(2, 32 << 20, std::time::Duration::from_secs(30), 5_000).await;
    let mut producer = c.client("gen-0", &[]);
    let put = producer.call_ok("put step-0 0 48 1 500 32 9", T).await.unwrap();

    let mut leader = c.client("trainer-0", &[]);
    let lead = leader.call_ok("lead trainer-1,trainer-2,trainer-3", T).await.unwrap();
    let addr = lead["listen"].as_str().unwrap().to_string();
    // A stranger and a rank of another epoch are refused while the leader waits for its members
    // (once every member has joined, the leader stops listening: a latecomer is not told why).
    let mut stranger = follower("trainer-9", TOKEN, key_file(), &addr);
    let mut stale = follower("trainer-1", "e9-0000000000000000", &key_file_of([9; 32]), &addr);
    let s = stranger.recv(T).await.unwrap();
    assert!(s["error"].as_str().unwrap().contains("not a follower"), "{s}");
    let s = stale.recv(T).await.unwrap();
    assert!(s["error"].as_str().unwrap().contains("another job or epoch"), "{s}");
    let mut members: Vec<PeerProcess> =
        ["trainer-1", "trainer-2", "trainer-3"].iter().map(|n| follower(n, TOKEN, key_file(), &addr)).collect();

    leader.call_ok("claim step-0 train 48 48 input_ids", T).await.unwrap();
    let got = leader.call_ok("get input_ids,logprobs,loss_mask,reward", T).await.unwrap();
    assert_eq!(sums(&got), sums(&put), "the leader's fetch matches the producer's bytes");
    let sent = leader.call_ok("fanout", T).await.unwrap();
    assert_eq!(sent["batch"], got["batch"]);
    for m in members.iter_mut() {
        let r = m.recv(T).await.unwrap();
        assert_eq!(r["ok"], json!(true), "{}: {r}", m.name());
        assert_eq!(r["samples"], json!(48));
        assert_eq!(r["batch"], sent["batch"], "{} received other bytes", m.name());
    }
}
