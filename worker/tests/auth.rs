//! Only holders of the job epoch's key get past a handshake, on every kind of TCP port: control,
//! transfer-queue controller and storage unit, fan-out, TCP refit and the NCCL rendezvous (the
//! CUDA IPC control channel's ZMQ handshake is tested in `transport::cuda_ipc`). Real servers on
//! real loopback sockets face four attackers, each refused with a reason, counted, and leaving
//! nothing behind:
//!
//! - a process with the epoch's token but not its key (it forges its proof with another key and
//!   does not check the listener's);
//! - a rank of the previous epoch, with that epoch's token and key;
//! - a process with the current token and the previous epoch's key;
//! - a replay of a recorded, valid handshake of the current epoch.
//!
//! Then the rightful peer joins, in the slot the attackers tried to take.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use rlplane::control::{self, Command, ControlClient, ControlServer, Reply};
use rlplane::net::{
    self, CHALLENGE_LEN, FrameMac, HELLO_CHALLENGE, HELLO_OK, HELLO_REFUSED, Hello, JobAuth, NONCE_LEN,
};
use rlplane::refit::plan::RefitPlan;
use rlplane::tq::codec::{
    self, Block, Body, CONTROLLER_MAGIC, FANOUT_MAGIC, Header, STORAGE_MAGIC, WIRE_VERSION, encode_message_bytes,
};
use rlplane::tq::fanout::{TcpFanoutFollower, TcpFanoutLeader};
use rlplane::tq::{
    BatchMeta, Column, ControllerConfig, DType, FieldSpec, SampleTags, StorageServer, StorageUnit, TqController,
};
use rlplane::transport::nccl::{self, UNIQUE_ID_LEN};
use rlplane::transport::tcp::{self, Member, RefitListener, Route, TcpOptions};
use rlplane_api::job_token;
use rlplane_api::model::{DType as TensorDType, TensorSpec, TpSplit};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

/// The connecting side's proof label, as `docs/transfer-queue.md` documents it.
const CLIENT_LABEL: &[u8] = b"rlplane handshake v1: connecting side\0";

/// The job at epoch 1, and what its previous epoch had.
struct Epochs {
    current: JobAuth,
    current_key: [u8; 32],
    old_token: String,
    old_key: [u8; 32],
}

fn epochs() -> Epochs {
    let current_key = JobAuth::generate_key().unwrap();
    Epochs {
        current: JobAuth::new(&job_token("uid-1", 1), &current_key),
        current_key,
        old_token: job_token("uid-1", 0),
        old_key: JobAuth::generate_key().unwrap(),
    }
}

fn deadline() -> Instant {
    Instant::now() + Duration::from_secs(20)
}

/// HMAC-SHA256 under `key` of what the connecting side proves: what a process without the
/// epoch's key can at best compute.
fn proof_under(key: &[u8; 32], hello: &[u8], server_nonce: &[u8]) -> Vec<u8> {
    let k = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, key);
    let mut ctx = ring::hmac::Context::with_key(&k);
    ctx.update(CLIENT_LABEL);
    ctx.update(&(hello.len() as u32).to_le_bytes());
    ctx.update(hello);
    ctx.update(server_nonce);
    ctx.sign().as_ref().to_vec()
}

/// Reads a refusal (HELLO_REFUSED, then the reason frame) and checks that the listener closed
/// the connection after it; returns the reason.
async fn refusal(s: &mut TcpStream, verdict: u8) -> String {
    assert_eq!(verdict, HELLO_REFUSED, "the attacker was not refused");
    let mut reason = Vec::new();
    net::read_frame(s, &mut reason, 1 << 16).await.unwrap();
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest).await;
    assert!(rest.is_empty(), "the listener sent more after refusing: {rest:?}");
    String::from_utf8(reason).unwrap()
}

