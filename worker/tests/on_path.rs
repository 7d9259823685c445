//! An attacker on the path between two of the job's processes: a relay that passes their
//! handshake through untouched, so that each side proves itself to the other, and then alters or
//! injects bytes. The handshake alone authenticates a connection's start; these attacks land
//! unless every frame after it is authenticated too (docs/architecture.md, threat model). Here
//! each is refused where it arrives, named as a failed tag, and leaves nothing behind: no sample
//! stored, nothing registered, no command obeyed, no weights version published.

use std::sync::Arc;
use std::time::Duration;

use rlplane::control::{Command, ControlClient, ControlServer, Reply};
use rlplane::net::{self, Hello, JobAuth, Session};
use rlplane::refit::memory::HostTensors;
use rlplane::refit::plan::RefitPlan;
use rlplane::refit::stream::{RefitReceiver, RefitSender, StagingPolicy, StreamConfig, WeightsState};
use rlplane::tq::codec::{self, Block, Body, CONTROLLER_MAGIC, ErrorCode, Header, STORAGE_MAGIC, WIRE_VERSION};
use rlplane::tq::{
    BatchMeta, Column, ControllerConfig, DType, FieldSpec, SampleTags, StorageServer, StorageUnit, TqController,
};
use rlplane::transport::tcp::{self, Member, RefitListener, Route, TcpOptions};
use rlplane_api::model::{DType as TensorDType, TensorSpec, TpSplit};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

const TOKEN: &str = "e1-on-path";

fn auth() -> JobAuth {
    JobAuth::new(TOKEN, &[0x5a; 32])
}

fn deadline() -> Instant {
    Instant::now() + Duration::from_secs(20)
}

/// What the relay does to one direction's bytes, at an offset counted from the connection's
/// first byte in that direction.
#[derive(Clone, Debug)]
enum Attack {
    /// Flips one bit of the byte at this offset.
    Flip(u64),
    /// Inserts these bytes before the byte at this offset.
    Inject(u64, Vec<u8>),
}

/// Relays one connection to `target`, passing both directions through byte for byte except for
/// `up` (connecting → accepting side) and `down` (accepting → connecting side). Returns the
/// address to connect to instead of `target`.
async fn on_path(target: String, up: Option<Attack>, down: Option<Attack>) -> String {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        let (client, _) = l.accept().await.unwrap();
        let server = TcpStream::connect(&target).await.unwrap();
        let ((cr, cw), (sr, sw)) = (client.into_split(), server.into_split());
        tokio::join!(relay(cr, sw, up), relay(sr, cw, down));
    });
    addr
}

async fn relay(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    attack: Option<Attack>,
) {
    let mut seen = 0u64;
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let chunk = &mut buf[..n];
        let inside = |at: u64| at >= seen && at < seen + n as u64;
        let sent = match &attack {
            Some(Attack::Flip(at)) if inside(*at) => {
                chunk[(*at - seen) as usize] ^= 0x01;
                to.write_all(chunk).await
            }
            Some(Attack::Inject(at, bytes)) if inside(*at) => {
                let (head, tail) = chunk.split_at((*at - seen) as usize);
                let mut all = head.to_vec();
                all.extend_from_slice(bytes);
                all.extend_from_slice(tail);
                to.write_all(&all).await
            }
            _ => to.write_all(chunk).await,
        };
        if sent.is_err() {
            break;
        }
        seen += n as u64;
    }
    let _ = to.shutdown().await;
}

/// Bytes the connecting side sends in its handshake: the hello frame (with the token and a
/// 32-byte nonce), then the verdict byte and its 32-byte proof.
fn handshake_up(hello: &Hello) -> u64 {
    let hello_len = 6 + 4 + TOKEN.len() + 4 + hello.peer.len() + 4 + hello.extra.len() + 4 + 32;
    (4 + hello_len + 1 + 32) as u64
}

/// Bytes the accepting side sends in its handshake: the challenge byte, its nonce and proof,
/// then the verdict byte.
const HANDSHAKE_DOWN: u64 = 1 + 64 + 1;

fn header(request_id: u32) -> Header {
    Header { version: WIRE_VERSION, request_id, token: TOKEN.into() }
}

