//! Multi-process refit over TCP on loopback: real `rlplane peer refit` processes, random data,
//! per-tensor checksums; plan mismatches, a sender killed mid-refit, a slow receiver.

use std::time::Duration;

use rlplane::bench::refit::{Harness, HarnessOptions, Round, StagingArg};
use rlplane::refit::WeightsState;
use rlplane::transport::tcp::TcpOptions;
use rlplane_api::model::{DType, ModelPreset, TensorSpec, TpSplit};
use rlplane_api::spec::{ModelSpec, RefitSource};

const EXE: &str = env!("CARGO_BIN_EXE_rlplane");

fn tiny() -> HarnessOptions {
    let mut o = HarnessOptions::new(EXE, ModelSpec::preset(ModelPreset::Tiny));
    o.bucket_bytes = 64 << 10;
    o.timeout_seconds = 30;
    o
}

fn assert_round(round: &Round, version: u64, receivers: usize) {
    assert!(round.all_ok(), "refit {version} failed: {}", round.describe_failures());
    assert_eq!(round.receivers.len(), receivers);
    for r in &round.receivers {
        assert_eq!(r.state, Some(WeightsState::Complete(version)), "{}", r.process);
        assert_eq!(r.version, Some(version));
        assert_eq!(r.checksum_ok, Some(true), "{}: {:?}", r.process, r.mismatched);
    }
}

/// Runs two refits (different random data each) and checks every receiver's every tensor;
/// returns the last round.
async fn two_refits(o: HarnessOptions) -> Round {
    let receivers = o.receivers as usize;
    let mut h = Harness::start(o).await.expect("peers connect");
    let first = h.refit(1).await.expect("refit 1");
    assert_round(&first, 1, receivers);
    let second = h.refit(2).await.expect("refit 2");
    assert_round(&second, 2, receivers);
    h.quit().await.unwrap();
    second
}