/// An attacker that presents `token`, does not check the listener's proof and answers the
/// challenge with a proof under `key`; then, refused, it still sends `payload` on the connection.
/// Returns the refusal's reason.
async fn forge(addr: &str, token: &str, key: &[u8; 32], hello: &Hello, payload: &[u8]) -> String {
    let ours = JobAuth::new(token, key).client_hello(hello).unwrap();
    let mut s = TcpStream::connect(addr).await.unwrap();
    net::write_frame(&mut s, ours.bytes()).await.unwrap();
    let mut b = [0u8; 1];
    s.read_exact(&mut b).await.unwrap();
    if b[0] == HELLO_CHALLENGE {
        let mut challenge = [0u8; CHALLENGE_LEN];
        s.read_exact(&mut challenge).await.unwrap();
        let mut answer = vec![HELLO_OK];
        answer.extend(proof_under(key, ours.bytes(), &challenge[..NONCE_LEN]));
        s.write_all(&answer).await.unwrap();
        s.read_exact(&mut b).await.unwrap();
    }
    let reason = refusal(&mut s, b[0]).await;
    let _ = s.write_all(payload).await;
    reason
}

/// What an eavesdropper records of a valid handshake of `auth` (the hello frame, then the
/// verdict byte and proof), made against a listener of the same epoch.
fn record(auth: &JobAuth, hello: &Hello) -> Vec<u8> {
    let ours = auth.client_hello(hello).unwrap();
    let (_, challenge) = auth.open_hello(ours.bytes(), hello.magic, hello.version).unwrap();
    let (proof, _) = ours.answer(auth, challenge.bytes()).unwrap();
    challenge.verify(auth, &proof).expect("the recorded handshake is valid");
    let mut wire = (ours.bytes().len() as u32).to_le_bytes().to_vec();
    wire.extend_from_slice(ours.bytes());
    wire.push(HELLO_OK);
    wire.extend(proof);
    wire
}

/// Replays `recorded` at once, then `payload`; returns the refusal's reason.
async fn replay(addr: &str, recorded: &[u8], payload: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(recorded).await.unwrap();
    let mut b = [0u8; 1];
    s.read_exact(&mut b).await.unwrap();
    assert_eq!(b[0], HELLO_CHALLENGE, "the replayed hello's identifiers are right: it is challenged");
    let mut challenge = [0u8; CHALLENGE_LEN];
    s.read_exact(&mut challenge).await.unwrap();
    s.read_exact(&mut b).await.unwrap();
    let reason = refusal(&mut s, b[0]).await;
    let _ = s.write_all(payload).await;
    reason
}

/// The four attacks on the listener at `addr`, each sending `payload` after its refusal; checks
/// every reason and that the listener counted each (on `protocol`).
async fn attack(addr: &str, e: &Epochs, hello: &Hello, payload: &[u8]) {
    let token = e.current.token().to_string();
    let before = e.current.refusals().total();
    let keyless = forge(addr, &token, &JobAuth::generate_key().unwrap(), hello, payload).await;
    assert!(keyless.contains("did not prove it holds this job epoch's key"), "{keyless}");
    let old_epoch = forge(addr, &e.old_token, &e.old_key, hello, payload).await;
    assert!(old_epoch.contains("another job or epoch"), "{old_epoch}");
    let old_key = forge(addr, &token, &e.old_key, hello, payload).await;
    assert!(old_key.contains("did not prove it holds this job epoch's key"), "{old_key}");
    let replayed = replay(addr, &record(&e.current, hello), payload).await;
    assert!(replayed.contains("replayed handshake"), "{replayed}");
    let protocol = String::from_utf8_lossy(&hello.magic).into_owned();
    assert_eq!(e.current.refusals().total(), before + 4);
    assert!(e.current.refusals().snapshot().contains(&(protocol, before + 4)));
}

fn header(token: &str) -> Header {
    Header { version: WIRE_VERSION, request_id: 1, token: token.into() }
}

