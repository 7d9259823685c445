//! TCP plumbing shared by every rlplane protocol (refit, transfer queue, control, fan-out):
//! deadlines, connecting with backoff, length-prefixed frames and the authenticated handshake.
//!
//! Every connection starts with a handshake that proves both sides hold the job epoch's key
//! ([`JobAuth`]) without sending it:
//!
//! 1. connecting side → one frame: [`Hello`] (4-byte protocol magic, protocol version, the job
//!    token, the peer's name, protocol bytes) and a fresh [`NONCE_LEN`]-byte nonce;
//! 2. accepting side: if magic, version or token differ, [`HELLO_REFUSED`] and the reason (a rank
//!    of another epoch or job is told so); else [`HELLO_CHALLENGE`], its own fresh nonce and its
//!    proof `HMAC-SHA256(key, label_s ‖ len ‖ hello ‖ nonce_s)`;
//! 3. connecting side: checks that proof (else refuses the listener, [`HELLO_REFUSED`] + reason),
//!    then [`HELLO_OK`] and its proof `HMAC-SHA256(key, label_c ‖ len ‖ hello ‖ nonce_s)`;
//! 4. accepting side: checks it, then the protocol's own checks, and answers [`HELLO_OK`] or
//!    [`HELLO_REFUSED`] + reason.
//!
//! Both proofs cover both nonces (the client's is inside the hello), so a recorded handshake
//! replayed to either side fails; the labels differ, so one side's proof never passes as the
//! other's. Nothing a peer sends is acted on before its proof checks out, and every refusal is
//! counted ([`Refusals`]). The same steps run on the CUDA IPC control channel's Unix socket
//! ([`accept_hello_on`], [`send_hello`]).

use std::collections::BTreeMap;
use std::io;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ring::hmac;
use ring::rand::SecureRandom;
use rlplane_api::WorkerPlan;
use rlplane_api::plan::{JOB_KEY_LEN, parse_job_key};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

/// Errors of the shared plumbing. Each names the peer and what was being done.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// A wait ran past its deadline.
    #[error("timed out after {secs:.1}s {what} (peer {peer})")]
    Timeout {
        /// What was being waited for.
        what: String,
        /// Peer address or name.
        peer: String,
        /// Seconds waited.
        secs: f64,
    },
    /// An I/O error.
    #[error("{what} (peer {peer}): {source}")]
    Io {
        /// What was being done.
        what: String,
        /// Peer address or name.
        peer: String,
        /// Cause.
        source: io::Error,
    },
    /// The peer closed the connection.
    #[error("peer {peer} closed the connection while {what}")]
    Closed {
        /// What was being done.
        what: String,
        /// Peer.
        peer: String,
    },
    /// The peer spoke another protocol, version, job or epoch, or sent a malformed frame.
    #[error("peer {peer} refused: {reason}")]
    Refused {
        /// Peer.
        peer: String,
        /// Why.
        reason: String,
    },
}

impl NetError {
    /// Wraps an I/O error, turning EOF and resets into [`NetError::Closed`] (a dead peer).
    pub fn io(what: impl Into<String>, peer: impl Into<String>, source: io::Error) -> NetError {
        let what = what.into();
        let peer = peer.into();
        match source.kind() {
            io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe => NetError::Closed { what, peer },
            _ => NetError::Io { what, peer, source },
        }
    }
}

/// Runs `fut` until `deadline`, naming what timed out; says every few seconds that it still waits
/// ([`crate::patience::wait_reporting`]).
pub async fn until<T, E>(
    deadline: Instant,
    what: &str,
    peer: &str,
    fut: impl Future<Output = Result<T, E>>,
) -> Result<T, NetError>
where
    E: Into<NetError>,
{
    match crate::patience::wait_reporting(deadline, || format!("{what} with {peer}"), fut).await {
        Ok(r) => r.map_err(Into::into),
        Err(waited) => Err(NetError::Timeout { what: what.into(), peer: peer.into(), secs: waited.as_secs_f64() }),
    }
}

