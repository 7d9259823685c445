//! The authenticated handshake every connection starts with (see the [`super`] module docs):
//! the hello, each side's HMAC-SHA256 proof over both nonces, and the refusals counted.

use std::collections::BTreeMap;
use std::io;
use std::path::Path;
use std::sync::{Arc, Mutex};

use ring::hmac;
use ring::rand::SecureRandom;
use rlplane_api::WorkerPlan;
use rlplane_api::plan::{JOB_KEY_LEN, parse_job_key};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::mac::{FRAME_KEY_LEN, Session};
use super::{KeyError, NetError, read_frame, until, write_frame};

/// Byte the accepting side sends when it accepts a [`Hello`] (and the connecting side before its
/// proof, once the accepting side has proven itself).
pub const HELLO_OK: u8 = 0;
/// Byte either side sends before an error frame when it refuses the other.
pub const HELLO_REFUSED: u8 = 1;
/// Byte the accepting side sends, followed by its challenge ([`CHALLENGE_LEN`] bytes), when a
/// [`Hello`]'s identifiers (protocol, version, job token) match.
pub const HELLO_CHALLENGE: u8 = 2;

/// Bytes of each side's fresh random nonce.
pub const NONCE_LEN: usize = 32;
/// Bytes of a proof: an HMAC-SHA256 tag.
pub const PROOF_LEN: usize = 32;
/// Bytes of the accepting side's challenge: its nonce, then its proof.
pub const CHALLENGE_LEN: usize = NONCE_LEN + PROOF_LEN;

/// Domain-separation labels: a proof made by one side can never be presented as the other's.
const SERVER_PROOF_LABEL: &[u8] = b"rlplane handshake v1: accepting side\0";
const CLIENT_PROOF_LABEL: &[u8] = b"rlplane handshake v1: connecting side\0";
/// Labels of the two directions' frame keys ([`super::mac`]), derived like the proofs.
const FRAMES_FROM_CLIENT_LABEL: &[u8] = b"rlplane frames v1: from the connecting side\0";
const FRAMES_FROM_SERVER_LABEL: &[u8] = b"rlplane frames v1: from the accepting side\0";

/// The first message on every connection (what the connecting side says about itself; the job
/// token and its nonce are added by [`JobAuth::client_hello`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    /// Protocol magic, e.g. `*b"RFIT"`.
    pub magic: [u8; 4],
    /// Protocol version.
    pub version: u16,
    /// The connecting peer's name (e.g. `gen-3`).
    pub peer: String,
    /// Protocol-specific bytes (e.g. a plan hash).
    pub extra: Vec<u8>,
}

/// A hello as it travels: magic, version, then length-prefixed token, peer, extra and nonce.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct WireHello {
    pub(super) hello: Hello,
    pub(super) token: String,
    pub(super) nonce: Vec<u8>,
}

impl WireHello {
    pub(super) fn encode(&self) -> Vec<u8> {
        let h = &self.hello;
        let mut v = Vec::with_capacity(22 + self.token.len() + h.peer.len() + h.extra.len() + self.nonce.len());
        v.extend_from_slice(&h.magic);
        v.extend_from_slice(&h.version.to_le_bytes());
        for s in [self.token.as_bytes(), h.peer.as_bytes(), &h.extra, &self.nonce] {
            v.extend_from_slice(&(s.len() as u32).to_le_bytes());
            v.extend_from_slice(s);
        }
        v
    }

    pub(super) fn decode(b: &[u8]) -> Result<WireHello, String> {
        if b.len() < 6 {
            return Err("hello shorter than its header".into());
        }
        let magic = [b[0], b[1], b[2], b[3]];
        let version = u16::from_le_bytes([b[4], b[5]]);
        let mut rest = &b[6..];
        let mut field = |name: &str| -> Result<Vec<u8>, String> {
            if rest.len() < 4 {
                return Err(format!("hello truncated before {name}"));
            }
            let n = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
            if rest.len() < 4 + n {
                return Err(format!("hello truncated inside {name}"));
            }
            let v = rest[4..4 + n].to_vec();
            rest = &rest[4 + n..];
            Ok(v)
        };
        let token = String::from_utf8(field("token")?).map_err(|_| "token is not UTF-8")?;
        let peer = String::from_utf8(field("peer")?).map_err(|_| "peer name is not UTF-8")?;
        let extra = field("extra")?;
        let nonce = match field("nonce") {
            Ok(n) => n,
            Err(_) => {
                return Err("the hello carries no nonce: the peer runs a worker from before authenticated \
                            handshakes; run matching worker images"
                    .into());
            }
        };
        if nonce.len() != NONCE_LEN {
            return Err(format!("a nonce of {} bytes where {NONCE_LEN} were expected", nonce.len()));
        }
        Ok(WireHello { hello: Hello { magic, version, peer, extra }, token, nonce })
    }
}

