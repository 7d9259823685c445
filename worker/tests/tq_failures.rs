//! Failures with real processes: a consumer killed after claiming, a storage unit that dies, a
//! full storage unit (backpressure, timeout, too large).

mod tq_support;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use serde_json::json;
use tq_support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_consumers_samples_are_claimed_again_after_the_lease() {
    // A lease long enough that a loaded CI machine still claims the rest before it runs out.
    let lease = Duration::from_secs(2);
    let c = Cluster::start(1, 16 << 20, lease, 5_000).await;
    let mut producer = c.client("gen-0", &[]);
    let put = producer.call_ok("put step-0 0 64 8 64 8 1", T).await.unwrap();
    let expected = sums(&put);

    let mut doomed = c.client("trainer-0", &[]);
    let lost = keys(&doomed.call_ok("claim step-0 train 40 0 input_ids", T).await.unwrap());
    assert_eq!(lost.len(), 40);
    doomed.kill().await;
    let claimed_at = Instant::now();

    let mut b = c.client("trainer-1", &[]);
    let rest = keys(&b.call_ok("claim step-0 train 1000 0 input_ids", T).await.unwrap());
    assert_eq!(rest.len(), 24, "only the unclaimed samples, while the dead consumer's lease runs");
    b.call_ok("ack", T).await.unwrap();
    assert!(keys(&b.call_ok("claim step-0 train 1000 0 input_ids", T).await.unwrap()).is_empty());

    assert!(claimed_at.elapsed() < lease, "the test itself ran past the lease");
    tokio::time::sleep((lease + Duration::from_millis(100)).saturating_sub(claimed_at.elapsed())).await;
    let again = keys(&b.call_ok("claim step-0 train 1000 0 input_ids", T).await.unwrap());
    assert_eq!(again.iter().collect::<BTreeSet<_>>(), lost.iter().collect::<BTreeSet<_>>(), "none lost");
    let got = sums(&b.call_ok("get input_ids,logprobs,loss_mask,reward", T).await.unwrap());
    for (k, s) in &got {
        assert_eq!(Some(s), expected.get(k), "sample {k}");
    }
    assert_eq!(b.call_ok("ack", T).await.unwrap()["acked"], json!(40));
    let st = c.controller.status("step-0").unwrap();
    assert_eq!(st.groups[0].acked, 64);
    assert!(keys(&b.call_ok("claim step-0 train 1000 0 input_ids", T).await.unwrap()).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_storage_unit_is_named_and_loses_its_partition() {
    let mut c = Cluster::start(2, 16 << 20, Duration::from_secs(30), 5_000).await;
    let mut producer = c.client("gen-0", &[]);
    producer.call_ok("put step-0 0 64 8 64 8 1", T).await.unwrap();
    producer.call_ok("put step-1 0 64 8 64 8 2", T).await.unwrap();
    let mut a = c.client("trainer-0", &[]);
    a.call_ok("claim step-0 train 64 0 input_ids", T).await.unwrap();
    // Warm the connections, then kill unit 1.
    a.call_ok("get input_ids", T).await.unwrap();
    c.storage[1].kill().await;

    let v = a.call("get input_ids,logprobs", T).await.unwrap();
    assert_eq!(v["kind"], json!("StorageUnitLost"), "{v}");
    let msg = v["error"].as_str().unwrap();
    assert!(msg.contains("storage unit 1") && msg.contains(&c.units[&1]) && msg.contains("step-0"), "{msg}");
    // The consumer told the controller: both steps on unit 1 are lost, and say why.
    for part in ["step-0", "step-1"] {
        let st = c.controller.status(part).unwrap();
        assert_eq!(st.lost.as_ref().map(|l| l.0), Some(1), "{part}: {st:?}");
    }
    let v = a.call("claim step-1 train 64 0 input_ids", T).await.unwrap();
    assert_eq!(v["code"], json!("PartitionLost"), "{v}");
    assert!(v["error"].as_str().unwrap().contains("storage unit 1"), "{v}");
    // A put that lands on the dead unit fails naming it; the healthy unit still serves.
    let v = producer.call("put step-2 0 32 8 64 8 3", T).await.unwrap();
    assert_eq!(v["ok"], json!(false), "{v}");
    assert!(v["error"].as_str().unwrap().contains("unit 1"), "{v}");
    // Clearing the lost step frees the surviving unit and reports nothing unreachable (the lost
    // unit is known dead).
    let cleared = c.controller.clear("step-0").await;
    assert_eq!(cleared.units, 1);
    assert!(cleared.unreachable.is_empty(), "{cleared:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controller_notices_a_dead_unit_without_any_consumer() {
    let mut c = Cluster::start(2, 16 << 20, Duration::from_secs(30), 5_000).await;
    c.controller.watch_units(Duration::from_millis(100));
    let mut producer = c.client("gen-0", &[]);
    producer.call_ok("put step-0 0 32 8 64 8 1", T).await.unwrap();
    // Let the watchers connect before the kill (a unit never reached is retried, not lost).
    let t = Instant::now();
    while c.controller.watched_units() != vec![0, 1] {
        assert!(t.elapsed() < Duration::from_secs(10), "the watchers never connected");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    c.storage[0].kill().await;
    let t = Instant::now();
    loop {
        if let Some((unit, reason)) = c.controller.status("step-0").unwrap().lost {
            assert_eq!(unit, 0);
            assert!(reason.contains(&c.units[&0]), "{reason}");
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(5), "the watcher never marked the partition lost");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_unit_pushes_back_then_times_out_and_never_drops_data() {
    // 300 samples of 200 tokens = 300 × (1600 + 400 + 200 + 4) = 661,200 bytes; two do not fit.
    let mut c = Cluster::start(1, 1_000_000, Duration::from_secs(30), 1_500).await;
    let mut producer = c.client("gen-0", &["--put-timeout-ms", "1500"]);
    let first = producer.call_ok("put step-0 0 300 100 100 100 1", T).await.unwrap();
    assert_eq!(first["bytes"], json!(661_200));
    // The second put waits for room; a clear of step-0 lets it through.
    let t = Instant::now();
    producer.send("put step-1 0 300 100 100 100 2").await.unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    let cleared = c.controller.clear("step-0").await;
    assert_eq!(cleared.freed, 661_200);
    let second = producer.recv(T).await.unwrap();
    assert_eq!(second["ok"], json!(true), "{second}");
    assert!(t.elapsed() >= Duration::from_millis(400), "the put waited for the clear");
    // A third put with no clear fails after the put timeout, naming the unit and the fix.
    let t = Instant::now();
    let third = producer.call("put step-2 0 300 100 100 100 3", T).await.unwrap();
    assert_eq!(third["code"], json!("CapacityTimeout"), "{third}");
    let msg = third["error"].as_str().unwrap();
    assert!(msg.contains("storage unit 0") && msg.contains("capacityBytes"), "{msg}");
    assert!(t.elapsed() >= Duration::from_millis(1400), "{:?}", t.elapsed());
    // Larger than the whole unit: refused at once.
    let t = Instant::now();
    let huge = producer.call("put step-3 0 500 100 100 100 4", T).await.unwrap();
    assert_eq!(huge["code"], json!("TooLarge"), "{huge}");
    assert!(t.elapsed() < Duration::from_millis(1000));
    // Nothing dropped: step-1 is intact and the unit holds exactly it.
    assert_eq!(c.storage[0].call_ok("stats", T).await.unwrap()["used"], json!(661_200));
    let mut r = c.client("trainer-0", &[]);
    let claimed = keys(&r.call_ok("claim step-1 train 1000 0 -", T).await.unwrap());
    assert_eq!(claimed.len(), 300);
    let got = sums(&r.call_ok("get input_ids,logprobs,loss_mask,reward", T).await.unwrap());
    assert_eq!(got, sums(&second));
    assert!(c.controller.status("step-2").is_none(), "a failed put registers nothing");
}
