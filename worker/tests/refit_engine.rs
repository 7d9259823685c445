//! The refit engine and TCP transport in one process (real sockets on loopback): deadlines name
//! the peer, bucket and phase; dropping a refit aborts its transport; empty streams; memory
//! checks.

use std::sync::Arc;
use std::time::Duration;

use rlplane::net::JobAuth;
use rlplane::refit::memory::HostTensors;
use rlplane::refit::plan::{RefitPlan, ShardCoords};
use rlplane::refit::stream::{RefitError, RefitReceiver, RefitSender, StagingPolicy, StreamConfig, WeightsState};
use rlplane::transport::tcp::{self, Member, RefitListener, Route, TcpOptions, TcpTransport};
use rlplane::transport::{Piece, Transport, TransportError};
use rlplane_api::model::{DType, TensorSpec, TpSplit};
use tokio::time::Instant;

const TOKEN: &str = "e0-test";

fn manifest() -> Vec<TensorSpec> {
    vec![
        TensorSpec::with_split("embed", DType::Bf16, vec![256, 64], TpSplit::Rows),
        TensorSpec::with_split("o_proj", DType::Bf16, vec![64, 64], TpSplit::Columns),
        TensorSpec::with_split("norm", DType::Bf16, vec![64], TpSplit::Replicated),
    ]
}

fn config(timeout: Duration) -> StreamConfig {
    StreamConfig { num_buffers: 2, timeout, staging: StagingPolicy::WhenNeeded }
}

/// Binds a listener on an ephemeral port and returns it with the member that owns it.
async fn member(process: u32, name: &str) -> (Member, RefitListener) {
    let probe = Member { process, name: name.into(), address: String::new(), bind_address: "127.0.0.1:0".into() };
    let listener = RefitListener::bind(&probe).await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    (Member { address: addr.clone(), bind_address: addr, ..probe }, listener)
}

/// Connects a sender and `receivers` receivers of one stream (chain).
async fn connect(plan: &RefitPlan, receivers: u32) -> (TcpTransport, Vec<TcpTransport>) {
    let (root, root_listener) = member(0, "sender").await;
    let mut members = Vec::new();
    let mut listeners = Vec::new();
    for i in 0..receivers {
        let (m, l) = member(i + 1, &format!("gen-{i}")).await;
        members.push(m);
        listeners.push(l);
    }
    let route = Route::new(root, members.clone(), 1).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let options = &TcpOptions::default();
    let id = plan.identity();
    let auth = &JobAuth::new(TOKEN, &[0x42; 32]);
    let root_fut = tcp::connect_root(&root_listener, &route, id, auth, options, deadline);
    let receiver_futs = futures::future::try_join_all(members.iter().zip(&listeners).map(|(m, l)| {
        let route = route.clone();
        async move {
            let mut v = tcp::connect_receiver(l, m.process, &[(route, id)], auth, options, deadline).await?;
            Ok::<_, TransportError>(v.remove(0))
        }
    }));
    let (root, receivers) = tokio::try_join!(root_fut, receiver_futs).unwrap();
    (root, receivers)
}

fn source_for(plan: &RefitPlan, fill: u8) -> HostTensors {
    HostTensors::from_vecs(plan.tensors().iter().map(|t| vec![fill; t.source_bytes.unwrap_or(0) as usize]).collect())
}