/// A valid put of 3 samples to partition `p`, tagged for a connection's next frames (`mac`), or
/// untagged for an attacker who has none.
fn put_message(token: &str, mac: Option<&mut FrameMac>) -> Vec<u8> {
    let ids = Column::ragged("ids", &[&[1i64, 2][..], &[3][..], &[4, 5, 6][..]]);
    let block = Block { n: 3, columns: vec![(ids.spec().clone(), ids.nbytes() as u64)] };
    let body = Body::Put { partition: "p".into(), keys: vec!["a".into(), "b".into(), "c".into()], block };
    let off = codec::encode_offsets(ids.offsets());
    match mac {
        Some(mac) => codec::tag_message_bytes(mac, &header(token), &body, &[&off, ids.values()]),
        None => encode_message_bytes(&header(token), &body, &[&off, ids.values()]),
    }
}

/// A valid registration of one sample of partition `p`, tagged as [`put_message`].
fn register_message(token: &str, mac: Option<&mut FrameMac>) -> Vec<u8> {
    let mut meta = BatchMeta::builder("p", vec![FieldSpec::ragged("ids", DType::I64)]);
    meta.push("a", 0, 2, &[2], &SampleTags::default()).unwrap();
    let meta = meta.finish();
    match mac {
        Some(mac) => codec::tag_message_bytes(mac, &header(token), &Body::Register(meta), &[]),
        None => encode_message_bytes(&header(token), &Body::Register(meta), &[]),
    }
}

#[tokio::test]
async fn the_control_port_admits_only_the_key_holder() {
    let e = epochs();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let auth = e.current.clone();
    let names = vec!["gen-0".to_string()];
    let server =
        tokio::spawn(async move { ControlServer::accept_all(&listener, &names, &auth, deadline(), None).await });
    let hello = Hello { magic: control::MAGIC, version: control::VERSION, peer: "gen-0".into(), extra: vec![] };
    attack(&addr, &e, &hello, b"{\"Ready\":null}").await;
    assert!(!server.is_finished(), "no attacker took gen-0's place");
    let mut rank = ControlClient::connect(&addr, &e.current, "gen-0", deadline()).await.unwrap();
    let mut server = server.await.unwrap().unwrap();
    rank.reply(&Reply::Ready).await.unwrap();
    server.wait_ready(deadline()).await.unwrap();
    tokio::spawn(async move {
        while let Some(env) = rank.next().await.unwrap() {
            if env.command == Command::Shutdown {
                break;
            }
            rank.done(env.seq, Default::default()).await.unwrap();
        }
    });
    let names = vec!["gen-0".to_string()];
    assert_eq!(server.run(&names, Command::Generate { step: 0, min_version: 0 }, deadline()).await.unwrap().len(), 1);
    server.shutdown_all().await;
}

#[tokio::test]
async fn a_storage_unit_admits_only_the_key_holder_and_stores_nothing_for_the_others() {
    let e = epochs();
    let unit = Arc::new(StorageUnit::new(0, 1 << 20));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(StorageServer::new(unit.clone(), &e.current, Duration::from_secs(5)).serve(listener));
    let hello = Hello { magic: STORAGE_MAGIC, version: WIRE_VERSION, peer: "gen-0".into(), extra: vec![] };
    attack(&addr, &e, &hello, &put_message(e.current.token(), None)).await;
    assert_eq!(unit.used(), 0, "nothing an attacker sent was stored");
    // The key holder puts.
    let mut s = net::connect_retry(&addr, deadline(), "storage").await.unwrap();
    let mut session = net::send_hello(&mut s, &e.current, &hello, deadline(), &addr).await.unwrap();
    s.write_all(&put_message(e.current.token(), Some(&mut session.send))).await.unwrap();
    let mut buf = Vec::new();
    let (_, reply) = codec::read_message(&mut s, &mut session.recv, &mut buf).await.unwrap();
    assert!(matches!(reply, Body::Stored { .. }), "{reply:?}");
    assert!(unit.used() > 0);
}