/// Handshake refusals a process has counted, by protocol (its magic): what refused peers tried.
/// Plain data that the process's metrics read at scrape time (`rlplane_handshake_refused_total`);
/// the transports only count.
#[derive(Clone, Debug, Default)]
pub struct Refusals(Arc<Mutex<BTreeMap<String, u64>>>);

impl Refusals {
    /// Counts one refusal on a port speaking `magic`.
    pub fn count(&self, magic: [u8; 4]) {
        if let Ok(mut m) = self.0.lock() {
            *m.entry(String::from_utf8_lossy(&magic).into_owned()).or_insert(0) += 1;
        }
    }

    /// The counts so far, by protocol.
    pub fn snapshot(&self) -> Vec<(String, u64)> {
        self.0.lock().map(|m| m.iter().map(|(k, v)| (k.clone(), *v)).collect()).unwrap_or_default()
    }

    /// All refusals so far.
    pub fn total(&self) -> u64 {
        self.snapshot().iter().map(|(_, n)| n).sum()
    }
}

/// What a process proves and checks on every handshake: the job epoch's token (an identifier, so
/// that a peer of another epoch is told so) and the epoch's key (a secret, never sent: each side
/// proves it holds it with an HMAC-SHA256 over the whole handshake and both sides' fresh nonces,
/// so a replayed handshake fails). Cheap to clone; its [`Refusals`] are shared by the clones.
#[derive(Clone)]
pub struct JobAuth {
    token: Arc<str>,
    key: hmac::Key,
    refusals: Refusals,
}

impl std::fmt::Debug for JobAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobAuth").field("token", &self.token).field("key", &"<secret>").finish()
    }
}

/// `n` bytes from the operating system's random source.
fn random_bytes<const N: usize>() -> Result<[u8; N], KeyError> {
    let mut b = [0u8; N];
    ring::rand::SystemRandom::new().fill(&mut b).map_err(|e| KeyError::Random(e.to_string()))?;
    Ok(b)
}

impl JobAuth {
    /// Authentication with `token` and `key`.
    pub fn new(token: &str, key: &[u8; JOB_KEY_LEN]) -> JobAuth {
        JobAuth { token: token.into(), key: hmac::Key::new(hmac::HMAC_SHA256, key), refusals: Refusals::default() }
    }

    /// A fresh random key ([`rlplane_api::plan::generate_job_key`]).
    pub fn generate_key() -> Result<[u8; JOB_KEY_LEN], KeyError> {
        rlplane_api::plan::generate_job_key().map_err(KeyError::Random)
    }

    /// Reads the key of the plan's epoch from [`rlplane_api::plan::JobRef::key_file`].
    pub fn for_plan(plan: &WorkerPlan) -> Result<JobAuth, KeyError> {
        let secret = rlplane_api::plan::job_key_secret_name(&plan.job.name, &plan.job.uid, plan.job.epoch);
        Self::load(&plan.job.token, Path::new(&plan.job.key_file), &secret)
    }

