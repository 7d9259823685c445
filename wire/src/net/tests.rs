use std::time::Duration;

use rlplane_api::plan::JOB_KEY_LEN;
use tokio::net::TcpListener;
use tokio::time::Instant;

use super::handshake::WireHello;
use super::*;

fn hello() -> Hello {
    Hello { magic: *b"TEST", version: 1, peer: "p".into(), extra: vec![1, 2, 3] }
}

fn auth(token: &str, seed: u8) -> JobAuth {
    JobAuth::new(token, &[seed; JOB_KEY_LEN])
}

#[test]
fn hello_round_trips_and_rejects_truncation() {
    let w = WireHello { hello: hello(), token: "e0-abc".into(), nonce: vec![7; NONCE_LEN] };
    let b = w.encode();
    assert_eq!(WireHello::decode(&b).unwrap(), w);
    for cut in 0..b.len() {
        assert!(WireHello::decode(&b[..cut]).is_err(), "cut at {cut}");
    }
}

#[test]
fn a_hello_without_a_nonce_says_the_peer_is_too_old() {
    let w = WireHello { hello: hello(), token: "e0-abc".into(), nonce: vec![] };
    let mut b = w.encode();
    b.truncate(b.len() - 4);
    let err = auth("e0-abc", 1).open_hello(&b, *b"TEST", 1).unwrap_err();
    assert!(err.contains("no nonce") && err.contains("matching worker images"), "{err}");
}

#[test]
fn proofs_need_the_key_and_are_bound_to_both_nonces_and_a_side() {
    let (good, other) = (auth("e1-x", 1), auth("e1-x", 2));
    let c = good.client_hello(&hello()).unwrap();
    let (_, challenge) = good.open_hello(c.bytes(), *b"TEST", 1).unwrap();
    // Without the key the listener's proof fails, and the client's proof fails at the listener.
    assert!(c.answer(&other, challenge.bytes()).is_err());
    let forged = other.client_hello(&hello()).unwrap();
    let (_, ch2) = good.open_hello(forged.bytes(), *b"TEST", 1).unwrap();
    let bad_proof = forged.answer(&other, &{
        // The forger can only sign with its own key.
        let (_, mine) = other.open_hello(forged.bytes(), *b"TEST", 1).unwrap();
        *mine.bytes()
    });
    assert!(ch2.verify(&good, &bad_proof.unwrap().0).is_err());
    // The right proof passes once; the same proof against a fresh challenge (a replay) fails.
    let (proof, _) = c.answer(&good, challenge.bytes()).unwrap();
    challenge.verify(&good, &proof).unwrap();
    let (_, fresh) = good.open_hello(c.bytes(), *b"TEST", 1).unwrap();
    assert!(fresh.verify(&good, &proof).is_err(), "a replayed proof must fail");
    // A listener's proof is not a client's proof.
    assert!(challenge.verify(&good, &challenge.bytes()[NONCE_LEN..]).is_err());
    assert_eq!(good.refusals().total(), 3);
    assert_eq!(other.refusals().total(), 1);
    assert!(!format!("{good:?}").contains("1, 1"), "Debug never shows the key");
}

async fn handshake(
    client: JobAuth,
    server: JobAuth,
) -> (Result<Session, NetError>, Result<(Hello, Session), NetError>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let deadline = Instant::now() + Duration::from_secs(5);
    let server = tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        accept_hello(&mut s, &server, *b"TEST", 1, deadline, |_| Ok(())).await
    });
    let mut c = connect_retry(&addr, deadline, "test").await.unwrap();
    let client = send_hello(&mut c, &client, &hello(), deadline, &addr).await;
    (client, server.await.unwrap())
}

#[tokio::test]
async fn token_mismatch_is_refused_with_the_reason_on_both_sides() {
    let (server_auth, stale) = (auth("e1-good", 1), auth("e0-stale", 0));
    let (c, s) = handshake(stale, server_auth.clone()).await;
    assert!(c.unwrap_err().to_string().contains("another job or epoch"));
    assert!(matches!(s.unwrap_err(), NetError::Refused { .. }));
    assert_eq!(server_auth.refusals().snapshot(), vec![("TEST".to_string(), 1)]);
}

#[tokio::test]
async fn the_right_token_without_the_key_is_refused_on_both_sides() {
    let (server_auth, keyless) = (auth("e1-good", 1), auth("e1-good", 9));
    let (c, s) = handshake(keyless.clone(), server_auth.clone()).await;
    let (c, s) = (c.unwrap_err().to_string(), s.unwrap_err().to_string());
    assert!(c.contains("did not prove it holds this job epoch's key"), "{c}");
    assert!(s.contains("the peer refused this side"), "{s}");
    assert_eq!(keyless.refusals().total(), 1);
    let (ok_c, ok_s) = handshake(server_auth.clone(), server_auth.clone()).await;
    ok_c.unwrap();
    assert_eq!(ok_s.unwrap().0.peer, "p");
}