#[tokio::test]
async fn the_tq_controller_admits_only_the_key_holder_and_registers_nothing_for_the_others() {
    let e = epochs();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let units = BTreeMap::from([(0, "127.0.0.1:1".to_string())]);
    let controller =
        TqController::new(ControllerConfig { auth: e.current.clone(), lease: Duration::from_secs(30), units });
    tokio::spawn(controller.clone().serve(listener));
    let hello = Hello { magic: CONTROLLER_MAGIC, version: WIRE_VERSION, peer: "gen-0".into(), extra: vec![] };
    attack(&addr, &e, &hello, &register_message(e.current.token(), None)).await;
    assert!(controller.status("p").is_none(), "nothing an attacker sent was registered");
    let mut s = net::connect_retry(&addr, deadline(), "controller").await.unwrap();
    let mut session = net::send_hello(&mut s, &e.current, &hello, deadline(), &addr).await.unwrap();
    s.write_all(&register_message(e.current.token(), Some(&mut session.send))).await.unwrap();
    let mut buf = Vec::new();
    let (_, reply) = codec::read_message(&mut s, &mut session.recv, &mut buf).await.unwrap();
    assert!(!matches!(reply, Body::Error { .. }), "{reply:?}");
    assert_eq!(controller.status("p").unwrap().samples, 1);
}

#[tokio::test]
async fn a_fanout_leader_admits_only_the_key_holder() {
    let e = epochs();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let auth = e.current.clone();
    let leader =
        tokio::spawn(
            async move { TcpFanoutLeader::accept(&listener, &auth, &["trainer-1".to_string()], deadline()).await },
        );
    let hello = Hello { magic: FANOUT_MAGIC, version: WIRE_VERSION, peer: "trainer-1".into(), extra: vec![] };
    attack(&addr, &e, &hello, b"anything").await;
    assert!(!leader.is_finished(), "no attacker took trainer-1's place");
    let _follower = TcpFanoutFollower::connect(&addr, &e.current, "trainer-1", deadline()).await.unwrap();
    assert_eq!(leader.await.unwrap().unwrap().followers(), vec!["trainer-1"]);
}

fn refit_plan() -> RefitPlan {
    let m = vec![
        TensorSpec::with_split("embed", TensorDType::Bf16, vec![256, 64], TpSplit::Rows),
        TensorSpec::with_split("norm", TensorDType::Bf16, vec![64], TpSplit::Replicated),
    ];
    RefitPlan::new(&m, 4096, 256).unwrap()
}

#[tokio::test]
async fn a_tcp_refit_sender_admits_only_the_key_holder() {
    let e = epochs();
    let plan = refit_plan();
    let id = plan.identity();
    let bind = |process: u32, name: &str| Member {
        process,
        name: name.into(),
        address: String::new(),
        bind_address: "127.0.0.1:0".into(),
    };
    let root_listener = RefitListener::bind(&bind(0, "trainer-0")).await.unwrap();
    let child_listener = RefitListener::bind(&bind(1, "gen-0")).await.unwrap();
    let at = |l: &RefitListener, m: Member| {
        let a = l.local_addr().unwrap().to_string();
        Member { address: a.clone(), bind_address: a, ..m }
    };
    let root = at(&root_listener, bind(0, "trainer-0"));
    let addr = root.address.clone();
    let route = Route::new(root, vec![at(&child_listener, bind(1, "gen-0"))], 1).unwrap();
    let (auth, r) = (e.current.clone(), route.clone());
    let sender = tokio::spawn(async move {
        tcp::connect_root(&root_listener, &r, id, &auth, &TcpOptions::default(), deadline()).await.map(|_| ())
    });
    // The stream's sender (process 0) and the plan identity, as a relay child presents them.
    let mut extra = 0u32.to_le_bytes().to_vec();
    extra.extend_from_slice(&id.encode());
    let hello = Hello { magic: tcp::HELLO_MAGIC, version: tcp::PROTOCOL_VERSION, peer: "gen-0".into(), extra };
    attack(&addr, &e, &hello, &[7u8; 4096]).await;
    assert!(!sender.is_finished(), "no attacker took gen-0's place");
    let options = TcpOptions::default();
    tcp::connect_receiver(&child_listener, 1, &[(route, id)], &e.current, &options, deadline()).await.unwrap();
    sender.await.unwrap().unwrap();
}