    /// Reads the key at `path` (the text of [`rlplane_api::plan::encode_job_key`]); `secret` names
    /// the Secret that should have put it there, for the error.
    pub fn load(token: &str, path: &Path, secret: &str) -> Result<JobAuth, KeyError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| KeyError::Read {
            path: shown.clone(),
            secret: secret.into(),
            len: JOB_KEY_LEN,
            source,
        })?;
        let key =
            parse_job_key(&text).map_err(|reason| KeyError::Malformed { path: shown, reason, len: JOB_KEY_LEN })?;
        Ok(JobAuth::new(token, &key))
    }

    /// The job token.
    pub fn token(&self) -> &str {
        &self.token
    }

    /// The refusals counted on this process's handshakes.
    pub fn refusals(&self) -> &Refusals {
        &self.refusals
    }

    /// The same, counting its refusals into `refusals` (one count over a process's epochs).
    pub fn counting_into(mut self, refusals: &Refusals) -> JobAuth {
        self.refusals = refusals.clone();
        self
    }

    fn proof(&self, label: &[u8], hello: &[u8], server_nonce: &[u8]) -> hmac::Tag {
        let mut ctx = hmac::Context::with_key(&self.key);
        ctx.update(label);
        ctx.update(&(hello.len() as u32).to_le_bytes());
        ctx.update(hello);
        ctx.update(server_nonce);
        ctx.sign()
    }

    /// The frame keys of the connection whose handshake was `hello` and `server_nonce`: from the
    /// connecting side, then from the accepting side. Both nonces are inside, so every connection
    /// has keys of its own, and neither side's proof reveals them.
    fn frame_keys(&self, hello: &[u8], server_nonce: &[u8]) -> ([u8; FRAME_KEY_LEN], [u8; FRAME_KEY_LEN]) {
        let key = |label| -> [u8; FRAME_KEY_LEN] {
            self.proof(label, hello, server_nonce).as_ref().try_into().expect("HMAC-SHA256 tags are 32 bytes")
        };
        (key(FRAMES_FROM_CLIENT_LABEL), key(FRAMES_FROM_SERVER_LABEL))
    }

    fn verify(&self, label: &[u8], hello: &[u8], server_nonce: &[u8], proof: &[u8]) -> bool {
        let mut msg = Vec::with_capacity(label.len() + 4 + hello.len() + server_nonce.len());
        msg.extend_from_slice(label);
        msg.extend_from_slice(&(hello.len() as u32).to_le_bytes());
        msg.extend_from_slice(hello);
        msg.extend_from_slice(server_nonce);
        hmac::verify(&self.key, &msg, proof).is_ok()
    }

    /// Connecting side, step 1: the hello to send, with this process's token and a fresh nonce.
    pub fn client_hello(&self, hello: &Hello) -> Result<ClientHello, KeyError> {
        let nonce = random_bytes::<NONCE_LEN>()?;
        let wire = WireHello { hello: hello.clone(), token: self.token.to_string(), nonce: nonce.to_vec() };
        Ok(ClientHello { magic: hello.magic, bytes: wire.encode() })
    }

    /// Accepting side, step 1: decodes a hello and checks its identifiers (protocol, version, job
    /// token). On success returns the peer's claims — not to be used before
    /// [`ServerChallenge::verify`] — and the challenge to send. Refusals are counted.
    pub fn open_hello(&self, bytes: &[u8], magic: [u8; 4], version: u16) -> Result<(Hello, ServerChallenge), String> {
        let verdict = WireHello::decode(bytes).and_then(|w| {
            if w.hello.magic != magic {
                return Err(format!(
                    "protocol {:?} where {:?} was expected",
                    String::from_utf8_lossy(&w.hello.magic),
                    String::from_utf8_lossy(&magic)
                ));
            }
            if w.hello.version != version {
                return Err(format!(
                    "protocol version {} where {version} was expected; run matching worker images",
                    w.hello.version
                ));
            }
            if w.token != *self.token {
                return Err(format!(
                    "job token `{}` does not match `{}`: the peer belongs to another job or epoch",
                    w.token, self.token
                ));
            }
            Ok(w)
        });
        let w = verdict.inspect_err(|_| self.refusals.count(magic))?;
        let nonce = random_bytes::<NONCE_LEN>().map_err(|e| e.to_string())?;
        let proof = self.proof(SERVER_PROOF_LABEL, bytes, &nonce);
        let mut challenge = [0u8; CHALLENGE_LEN];
        challenge[..NONCE_LEN].copy_from_slice(&nonce);
        challenge[NONCE_LEN..].copy_from_slice(proof.as_ref());
        Ok((w.hello, ServerChallenge { magic, hello: bytes.to_vec(), challenge }))
    }
}

/// The connecting side's half of a handshake in progress.
#[derive(Debug)]
pub struct ClientHello {
    magic: [u8; 4],
    bytes: Vec<u8>,
}