/// A put of 3 samples to partition `p`, as the key holder tags it.
fn put(mac: &mut net::FrameMac) -> Vec<u8> {
    let ids = Column::ragged("ids", &[&[1i64, 2][..], &[3][..], &[4, 5, 6][..]]);
    let block = Block { n: 3, columns: vec![(ids.spec().clone(), ids.nbytes() as u64)] };
    let body = Body::Put { partition: "p".into(), keys: vec!["a".into(), "b".into(), "c".into()], block };
    codec::tag_message_bytes(mac, &header(1), &body, &[&codec::encode_offsets(ids.offsets()), ids.values()])
}

async fn storage() -> (Arc<StorageUnit>, String) {
    let unit = Arc::new(StorageUnit::new(0, 1 << 20));
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    tokio::spawn(StorageServer::new(unit.clone(), &auth(), Duration::from_secs(5)).serve(l));
    (unit, addr)
}

async fn connect(addr: &str, hello: &Hello) -> (TcpStream, Session) {
    let mut s = net::connect_retry(addr, deadline(), "test").await.unwrap();
    let session = net::send_hello(&mut s, &auth(), hello, deadline(), addr).await.unwrap();
    (s, session)
}

/// The unit's answer to what was sent: its error (it closes the connection after a frame whose
/// tag failed), or `None` for any other reply.
async fn error_reply(s: &mut TcpStream, session: &mut Session) -> Option<(ErrorCode, String)> {
    let mut buf = Vec::new();
    match codec::read_message(s, &mut session.recv, &mut buf).await.unwrap() {
        (_, Body::Error { code, message }) => Some((code, message)),
        _ => None,
    }
}

#[tokio::test]
async fn rollout_bytes_altered_on_the_way_are_refused_and_nothing_is_stored() {
    let (unit, target) = storage().await;
    let hello = Hello { magic: STORAGE_MAGIC, version: WIRE_VERSION, peer: "gen-0".into(), extra: vec![] };
    let probe = put(&mut Session::fixed_pair(0).0.send);
    // The last value's last byte but four: inside the rollout's token ids, before the tag.
    let at = handshake_up(&hello) + probe.len() as u64 - 20;
    let addr = on_path(target.clone(), Some(Attack::Flip(at)), None).await;
    let (mut s, mut session) = connect(&addr, &hello).await;
    s.write_all(&put(&mut session.send)).await.unwrap();
    let (code, message) = error_reply(&mut s, &mut session).await.expect("the unit refused the altered put");
    assert_eq!(code, ErrorCode::Malformed);
    assert!(message.contains("failed its authentication tag"), "{message}");
    assert_eq!(unit.used(), 0, "nothing of the altered put was stored");
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest).await;
    assert!(rest.is_empty(), "the unit closed the connection after the bad frame");
    // The same put, not altered, is stored.
    let (mut s, mut session) = connect(&target, &hello).await;
    s.write_all(&put(&mut session.send)).await.unwrap();
    assert_eq!(error_reply(&mut s, &mut session).await, None);
    assert!(unit.used() > 0);
}

#[tokio::test]
async fn a_frame_injected_after_a_relayed_handshake_is_refused_and_nothing_is_registered() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let target = l.local_addr().unwrap().to_string();
    let units = [(0, "127.0.0.1:1".to_string())].into();
    let controller = TqController::new(ControllerConfig { auth: auth(), lease: Duration::from_secs(30), units });
    tokio::spawn(controller.clone().serve(l));
    let mut meta = BatchMeta::builder("p", vec![FieldSpec::ragged("ids", DType::I64)]);
    meta.push("forged", 0, 2, &[2], &SampleTags::default()).unwrap();
    // The attacker's registration, well formed, with a tag under a key it made up.
    let forged =
        codec::tag_message_bytes(&mut Session::fixed_pair(7).0.send, &header(1), &Body::Register(meta.finish()), &[]);
    let hello = Hello { magic: CONTROLLER_MAGIC, version: WIRE_VERSION, peer: "gen-0".into(), extra: vec![] };
    let addr = on_path(target, Some(Attack::Inject(handshake_up(&hello), forged)), None).await;
    let (mut s, mut session) = connect(&addr, &hello).await;
    codec::write_message(&mut s, &mut session.send, &header(2), &Body::Ping).await.unwrap();
    let mut buf = Vec::new();
    let reply = codec::read_message(&mut s, &mut session.recv, &mut buf).await;
    match reply {
        Ok((_, Body::Error { code, message })) => {
            assert_eq!(code, ErrorCode::Malformed);
            assert!(message.contains("failed its authentication tag"), "{message}");
        }
        other => panic!("the controller answered an injected frame: {other:?}"),
    }
    assert!(controller.status("p").is_none(), "the injected registration was not applied");
}