impl From<std::convert::Infallible> for NetError {
    fn from(e: std::convert::Infallible) -> Self {
        match e {}
    }
}

/// Tunes a data socket: no Nagle delay, large kernel buffers for bulk streams.
pub fn tune(stream: &TcpStream) {
    let _ = stream.set_nodelay(true);
    let sock = socket2::SockRef::from(stream);
    let _ = sock.set_send_buffer_size(8 << 20);
    let _ = sock.set_recv_buffer_size(8 << 20);
}

/// Connects to `addr`, retrying with backoff (10 ms doubling to 500 ms) until `deadline`: the
/// peer may not be listening yet (pods and processes start in any order).
pub async fn connect_retry(addr: &str, deadline: Instant, what: &str) -> Result<TcpStream, NetError> {
    let start = Instant::now();
    let mut backoff = Duration::from_millis(10);
    let mut report = start + crate::patience::REPORT_EVERY;
    loop {
        let attempt = tokio::time::timeout_at(deadline, TcpStream::connect(addr)).await;
        if let Ok(Err(e)) = &attempt
            && Instant::now() >= report
        {
            // The peer may legitimately start late; a peer that never does must not go unseen.
            tracing::warn!(
                peer = addr,
                waited_s = start.elapsed().as_secs(),
                timeout_in_s = deadline.saturating_duration_since(Instant::now()).as_secs(),
                "still connecting for {what}: {e}"
            );
            report += crate::patience::REPORT_EVERY;
        }
        match attempt {
            Ok(Ok(s)) => {
                tune(&s);
                return Ok(s);
            }
            Ok(Err(e)) if Instant::now() + backoff >= deadline => {
                return Err(NetError::Timeout {
                    what: format!("connecting for {what} (last error: {e})"),
                    peer: addr.into(),
                    secs: start.elapsed().as_secs_f64(),
                });
            }
            Ok(Err(_)) => {
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_millis(500));
            }
            Err(_) => {
                return Err(NetError::Timeout {
                    what: format!("connecting for {what}"),
                    peer: addr.into(),
                    secs: start.elapsed().as_secs_f64(),
                });
            }
        }
    }
}

/// Binds a listener, with an error that names the address and the role.
pub async fn bind(addr: &str, what: &str) -> Result<TcpListener, NetError> {
    TcpListener::bind(addr).await.map_err(|e| NetError::Io {
        what: format!("binding {addr} for {what}"),
        peer: addr.into(),
        source: e,
    })
}

/// Accepts connections on `listener` until it fails, handing each (tuned) to `handle` on its own
/// task. Accept errors that say nothing about the listener (out of file descriptors, a peer that
/// reset before it was accepted) are logged and retried shortly, so the connections that exist
/// keep being served. `what` names the clients in logs and errors ("storage clients").
pub async fn serve_connections<F, Fut>(listener: TcpListener, what: &str, handle: F) -> Result<(), NetError>
where
    F: Fn(TcpStream) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let local = listener.local_addr().map(|a| a.to_string()).unwrap_or_default();
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                tune(&stream);
                tokio::spawn(handle(stream));
            }
            Err(e) if is_transient_accept_error(&e) => {
                tracing::warn!(error = %e, addr = %local, "accepting {what} failed; retrying");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => return Err(NetError::io(format!("accepting {what}"), local.as_str(), e)),
        }
    }
}

/// Reserves a loopback port for a service that a process started later will bind: a listener
/// holding it, to be dropped just before that process binds (holding it keeps two services of
/// one plan from getting the same port).
///
/// The port is taken below the system's ephemeral range where the system says where that is
/// (`ip_local_port_range`): a port from that range — what binding port 0 gives — can be grabbed
/// by any outgoing connection between the drop and the bind, and a starting job opens many.
pub fn reserve_loopback_port() -> io::Result<std::net::TcpListener> {
    let ephemeral_start = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(0);
    if ephemeral_start > 12_000 {
        for _ in 0..256 {
            let port = rand::random_range(10_000..ephemeral_start);
            if let Ok(l) = std::net::TcpListener::bind(("127.0.0.1", port)) {
                return Ok(l);
            }
        }
    }
    std::net::TcpListener::bind("127.0.0.1:0")
}