impl ClientHello {
    /// The hello to send.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// Connecting side, step 2: checks that the accepting side proved it holds the key (over this
    /// hello and its nonce) and returns this side's proof. A failed check is counted.
    pub fn answer(&self, auth: &JobAuth, challenge: &[u8]) -> Result<([u8; PROOF_LEN], Session), String> {
        if challenge.len() != CHALLENGE_LEN
            || !auth.verify(SERVER_PROOF_LABEL, &self.bytes, &challenge[..NONCE_LEN], &challenge[NONCE_LEN..])
        {
            auth.refusals.count(self.magic);
            return Err("the listener did not prove it holds this job epoch's key: it is not a process of this \
                        job epoch (an old epoch's or another job's), or it was handed another key"
                .into());
        }
        let proof = auth.proof(CLIENT_PROOF_LABEL, &self.bytes, &challenge[..NONCE_LEN]);
        let (ours, theirs) = auth.frame_keys(&self.bytes, &challenge[..NONCE_LEN]);
        Ok((proof.as_ref().try_into().expect("HMAC-SHA256 tags are 32 bytes"), Session::new(ours, theirs)))
    }
}

/// The accepting side's half of a handshake in progress.
#[derive(Debug)]
pub struct ServerChallenge {
    magic: [u8; 4],
    hello: Vec<u8>,
    challenge: [u8; CHALLENGE_LEN],
}

impl ServerChallenge {
    /// The challenge to send: this side's nonce and proof.
    pub fn bytes(&self) -> &[u8; CHALLENGE_LEN] {
        &self.challenge
    }

    /// Accepting side, step 2: checks the connecting side's proof (over its hello and this side's
    /// fresh nonce, so a recorded handshake does not pass twice) and returns the connection's
    /// frame keys. A failed check is counted.
    pub fn verify(&self, auth: &JobAuth, proof: &[u8]) -> Result<Session, String> {
        if auth.verify(CLIENT_PROOF_LABEL, &self.hello, &self.challenge[..NONCE_LEN], proof) {
            let (theirs, ours) = auth.frame_keys(&self.hello, &self.challenge[..NONCE_LEN]);
            return Ok(Session::new(ours, theirs));
        }
        auth.refusals.count(self.magic);
        Err("the peer did not prove it holds this job epoch's key: it presented the right job token without \
             the epoch's key (an old epoch's key, another key, or a replayed handshake)"
            .into())
    }
}

/// Writes a refusal: [`HELLO_REFUSED`] and the reason as a frame.
async fn refuse<S: AsyncWriteExt + Unpin>(stream: &mut S, reason: &str) {
    let mut b = vec![HELLO_REFUSED];
    b.extend_from_slice(&(reason.len() as u32).to_le_bytes());
    b.extend_from_slice(reason.as_bytes());
    let _ = stream.write_all(&b).await;
    let _ = stream.flush().await;
}

/// Reads the reason frame that follows [`HELLO_REFUSED`].
async fn read_refusal<S: AsyncReadExt + Unpin>(stream: &mut S, peer: &str) -> Result<String, NetError> {
    let mut reason = Vec::new();
    read_frame(stream, &mut reason, 64 << 10).await.map_err(|e| NetError::io("reading the refusal", peer, e))?;
    Ok(String::from_utf8_lossy(&reason).into_owned())
}

/// Connecting side: sends `hello` with the job token and a fresh nonce, checks the accepting
/// side's proof, sends its own and waits for the verdict. Each side learns why the other refused
/// it ([`NetError::Refused`]). Any stream: TCP ports, and the Unix socket of the CUDA IPC
/// transport's control channel. Returns the keys that tag and check every later frame.
pub async fn send_hello<S: AsyncReadExt + AsyncWriteExt + Unpin>(
    stream: &mut S,
    auth: &JobAuth,
    hello: &Hello,
    deadline: Instant,
    peer: &str,
) -> Result<Session, NetError> {
    let what = "sending the handshake";
    let ours = auth.client_hello(hello).map_err(|e| NetError::Io {
        what: "drawing the handshake's nonce".into(),
        peer: peer.into(),
        source: io::Error::other(e.to_string()),
    })?;
    until(deadline, what, peer, async {
        write_frame(stream, ours.bytes()).await.map_err(|e| NetError::io(what, peer, e))?;
        let mut answer = [0u8; 1];
        stream.read_exact(&mut answer).await.map_err(|e| NetError::io("waiting for the handshake answer", peer, e))?;
        match answer[0] {
            HELLO_CHALLENGE => {}
            HELLO_REFUSED => {
                return Err(NetError::Refused { peer: peer.into(), reason: read_refusal(stream, peer).await? });
            }
            b => {
                return Err(NetError::Refused {
                    peer: peer.into(),
                    reason: format!("an unknown handshake answer {b}"),
                });
            }
        }
        let mut challenge = [0u8; CHALLENGE_LEN];
        stream
            .read_exact(&mut challenge)
            .await
            .map_err(|e| NetError::io("reading the handshake challenge", peer, e))?;
        let (proof, session) = match ours.answer(auth, &challenge) {
            Ok(p) => p,
            Err(reason) => {
                refuse(stream, &reason).await;
                return Err(NetError::Refused { peer: peer.into(), reason });
            }
        };
        let mut b = [0u8; 1 + PROOF_LEN];
        b[0] = HELLO_OK;
        b[1..].copy_from_slice(&proof);
        stream.write_all(&b).await.map_err(|e| NetError::io("sending the handshake proof", peer, e))?;
        stream.read_exact(&mut answer).await.map_err(|e| NetError::io("waiting for the handshake verdict", peer, e))?;
        if answer[0] == HELLO_OK {
            return Ok(session);
        }
        Err(NetError::Refused { peer: peer.into(), reason: read_refusal(stream, peer).await? })
    })
    .await
}