fn destination(m: &[TensorSpec]) -> HostTensors {
    HostTensors::zeroed(m.iter().map(TensorSpec::size_bytes))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refits_reuse_the_connections() {
    let m = manifest();
    let plan = Arc::new(RefitPlan::new(&m, 4096, 256).unwrap());
    let (root, receivers) = connect(&plan, 2).await;
    let mut sender = RefitSender::new(plan.clone(), root, config(Duration::from_secs(10))).unwrap();
    let mut rx: Vec<_> = receivers
        .into_iter()
        .map(|t| RefitReceiver::new(vec![(plan.clone(), t)], config(Duration::from_secs(10))).unwrap())
        .collect();
    for version in 1..=3u64 {
        let src = source_for(&plan, version as u8);
        let mut dests: Vec<_> = rx.iter().map(|_| destination(&m)).collect();
        let recvs = futures::future::try_join_all(rx.iter_mut().zip(dests.iter_mut()).map(|(r, d)| r.receive(d)));
        let (stats, got) = tokio::try_join!(sender.send(version, &src), recvs).unwrap();
        assert_eq!(stats.bytes, plan.stream_bytes());
        assert!(stats.buckets > 2);
        for (r, (s, d)) in rx.iter().zip(got.iter().zip(&dests)) {
            assert_eq!(r.state(), WeightsState::Complete(version));
            assert_eq!(s.version, version);
            for i in 0..m.len() {
                assert!(d.tensor(i).iter().all(|&b| b == version as u8), "tensor {i} of version {version}");
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_sender_times_out_naming_the_peer_the_bucket_and_the_phase() {
    let m = manifest();
    let plan = Arc::new(RefitPlan::new(&m, 4096, 256).unwrap());
    let (mut root, receivers) = connect(&plan, 1).await;
    let mut receiver =
        RefitReceiver::new(vec![(plan.clone(), receivers.into_iter().next().unwrap())], config(Duration::from_secs(1)))
            .unwrap();
    let mut dest = destination(&m);
    // Drive the root by hand: the header and bucket 0, then nothing.
    let src = source_for(&plan, 7);
    let mut regions = Vec::new();
    for s in plan.bucket_segments(0) {
        let r = rlplane::refit::memory::SourceMemory::source_region(&src, s.tensor as usize).unwrap();
        regions.push(Piece { segment: 0, region: r.sub(s.src_offset, s.bytes()) });
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    let receive = receiver.receive(&mut dest);
    let drive = async {
        root.begin(Some(9), deadline).await.unwrap();
        // SAFETY: `src` outlives the ticket, which is waited on below.
        let t = unsafe { root.submit(0, &regions) }.unwrap();
        root.wait(t, deadline).await.unwrap();
    };
    let start = Instant::now();
    let (err, ()) = tokio::join!(receive, drive);
    let err = err.unwrap_err();
    let secs = start.elapsed().as_secs_f64();
    assert!((0.9..5.0).contains(&secs), "gave up after {secs:.2}s with a 1s deadline");
    let msg = err.to_string();
    assert!(matches!(&err, RefitError::Stream { bucket: Some(1), .. }), "{msg}");
    assert!(msg.contains("transfer") && msg.contains("bucket 1") && msg.contains("timed out"), "{msg}");
    assert!(msg.contains("peer sender") && msg.contains("version 9"), "{msg}");
    assert_eq!(receiver.state(), WeightsState::Incomplete(9));
    drop(root);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_refit_aborts_its_transport_and_the_next_one_says_reconnect() {
    let m = manifest();
    let plan = Arc::new(RefitPlan::new(&m, 4096, 256).unwrap());
    let (root, receivers) = connect(&plan, 1).await;
    let mut receiver = RefitReceiver::new(
        vec![(plan.clone(), receivers.into_iter().next().unwrap())],
        config(Duration::from_secs(30)),
    )
    .unwrap();
    let mut dest = destination(&m);
    // Nobody sends: cancel the receive from outside after 200 ms.
    let cancelled = tokio::time::timeout(Duration::from_millis(200), receiver.receive(&mut dest)).await;
    assert!(cancelled.is_err(), "the receive is still waiting for the header");
    // The dropped refit aborted the transport: the sender sees the connection go.
    let mut sender = RefitSender::new(plan.clone(), root, config(Duration::from_secs(5))).unwrap();
    let err = sender.send(1, &source_for(&plan, 1)).await.unwrap_err();
    assert!(err.to_string().contains("closed the connection"), "{err}");
    let err = receiver.receive(&mut dest).await.unwrap_err();
    assert!(err.to_string().contains("reconnect"), "{err}");
    assert!(dest.tensor(0).iter().all(|&b| b == 0), "nothing was written");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sender_with_nothing_to_send_still_completes_the_refit() {
    // Only a replicated tensor: tensor-parallel rank 1 sends nothing but still takes part.
    let m = vec![TensorSpec::with_split("norm", DType::F32, vec![64], TpSplit::Replicated)];
    let plan = Arc::new(RefitPlan::sharded(&m, 4096, 64, ShardCoords::tensor_parallel(1, 2, 0, 1)).unwrap());
    assert_eq!(plan.buckets().len(), 0);
    let (root, receivers) = connect(&plan, 2).await;
    let mut sender = RefitSender::new(plan.clone(), root, config(Duration::from_secs(5))).unwrap();
    let mut rx: Vec<_> = receivers
        .into_iter()
        .map(|t| RefitReceiver::new(vec![(plan.clone(), t)], config(Duration::from_secs(5))).unwrap())
        .collect();
    let mut dests: Vec<_> = rx.iter().map(|_| destination(&m)).collect();
    let recvs = futures::future::try_join_all(rx.iter_mut().zip(dests.iter_mut()).map(|(r, d)| r.receive(d)));
    let src = source_for(&plan, 0);
    let (stats, _) = tokio::try_join!(sender.send(4, &src), recvs).unwrap();
    assert_eq!(stats.bytes, 0);
    assert!(rx.iter().all(|r| r.state() == WeightsState::Complete(4)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_that_does_not_match_the_plan_is_refused_naming_the_tensor() {
    let m = manifest();
    let plan = Arc::new(RefitPlan::new(&m, 4096, 256).unwrap());
    let (root, receivers) = connect(&plan, 1).await;
    let mut sender = RefitSender::new(plan.clone(), root, config(Duration::from_secs(5))).unwrap();
    let short = source_for(&plan, 1);
    let mut bad: Vec<Vec<u8>> = (0..m.len()).map(|i| short.tensor(i).to_vec()).collect();
    bad[1].pop();
    let err = sender.send(1, &HostTensors::from_vecs(bad)).await.unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("o_proj") && msg.contains("8191") && msg.contains("8192"), "{msg}");
    let mut receiver =
        RefitReceiver::new(vec![(plan.clone(), receivers.into_iter().next().unwrap())], config(Duration::from_secs(5)))
            .unwrap();
    let mut wrong = HostTensors::zeroed([1, 2]);
    let err = receiver.receive(&mut wrong).await.unwrap_err();
    assert!(err.to_string().contains("2 tensors where the manifest has 3"), "{err}");
    assert_eq!(receiver.state(), WeightsState::Empty);
}