#[tokio::test]
async fn a_handshake_leaves_both_sides_matching_frame_keys_of_their_own() {
    let a = auth("e1-good", 1);
    let (c, s) = handshake(a.clone(), a.clone()).await;
    let (mut c, (_, mut s)) = (c.unwrap(), s.unwrap());
    let (up, down) = (c.send.tag(&[b"claim"]), s.send.tag(&[b"granted"]));
    s.recv.check(&[b"claim"], &up).unwrap();
    c.recv.check(&[b"granted"], &down).unwrap();
    // Each direction has its own key, and another connection of the same job has others.
    let (k_up, k_down) = (c.send.next_key(), s.send.next_key());
    assert_eq!(k_up.frame(), k_down.frame());
    assert_ne!(k_up.tag(&[b"x"]), k_down.tag(&[b"x"]), "the directions' keys differ");
    let (c2, s2) = handshake(a.clone(), a.clone()).await;
    let (mut c2, (_, mut s2)) = (c2.unwrap(), s2.unwrap());
    s2.recv.check(&[b"put"], &c2.send.tag(&[b"put"])).unwrap();
    let (_, _) = (c.send.next_key(), c2.send.next_key());
    let replayed = c.send.tag(&[b"put"]);
    assert!(s2.recv.check(&[b"put"], &replayed).is_err(), "a frame of one connection fails on another");
    assert_eq!(s.recv.frames(), 1);
}

#[tokio::test]
async fn tagged_frames_round_trip_and_an_altered_one_is_refused() {
    let (mut a, mut b) = Session::fixed_pair(3);
    let (mut w, mut r) = tokio::io::duplex(1 << 16);
    write_tagged_frame(&mut w, &mut a.send, b"weights v7").await.unwrap();
    write_tagged_frame(&mut w, &mut a.send, b"weights v8").await.unwrap();
    let mut buf = Vec::new();
    read_tagged_frame(&mut r, &mut b.recv, &mut buf, 1024).await.unwrap();
    assert_eq!(buf, b"weights v7");
    // The second frame's last payload byte, flipped on the way.
    let mut raw = vec![0u8; 4 + 10 + TAG_LEN];
    tokio::io::AsyncReadExt::read_exact(&mut r, &mut raw).await.unwrap();
    raw[4 + 9] ^= 1;
    let err = read_tagged_frame(&mut &raw[..], &mut b.recv, &mut buf, 1024).await.unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidData);
    assert!(err.to_string().contains("frame 1 of this connection failed its authentication tag"), "{err}");
}

#[tokio::test]
async fn fixed_length_tagged_messages_round_trip_and_a_replayed_one_is_refused() {
    let (mut a, mut b) = Session::fixed_pair(4);
    let (mut w, mut r) = tokio::io::duplex(1 << 16);
    write_tagged(&mut w, &mut a.send, b"DONE v7!").await.unwrap();
    let mut msg = [0u8; 8];
    read_tagged(&mut r, &mut b.recv, &mut msg).await.unwrap();
    assert_eq!(&msg, b"DONE v7!");
    // The same bytes and tag again: frame 1 expected, frame 0's tag found.
    let (mut a0, _) = Session::fixed_pair(4);
    write_tagged(&mut w, &mut a0.send, b"DONE v7!").await.unwrap();
    let err = read_tagged(&mut r, &mut b.recv, &mut msg).await.unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidData);
    assert!(err.to_string().contains("frame 1 of this connection failed its authentication tag"), "{err}");
}

#[tokio::test]
async fn connect_retry_times_out_naming_the_peer() {
    // A port that nothing listens on: bind then drop.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr = format!("127.0.0.1:{port}");
    let err = connect_retry(&addr, Instant::now() + Duration::from_millis(200), "refit").await.unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains(&addr) && msg.contains("refit"), "{msg}");
}

#[test]
fn a_missing_or_malformed_key_file_names_the_file_and_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("key");
    let err = JobAuth::load("t", &path, "job-key-e0").unwrap_err().to_string();
    assert!(
        err.contains(&path.display().to_string()) && err.contains("job-key-e0") && err.contains("openssl"),
        "{err}"
    );
    std::fs::write(&path, "not a key").unwrap();
    let err = JobAuth::load("t", &path, "job-key-e0").unwrap_err().to_string();
    assert!(err.contains("is not a key") && err.contains("64 hexadecimal"), "{err}");
    let key = JobAuth::generate_key().unwrap();
    std::fs::write(&path, rlplane_api::plan::encode_job_key(&key)).unwrap();
    assert_eq!(JobAuth::load("t", &path, "job-key-e0").unwrap().token(), "t");
}