/// Accept errors that say nothing about the listener itself (too many open files, a peer that
/// reset before it was accepted): a server keeps accepting after them.
pub fn is_transient_accept_error(e: &io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(e.kind(), ConnectionAborted | ConnectionReset | Interrupted | WouldBlock)
        || matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM))
}

/// Largest control frame accepted; bulk payloads are streamed, never framed whole.
pub const MAX_FRAME: u32 = 64 << 20;

/// Frames up to this size go out in one write (one segment with TCP_NODELAY, so one wake-up of
/// the reader) rather than length and bytes separately.
const SMALL_FRAME: usize = 64 << 10;

/// Writes one frame: a little-endian u32 length, then the bytes.
pub async fn write_frame<W: AsyncWriteExt + Unpin>(w: &mut W, payload: &[u8]) -> io::Result<()> {
    let len =
        u32::try_from(payload.len()).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "frame too large"))?;
    if payload.len() <= SMALL_FRAME {
        let mut buf = Vec::with_capacity(4 + payload.len());
        buf.extend_from_slice(&len.to_le_bytes());
        buf.extend_from_slice(payload);
        return w.write_all(&buf).await;
    }
    w.write_all(&len.to_le_bytes()).await?;
    w.write_all(payload).await
}

/// Reads one frame into `buf` (reusing its allocation), refusing frames over `max` bytes.
pub async fn read_frame<R: AsyncReadExt + Unpin>(r: &mut R, buf: &mut Vec<u8>, max: u32) -> io::Result<()> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len).await?;
    let len = u32::from_le_bytes(len);
    if len > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame of {len} bytes exceeds the limit of {max}"),
        ));
    }
    buf.clear();
    buf.resize(len as usize, 0);
    r.read_exact(buf).await?;
    Ok(())
}

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
struct WireHello {
    hello: Hello,
    token: String,
    nonce: Vec<u8>,
}

impl WireHello {
    fn encode(&self) -> Vec<u8> {
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

    fn decode(b: &[u8]) -> Result<WireHello, String> {
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

/// Why a job key could not be loaded. Names the file and the fix; never shows the key.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// The key file could not be read.
    #[error(
        "cannot read the job key {path}: {source}; in a cluster the operator mounts the Secret `{secret}` \
         there (check that it exists and the pod's `job-key` volume); elsewhere write a key there, e.g. \
         `openssl rand -hex {len} > {path}`"
    )]
    Read {
        /// Path of the key file.
        path: String,
        /// The Secret that should hold it.
        secret: String,
        /// Key length in bytes.
        len: usize,
        /// Cause.
        source: io::Error,
    },
    /// The key file holds no usable key.
    #[error("the job key {path} is not a key: {reason}; write one with `openssl rand -hex {len} > {path}`")]
    Malformed {
        /// Path of the key file.
        path: String,
        /// What is wrong.
        reason: String,
        /// Key length in bytes.
        len: usize,
    },
    /// The system's random source failed.
    #[error("the system random source failed ({0})")]
    Random(String),
}

/// A fresh key ([`JobAuth::generate_key`]) written to a new file at `path` as
/// [`write_key_file`] writes it, after removing any file there: how `rlplane local` and the
/// benchmarks give their processes an epoch's key.
pub fn issue_key_file(path: &Path) -> io::Result<[u8; JOB_KEY_LEN]> {
    let key = JobAuth::generate_key().map_err(io::Error::other)?;
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    write_key_file(path, &key)?;
    Ok(key)
}