fn staged_bytes(round: &Round) -> u64 {
    round.receivers.iter().map(|r| r.stats.as_ref().unwrap().staged_bytes).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_buffer_gathered_always_staged() {
    for receivers in [1, 3] {
        let mut o = tiny();
        o.buffers = 1;
        o.receivers = receivers;
        o.staging = StagingArg::Always;
        let round = two_refits(o).await;
        let s = round.senders[0].stats.as_ref().unwrap();
        assert!(s.buckets > 4, "enough buckets to rotate the buffer: {}", s.buckets);
        assert_eq!(s.direct_bytes, 0);
        assert_eq!(s.staged_bytes, s.bytes);
        assert_eq!(staged_bytes(&round), receivers as u64 * s.bytes);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_buffers_sharded_tp2_pp2_stages_only_strided_destinations() {
    for receivers in [1, 3] {
        let mut o = tiny();
        o.buffers = 2;
        o.receivers = receivers;
        o.source = RefitSource::Sharded;
        o.tp = 2;
        o.pp = 2;
        let round = two_refits(o).await;
        assert_eq!(round.senders.len(), 4);
        for r in &round.receivers {
            let s = r.stats.as_ref().unwrap();
            assert_eq!(s.streams, 4);
            // Column shards (o_proj, down_proj) are strided in the destination: staged; the rest
            // is received straight into the tensors.
            assert!(s.staged_bytes > 0 && s.direct_bytes > 0, "{}: {s:?}", r.process);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_buffers_sharded_tp2_with_a_tree_relay_and_small_chunks() {
    for receivers in [1, 3] {
        let mut o = tiny();
        o.buffers = 4;
        o.receivers = receivers;
        o.source = RefitSource::Sharded;
        o.tp = 2;
        o.staging = StagingArg::Always;
        o.tcp = TcpOptions { relay_chunk_bytes: 10_000, fanout: 2 };
        o.bucket_bytes = 16 << 10;
        let round = two_refits(o).await;
        assert!(round.senders[0].stats.as_ref().unwrap().buckets > 8);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buckets_without_staging_all_in_flight_beside_staged_ones_through_few_buffers() {
    // What the GPU transports do (`Transport::pipelines_direct`): buckets moved in place are not
    // held to the window, the staged ones (strided column shards) still rotate through one or two
    // buffers. Small buckets so that both kinds interleave many times, several refits so that a
    // reused buffer overwritten too early would corrupt a checksum.
    for (buffers, receivers, bucket_kib) in [(1, 1, 16), (2, 1, 8), (2, 3, 12), (2, 1, 24), (3, 1, 12)] {
        let mut o = tiny();
        o.buffers = buffers;
        o.receivers = receivers;
        o.source = RefitSource::Sharded;
        o.tp = 2;
        o.bucket_bytes = bucket_kib << 10;
        o.extra_flags.insert("*".into(), vec!["--pipeline-direct".into()]);
        let mut h = Harness::start(o).await.expect("peers connect");
        for version in 1..=3 {
            let round = h.refit(version).await.expect("refit");
            assert_round(&round, version, receivers as usize);
            for r in &round.receivers {
                let s = r.stats.as_ref().unwrap();
                assert!(s.staged_bytes > 0 && s.direct_bytes > 0, "{}: {s:?}", r.process);
                assert!(s.buckets > 8, "{s:?}");
            }
        }
        h.quit().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plan_mismatch_fails_both_sides_with_both_plans() {
    let mut o = tiny();
    o.receivers = 1;
    o.extra_flags.insert("gen-0".into(), vec!["--skew-bucket-bytes".into(), "131072".into()]);
    let mut h = Harness::spawn(o).await.unwrap();
    let events = h.first_events().await.unwrap();
    assert_eq!(events.len(), 2);
    for e in &events {
        assert_eq!(e.event, "error", "{e:?}");
        let msg = e.error.as_deref().unwrap();
        assert!(msg.contains("refit plan mismatch"), "{}: {msg}", e.process);
        // Both sides' manifest length, bucket size and alignment.
        assert_eq!(msg.matches("manifest of 21 tensors").count(), 2, "{msg}");
        assert!(msg.contains("bucket 65536 bytes") && msg.contains("bucket 131072 bytes"), "{msg}");
        assert_eq!(msg.matches("alignment 256 bytes").count(), 2, "{msg}");
        assert!(msg.contains("trainer-0") && msg.contains("gen-0"), "{msg}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sender_killed_mid_refit_fails_every_receiver_promptly_and_the_next_refit_starts_over() {
    let mut o = tiny();
    o.receivers = 3;
    o.bucket_bytes = 16 << 10;
    let mut h = Harness::start(o).await.unwrap();
    assert_round(&h.refit(1).await.unwrap(), 1, 3);

    // Refit 2 with a sender that takes ~40 ms per bucket (80+ buckets); kill it part-way.
    h.command("trainer-0", "slow 40").await.unwrap();
    h.start_refit(2).await.unwrap();
    tokio::time::sleep(Duration::from_millis(700)).await;
    h.kill("trainer-0").await.unwrap();
    for name in h.receivers().to_vec() {
        let e = h.next_event(&name).await.unwrap();
        assert!(!e.ok, "{name} must fail: {e:?}");
        assert_eq!(e.state, Some(WeightsState::Incomplete(2)), "{name}: {e:?}");
        let msg = e.error.unwrap();
        assert!(msg.contains("closed the connection") && msg.contains("bucket"), "{name}: {msg}");
        let secs = e.secs.unwrap();
        assert!(secs < 10.0, "{name} noticed the dead sender after {secs:.1}s (timeout 30s): by reset, not timeout");
    }

    // A new sender: every receiver reconnects and the next refit starts over from bucket 0.
    h.respawn("trainer-0").await.unwrap();
    for name in h.receivers().to_vec() {
        h.command(&name, "refit 3").await.unwrap();
    }
    let ready = h.next_event("trainer-0").await.unwrap();
    assert_eq!(ready.event, "ready", "{ready:?}");
    h.command("trainer-0", "refit 3").await.unwrap();
    let round = h.finish_refit().await.unwrap();
    assert_round(&round, 3, 3);
    h.quit().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_relay_receiver_throttles_the_stream_without_deadlock_or_corruption() {
    // 32 MiB, more than the loopback socket buffers can hold, so the sender really waits.
    let tensors =
        (0..8).map(|i| TensorSpec::with_split(format!("w{i}"), DType::Bf16, vec![1024, 2048], TpSplit::Rows)).collect();
    let mut o = HarnessOptions::new(EXE, ModelSpec::tensors(tensors));
    o.receivers = 3;
    o.bucket_bytes = 512 << 10;
    o.timeout_seconds = 30;
    // gen-0 relays to gen-1 and gen-2: all of them receive through the slow one.
    o.extra_flags.insert("gen-0".into(), vec!["--slow-ms".into(), "30".into()]);
    let mut h = Harness::start(o).await.unwrap();
    let round = h.refit(1).await.unwrap();
    assert_round(&round, 1, 3);
    let s = round.senders[0].stats.as_ref().unwrap();
    assert_eq!(s.buckets, 64);
    // 64 buckets × 30 ms at gen-0: the sender's call covers it, and its transfer phase was
    // held back by the slow receiver (backpressure through the relay), not only its final wait.
    assert!(s.total_secs > 64.0 * 0.030 * 0.9, "{s:?}");
    assert!(s.transfer_secs > 0.4, "{s:?}");
    h.quit().await.unwrap();
}
