//! Malformed frames: random and mutated messages against the decoders and against a live storage
//! unit on a real socket, sent by a peer that holds the job's key (so the frames carry valid tags
//! and reach the decoders). Never a panic, never a hang, never a corrupted store; a bad token in a
//! message header gets an error reply.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use rlplane::net::{self, FrameMac, Hello, JobAuth, Session};
use rlplane::tq::codec::{
    self, Block, Body, ErrorCode, Header, STORAGE_MAGIC, WIRE_VERSION, decode, decode_message_bytes,
    encode_message_bytes,
};
use rlplane::tq::{BatchMeta, Column, DType, FieldSpec, SampleTags, StorageServer, StorageUnit};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const TOKEN: &str = "e0-frames";

fn auth() -> JobAuth {
    JobAuth::new(TOKEN, &[0x33; 32])
}

fn header() -> Header {
    Header { version: WIRE_VERSION, request_id: 1, token: TOKEN.into() }
}

/// A valid put message (header frame and buffers) of `n` samples to partition `fuzz`.
fn put_message(n: usize) -> Vec<u8> {
    let ids: Vec<Vec<i64>> = (0..n).map(|i| (0..i as i64 + 1).collect()).collect();
    let ids = Column::ragged("ids", &ids.iter().map(|v| v.as_slice()).collect::<Vec<_>>());
    let r = Column::scalars("r", &(0..n).map(|i| i as f32).collect::<Vec<_>>());
    let block = Block {
        n: n as u32,
        columns: vec![(ids.spec().clone(), ids.nbytes() as u64), (r.spec().clone(), r.nbytes() as u64)],
    };
    let body = Body::Put { partition: "fuzz".into(), keys: (0..n).map(|i| format!("k{i}")).collect(), block };
    let off = codec::encode_offsets(ids.offsets());
    encode_message_bytes(&header(), &body, &[&off, ids.values(), r.values()])
}

fn other_messages() -> Vec<Vec<u8>> {
    let mut meta =
        BatchMeta::builder("p", vec![FieldSpec::ragged("ids", DType::I64), FieldSpec::fixed("r", DType::F32, vec![2])]);
    meta.push("a", 0, 3, &[3, 1], &SampleTags::from(vec![("t".to_string(), "v".to_string())])).unwrap();
    let meta = meta.finish();
    let bodies = [
        Body::Register(meta.clone()),
        Body::Claim { partition: "p".into(), group: "g".into(), n: 4, min: 0, required: vec!["ids".into()] },
        Body::Get { partition: "fuzz".into(), keys: vec!["k0".into(), "k1".into()], fields: vec!["ids".into()] },
        Body::Claimed { claim_id: 1, lease_ms: 10, meta },
        Body::Ping,
        Body::ClearUnit { partition: "nothing".into() },
    ];
    bodies.iter().map(|b| encode_message_bytes(&header(), b, &[])).collect()
}

#[derive(Clone, Debug)]
enum Mutation {
    Flip(usize, u8),
    Truncate(usize),
    Insert(usize, Vec<u8>),
    Random(Vec<u8>),
}

fn mutate(mut msg: Vec<u8>, muts: &[Mutation]) -> Vec<u8> {
    for m in muts {
        match m {
            Mutation::Flip(i, x) if !msg.is_empty() => {
                let i = i % msg.len();
                msg[i] ^= x | 1;
            }
            Mutation::Truncate(i) if !msg.is_empty() => msg.truncate(i % msg.len()),
            Mutation::Insert(i, b) => {
                let i = i % (msg.len() + 1);
                msg.splice(i..i, b.iter().copied());
            }
            Mutation::Random(b) => msg = b.clone(),
            _ => {}
        }
    }
    msg
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        6 => (any::<usize>(), any::<u8>()).prop_map(|(i, x)| Mutation::Flip(i, x)),
        2 => any::<usize>().prop_map(Mutation::Truncate),
        1 => (any::<usize>(), prop::collection::vec(any::<u8>(), 1..16)).prop_map(|(i, b)| Mutation::Insert(i, b)),
        1 => prop::collection::vec(any::<u8>(), 0..64).prop_map(Mutation::Random),
    ]
}