#[tokio::test]
async fn the_nccl_rendezvous_gives_its_unique_id_only_to_the_key_holder() {
    let e = epochs();
    let id = refit_plan().identity();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let unique: [u8; UNIQUE_ID_LEN] = std::array::from_fn(|i| i as u8);
    let auth = e.current.clone();
    let root = tokio::spawn(async move {
        nccl::publish_unique_id("trainer-0", &listener, &["gen-0".to_string()], 0, &id, &auth, &unique, deadline())
            .await
            .map(|peers| peers.len())
    });
    // The attackers are refused before the id is sent: `forge` and `replay` check that nothing
    // follows the refusal.
    let hello = Hello { magic: nccl::MAGIC, version: nccl::VERSION, peer: "gen-0".into(), extra: id.encode().to_vec() };
    attack(&addr, &e, &hello, b"").await;
    assert!(!root.is_finished(), "no attacker took gen-0's place");
    let (got, rank, world, _conn) = nccl::fetch_unique_id("gen-0", &addr, &id, &e.current, deadline()).await.unwrap();
    assert_eq!((got, rank, world), (unique, 1, 2));
    assert_eq!(root.await.unwrap().unwrap(), 1);
}

#[tokio::test]
async fn a_listener_without_the_key_is_refused_by_the_connecting_side() {
    // Mutual: a rank does not talk to a listener that cannot prove it holds the key either (a
    // stray process squatting on a port of the job), and says so to both.
    let e = epochs();
    let impostor = JobAuth::new(e.current.token(), &e.old_key);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let names = vec!["gen-0".to_string()];
    let server =
        tokio::spawn(async move { ControlServer::accept_all(&listener, &names, &impostor, deadline(), None).await });
    let err = ControlClient::connect(&addr, &e.current, "gen-0", Instant::now() + Duration::from_secs(20))
        .await
        .err()
        .expect("the rank refuses the impostor")
        .to_string();
    assert!(err.contains("the listener did not prove it holds this job epoch's key"), "{err}");
    assert_eq!(e.current.refusals().total(), 1, "the connecting side counts the impostors it refused");
    assert!(!server.is_finished(), "the impostor got no rank");
    server.abort();
    let _ = e.current_key;
}

#[test]
fn a_rank_without_its_key_file_stops_naming_the_file_the_secret_and_the_fix() {
    use rlplane_api::topology::{ClusterAddressing, JobIdentity, build_plan};
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../manifests/rljob-cpu.yaml")).unwrap();
    let job = rlplane_api::load_rljob(&text).unwrap();
    let id =
        JobIdentity { name: "grpo-cpu".into(), namespace: "ml".into(), uid: "uid-1".into(), epoch: 2, resume: None };
    let mut plan =
        build_plan(&job.spec, &id, &ClusterAddressing { job: "grpo-cpu".into(), namespace: "ml".into() }).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-key");
    plan.job.key_file = missing.display().to_string();
    let plan_path = dir.path().join("plan.json");
    std::fs::write(&plan_path, plan.to_json()).unwrap();
    // The plan alone names the key file: a RLPLANE_KEY_FILE in the environment changes nothing.
    let elsewhere = dir.path().join("mounted-elsewhere");
    for (process, env) in [("gen-0", None), ("coordinator", None), ("gen-0", Some(&elsewhere))] {
        let named = &missing;
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_rlplane"));
        cmd.args(["worker", "--plan"]).arg(&plan_path).args(["--process", process]);
        match env {
            Some(path) => cmd.env("RLPLANE_KEY_FILE", path),
            None => cmd.env_remove("RLPLANE_KEY_FILE"),
        };
        let out = cmd.output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{process}: {stderr}");
        for needle in [named.display().to_string().as_str(), "grpo-cpu-key-uid1-e2", "openssl rand -hex 32"] {
            assert!(stderr.contains(needle), "{process}: no `{needle}` in {stderr}");
        }
    }
}