/// Writes `key` (as [`rlplane_api::plan::encode_job_key`] text) to a new file at `path` that only
/// this user can read: mode 0600 from its creation, so the key is never readable by others, not
/// even briefly. Fails if the file exists.
pub fn write_key_file(path: &Path, key: &[u8; JOB_KEY_LEN]) -> io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path)?;
    f.write_all(rlplane_api::plan::encode_job_key(key).as_bytes())
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
    pub fn answer(&self, auth: &JobAuth, challenge: &[u8]) -> Result<[u8; PROOF_LEN], String> {
        if challenge.len() != CHALLENGE_LEN
            || !auth.verify(SERVER_PROOF_LABEL, &self.bytes, &challenge[..NONCE_LEN], &challenge[NONCE_LEN..])
        {
            auth.refusals.count(self.magic);
            return Err("the listener did not prove it holds this job epoch's key: it is not a process of this \
                        job epoch (an old epoch's or another job's), or it was handed another key"
                .into());
        }
        let proof = auth.proof(CLIENT_PROOF_LABEL, &self.bytes, &challenge[..NONCE_LEN]);
        Ok(proof.as_ref().try_into().expect("HMAC-SHA256 tags are 32 bytes"))
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
    /// fresh nonce, so a recorded handshake does not pass twice). A failed check is counted.
    pub fn verify(&self, auth: &JobAuth, proof: &[u8]) -> Result<(), String> {
        if auth.verify(CLIENT_PROOF_LABEL, &self.hello, &self.challenge[..NONCE_LEN], proof) {
            return Ok(());
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
/// transport's control channel.
pub async fn send_hello<S: AsyncReadExt + AsyncWriteExt + Unpin>(
    stream: &mut S,
    auth: &JobAuth,
    hello: &Hello,
    deadline: Instant,
    peer: &str,
) -> Result<(), NetError> {
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
        let proof = match ours.answer(auth, &challenge) {
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
            return Ok(());
        }
        Err(NetError::Refused { peer: peer.into(), reason: read_refusal(stream, peer).await? })
    })
    .await
}

/// Accepting side: reads a [`Hello`], checks magic, version and token, challenges the peer to
/// prove it holds the epoch's key (proving it holds it too), and only then lets `check_extra`
/// look at what the peer claims. On any mismatch it sends the reason to the peer and returns
/// [`NetError::Refused`]; every refusal is counted in the `auth`'s [`Refusals`].
pub async fn accept_hello(
    stream: &mut TcpStream,
    auth: &JobAuth,
    magic: [u8; 4],
    version: u16,
    deadline: Instant,
    check_extra: impl FnOnce(&Hello) -> Result<(), String>,
) -> Result<Hello, NetError> {
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
) -> Result<Hello, NetError> {
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
            .and_then(|()| check_extra(&hello).inspect_err(|_| auth.refusals.count(magic)));
        match checked {
            Ok(()) => {
                stream
                    .write_all(&[HELLO_OK])
                    .await
                    .map_err(|e| NetError::io("answering the handshake", hello.peer.as_str(), e))?;
                Ok(hello)
            }
            Err(reason) => {
                refuse(stream, &reason).await;
                Err(NetError::Refused { peer: peer.into(), reason })
            }
        }
    })
    .await
}

#[cfg(test)]
mod tests {
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
        assert!(ch2.verify(&good, &bad_proof.unwrap()).is_err());
        // The right proof passes once; the same proof against a fresh challenge (a replay) fails.
        let proof = c.answer(&good, challenge.bytes()).unwrap();
        challenge.verify(&good, &proof).unwrap();
        let (_, fresh) = good.open_hello(c.bytes(), *b"TEST", 1).unwrap();
        assert!(fresh.verify(&good, &proof).is_err(), "a replayed proof must fail");
        // A listener's proof is not a client's proof.
        assert!(challenge.verify(&good, &challenge.bytes()[NONCE_LEN..]).is_err());
        assert_eq!(good.refusals().total(), 3);
        assert_eq!(other.refusals().total(), 1);
        assert!(!format!("{good:?}").contains("1, 1"), "Debug never shows the key");
    }

    async fn handshake(client: JobAuth, server: JobAuth) -> (Result<(), NetError>, Result<Hello, NetError>) {
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
        assert_eq!(ok_s.unwrap().peer, "p");
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
}