proptest! {
    #![proptest_config(Config { cases: 2000, ..Config::default() })]

    #[test]
    fn random_bytes_never_panic_the_decoders(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = decode(&bytes);
        let _ = decode_message_bytes(&bytes);
    }

    #[test]
    fn mutated_messages_decode_or_fail_cleanly_and_re_encode_stably(
        which in 0usize..7,
        muts in prop::collection::vec(mutation(), 1..4),
    ) {
        let base = if which == 0 { put_message(5) } else { other_messages()[which - 1].clone() };
        let msg = mutate(base, &muts);
        if let Ok((m, used)) = decode_message_bytes(&msg) {
            prop_assert!(used <= msg.len());
            // Whatever decodes re-encodes to the same message.
            let bufs: Vec<&[u8]> = m.buffers.iter().map(|b| b.as_slice()).collect();
            let again = encode_message_bytes(&m.header, &m.body, &bufs);
            prop_assert_eq!(decode_message_bytes(&again).unwrap().0, m);
        }
    }
}

async fn connect(addr: &str) -> (TcpStream, Session) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let mut s = net::connect_retry(addr, deadline, "test").await.unwrap();
    let hello = Hello { magic: STORAGE_MAGIC, version: WIRE_VERSION, peer: "fuzzer".into(), extra: vec![] };
    let session = net::send_hello(&mut s, &auth(), &hello, deadline, addr).await.unwrap();
    (s, session)
}

async fn ping(addr: &str) -> Body {
    let (mut s, mut session) = connect(addr).await;
    codec::write_message(&mut s, &mut session.send, &header(), &Body::Ping).await.unwrap();
    let mut buf = Vec::new();
    codec::read_message(&mut s, &mut session.recv, &mut buf).await.unwrap().1
}

/// `msg` (untagged, as `encode_message_bytes` lays it out, possibly mutated) with the tags a
/// key holder adds where the unit will look for them: after the header frame, and after each
/// record of every buffer frame the header declares, as far as the bytes follow the declaration.
fn tagged(mac: &mut FrameMac, msg: &[u8]) -> Vec<u8> {
    let Some(len) = msg.get(..4).map(|b| u32::from_le_bytes(b.try_into().unwrap()) as usize) else {
        return msg.to_vec();
    };
    if len > codec::MAX_HEADER as usize || msg.len() < 4 + len {
        return msg.to_vec();
    }
    let frame = &msg[4..4 + len];
    let mut out = msg[..4 + len].to_vec();
    out.extend_from_slice(&mac.tag(&[frame]));
    let mut rest = &msg[4 + len..];
    if let Some(block) = decode(frame).ok().and_then(|(_, b)| b.block().cloned()) {
        for want in block.buffer_lens() {
            let Some(got) = rest.get(..8).map(|b| u64::from_le_bytes(b.try_into().unwrap())) else { break };
            out.extend_from_slice(&rest[..8]);
            rest = &rest[8..];
            if got != want {
                break;
            }
            let n = (got as usize).min(rest.len());
            let mut body = &rest[..n];
            for len in net::record_lens(n) {
                let (record, after) = body.split_at(len);
                out.extend_from_slice(record);
                out.extend_from_slice(&mac.tag(&[record]));
                body = after;
            }
            rest = &rest[n..];
        }
    }
    out.extend_from_slice(rest);
    out
}

static PANICKED: AtomicBool = AtomicBool::new(false);