#[tokio::test]
async fn a_command_altered_on_the_way_is_refused_by_the_rank() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let target = l.local_addr().unwrap().to_string();
    let names = vec!["gen-0".to_string()];
    let server = tokio::spawn(async move { ControlServer::accept_all(&l, &names, &auth(), deadline(), None).await });
    // Inside the coordinator's first frame to the rank.
    let addr = on_path(target, None, Some(Attack::Flip(HANDSHAKE_DOWN + 8))).await;
    let mut rank = ControlClient::connect(&addr, &auth(), "gen-0", deadline()).await.unwrap();
    let mut server = server.await.unwrap().unwrap();
    rank.reply(&Reply::Ready).await.unwrap();
    server.wait_ready(deadline()).await.unwrap();
    let names = vec!["gen-0".to_string()];
    let command = tokio::spawn(async move {
        server.run(&names, Command::Generate { step: 0, min_version: 0 }, Instant::now() + Duration::from_secs(5)).await
    });
    let e = rank.next().await.expect_err("the rank obeyed an altered command");
    assert!(e.to_string().contains("failed its authentication tag"), "{e}");
    drop(rank);
    assert!(command.await.unwrap().is_err(), "the coordinator saw the rank go, not a step done");
}

fn manifest() -> Vec<TensorSpec> {
    vec![
        TensorSpec::with_split("embed", TensorDType::Bf16, vec![256, 64], TpSplit::Rows),
        TensorSpec::with_split("norm", TensorDType::Bf16, vec![64], TpSplit::Replicated),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weights_altered_on_the_way_fail_the_refit_and_publish_no_version() {
    let m = manifest();
    let plan = Arc::new(RefitPlan::new(&m, 4096, 256).unwrap());
    let id = plan.identity();
    let probe = |process: u32, name: &str| Member {
        process,
        name: name.into(),
        address: String::new(),
        bind_address: "127.0.0.1:0".into(),
    };
    let root_listener = RefitListener::bind(&probe(0, "trainer-0")).await.unwrap();
    let child_listener = RefitListener::bind(&probe(1, "gen-0")).await.unwrap();
    let root_addr = root_listener.local_addr().unwrap().to_string();
    // The refit header and its tag, then 1000 bytes into the first record of weights.
    let relay = on_path(root_addr.clone(), None, Some(Attack::Flip(HANDSHAKE_DOWN + 24 + 16 + 1000))).await;
    let root = Member { address: relay, bind_address: root_addr, ..probe(0, "trainer-0") };
    let child_addr = child_listener.local_addr().unwrap().to_string();
    let child = Member { address: child_addr.clone(), bind_address: child_addr, ..probe(1, "gen-0") };
    let route = Route::new(root, vec![child], 1).unwrap();
    let (options, a, streams) = (TcpOptions::default(), auth(), [(route.clone(), id)]);
    let (sender, mut receivers) = tokio::try_join!(
        tcp::connect_root(&root_listener, &route, id, &a, &options, deadline()),
        tcp::connect_receiver(&child_listener, 1, &streams, &a, &options, deadline()),
    )
    .unwrap();
    let config = StreamConfig { num_buffers: 2, timeout: Duration::from_secs(10), staging: StagingPolicy::WhenNeeded };
    let mut sender = RefitSender::new(plan.clone(), sender, config).unwrap();
    let mut receiver = RefitReceiver::new(vec![(plan.clone(), receivers.remove(0))], config).unwrap();
    let src = HostTensors::from_vecs(
        plan.tensors().iter().map(|t| vec![0x11; t.source_bytes.unwrap_or(0) as usize]).collect(),
    );
    let mut dst = HostTensors::zeroed(m.iter().map(TensorSpec::size_bytes));
    let (sent, received) = tokio::join!(sender.send(1, &src), receiver.receive(&mut dst));
    let e = received.expect_err("the receiver took altered weights").to_string();
    assert!(e.contains("failed its authentication tag"), "{e}");
    assert!(sent.is_err(), "the sender saw its receiver refuse the stream");
    assert_ne!(receiver.state(), WeightsState::Complete(1), "no version was published over altered bytes");
}