/// Accepting side: reads a [`Hello`], checks magic, version and token, challenges the peer to
/// prove it holds the epoch's key (proving it holds it too), and only then lets `check_extra`
/// look at what the peer claims. On any mismatch it sends the reason to the peer and returns
/// [`NetError::Refused`]; every refusal is counted in the `auth`'s [`Refusals`]. Returns the
/// peer's hello and the keys that tag and check every later frame.
pub async fn accept_hello(
    stream: &mut TcpStream,
    auth: &JobAuth,
    magic: [u8; 4],
    version: u16,
    deadline: Instant,
    check_extra: impl FnOnce(&Hello) -> Result<(), String>,
) -> Result<(Hello, Session), NetError> {
    let peer_addr = stream.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "?".into());
    accept_hello_on(stream, &peer_addr, auth, magic, version, deadline, check_extra).await
}

/// [`accept_hello`] on any stream; `peer` names the other end in errors (a Unix socket's peer
/// has no address).
pub async fn accept_hello_on<S: AsyncReadExt + AsyncWriteExt + Unpin>(
    stream: &mut S,
    peer: &str,
    auth: &JobAuth,
    magic: [u8; 4],
    version: u16,
    deadline: Instant,
    check_extra: impl FnOnce(&Hello) -> Result<(), String>,
) -> Result<(Hello, Session), NetError> {
    until(deadline, "handshaking", peer, async {
        let mut buf = Vec::new();
        read_frame(stream, &mut buf, 1 << 20).await.map_err(|e| NetError::io("reading the handshake", peer, e))?;
        let (hello, challenge) = match auth.open_hello(&buf, magic, version) {
            Ok(x) => x,
            Err(reason) => {
                refuse(stream, &reason).await;
                return Err(NetError::Refused { peer: peer.into(), reason });
            }
        };
        let mut b = [0u8; 1 + CHALLENGE_LEN];
        b[0] = HELLO_CHALLENGE;
        b[1..].copy_from_slice(challenge.bytes());
        stream.write_all(&b).await.map_err(|e| NetError::io("sending the handshake challenge", peer, e))?;
        let mut verdict = [0u8; 1];
        stream.read_exact(&mut verdict).await.map_err(|e| NetError::io("waiting for the handshake proof", peer, e))?;
        if verdict[0] != HELLO_OK {
            let reason = read_refusal(stream, peer).await?;
            return Err(NetError::Refused {
                peer: peer.into(),
                reason: format!("the peer refused this side: {reason}"),
            });
        }
        let mut proof = [0u8; PROOF_LEN];
        stream.read_exact(&mut proof).await.map_err(|e| NetError::io("reading the handshake proof", peer, e))?;
        let checked = challenge
            .verify(auth, &proof)
            .and_then(|session| check_extra(&hello).inspect_err(|_| auth.refusals.count(magic)).map(|()| session));
        match checked {
            Ok(session) => {
                stream
                    .write_all(&[HELLO_OK])
                    .await
                    .map_err(|e| NetError::io("answering the handshake", hello.peer.as_str(), e))?;
                Ok((hello, session))
            }
            Err(reason) => {
                refuse(stream, &reason).await;
                Err(NetError::Refused { peer: peer.into(), reason })
            }
        }
    })
    .await
}