#[test]
fn a_live_storage_unit_survives_mutated_frames_with_its_store_intact() {
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        PANICKED.store(true, Ordering::SeqCst);
        default_hook(info);
    }));
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let unit = Arc::new(StorageUnit::new(0, 1 << 20));
    let (addr, kept) = rt.block_on(async {
        let keys: Vec<String> = (0..4).map(|i| format!("keep{i}")).collect();
        let col = Column::ragged::<i64>("ids", &[&[1, 2], &[3], &[], &[4, 5, 6]]);
        unit.put("keep", &keys, &[col], tokio::time::Instant::now()).await.unwrap();
        let kept = unit.get("keep", &keys, &["ids".into()]).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        tokio::spawn(StorageServer::new(unit.clone(), &auth(), Duration::from_millis(200)).serve(listener));
        (addr, kept)
    });
    let keep_bytes = unit.used();
    let strategy = (0usize..7, prop::collection::vec(mutation(), 1..4));
    let mut runner = TestRunner::new(Config { cases: 96, ..Config::default() });
    runner
        .run(&strategy, |(which, muts)| {
            let base = if which == 0 { put_message(5) } else { other_messages()[which - 1].clone() };
            let msg = mutate(base, &muts);
            rt.block_on(async {
                let (mut s, mut session) = connect(&addr).await;
                s.write_all(&tagged(&mut session.send, &msg)).await.unwrap();
                s.shutdown().await.unwrap();
                // The unit answers and/or closes; it must not hang once our side is done.
                let mut sink = Vec::new();
                let read = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut sink)).await;
                prop_assert!(read.is_ok(), "the unit hung on {msg:?}");
                prop_assert!(matches!(ping(&addr).await, Body::Pong { .. }), "the unit stopped answering");
                Ok(())
            })
        })
        .unwrap();
    // The kept partition is byte-identical, and no reservation leaked.
    let keys: Vec<String> = (0..4).map(|i| format!("keep{i}")).collect();
    let now = unit.get("keep", &keys, &["ids".into()]).unwrap();
    for (a, b) in now[0].samples.iter().zip(&kept[0].samples) {
        assert_eq!(a.0, b.0);
        assert_eq!(a.1, b.1);
    }
    // A mutation may turn the partition's name into another valid one: that put was accepted
    // under the new name, and is cleared with the rest.
    for p in unit.partitions().iter().filter(|p| p.as_str() != "keep") {
        unit.clear(p);
    }
    assert_eq!(unit.used(), keep_bytes, "a refused or torn put left bytes reserved");
    assert!(!PANICKED.load(Ordering::SeqCst), "a server task panicked");
}

#[tokio::test]
async fn a_message_with_another_token_gets_an_error_reply_and_the_connection_goes_on() {
    let unit = Arc::new(StorageUnit::new(5, 1 << 20));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(StorageServer::new(unit.clone(), &auth(), Duration::from_secs(1)).serve(listener));
    let (mut s, mut session) = connect(&addr).await;
    // A put under another token: its buffers are skipped, the reply names the token.
    let mut msg = put_message(3);
    let stale = Header { version: WIRE_VERSION, request_id: 9, token: "e1-other".into() };
    let frame = codec::encode(
        &stale,
        &decode(&msg[4..4 + u32::from_le_bytes(msg[..4].try_into().unwrap()) as usize]).unwrap().1,
    );
    let old_len = u32::from_le_bytes(msg[..4].try_into().unwrap()) as usize;
    msg.splice(0..4 + old_len, (frame.len() as u32).to_le_bytes().into_iter().chain(frame));
    s.write_all(&tagged(&mut session.send, &msg)).await.unwrap();
    let mut buf = Vec::new();
    match codec::read_message(&mut s, &mut session.recv, &mut buf).await.unwrap() {
        (h, Body::Error { code, message }) => {
            assert_eq!(h.request_id, 9);
            assert_eq!(code, ErrorCode::Token);
            assert!(message.contains("another job or epoch"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(unit.used(), 0);
    codec::write_message(&mut s, &mut session.send, &header(), &Body::Ping).await.unwrap();
    let pong = codec::read_message(&mut s, &mut session.recv, &mut buf).await.unwrap().1;
    assert!(matches!(pong, Body::Pong { unit: 5, .. }));
    // A hello with another token is refused at the door.
    let mut s = net::connect_retry(&addr, tokio::time::Instant::now() + Duration::from_secs(5), "t").await.unwrap();
    let hello = Hello { magic: STORAGE_MAGIC, version: WIRE_VERSION, peer: "x".into(), extra: vec![] };
    let other = JobAuth::new("e1-other", &[1; 32]);
    let e = net::send_hello(&mut s, &other, &hello, tokio::time::Instant::now() + Duration::from_secs(5), &addr)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("another job or epoch"), "{e}");
}
