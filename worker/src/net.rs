//! TCP plumbing shared by every rlplane protocol (refit, transfer queue, control, fan-out):
//! deadlines, connecting with backoff, length-prefixed frames and the token handshake.
//!
//! Every connection starts with a [`Hello`] from the connecting side: a 4-byte protocol magic, the
//! protocol version, the job token (epoch-stamped, from the WorkerPlan) and the peer's name. The
//! accepting side answers with one byte ([`HELLO_OK`], or an error frame) so that a refused peer
//! learns why. A rank of another epoch or job presents another token and is refused.

use std::io;
use std::time::Duration;

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

/// Runs `fut` until `deadline`, naming what timed out.
pub async fn until<T, E>(
    deadline: Instant,
    what: &str,
    peer: &str,
    fut: impl Future<Output = Result<T, E>>,
) -> Result<T, NetError>
where
    E: Into<NetError>,
{
    let start = Instant::now();
    match tokio::time::timeout_at(deadline, fut).await {
        Ok(r) => r.map_err(Into::into),
        Err(_) => Err(NetError::Timeout { what: what.into(), peer: peer.into(), secs: start.elapsed().as_secs_f64() }),
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
    loop {
        let attempt = tokio::time::timeout_at(deadline, TcpStream::connect(addr)).await;
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

/// Byte the accepting side sends when it accepts a [`Hello`].
pub const HELLO_OK: u8 = 0;
/// Byte the accepting side sends before an error frame when it refuses a [`Hello`].
pub const HELLO_REFUSED: u8 = 1;

/// The first message on every connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    /// Protocol magic, e.g. `*b"RFIT"`.
    pub magic: [u8; 4],
    /// Protocol version.
    pub version: u16,
    /// Job token (epoch-stamped).
    pub token: String,
    /// The connecting peer's name (e.g. `gen-3`).
    pub peer: String,
    /// Protocol-specific bytes (e.g. a plan hash).
    pub extra: Vec<u8>,
}

impl Hello {
    fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(16 + self.token.len() + self.peer.len() + self.extra.len());
        v.extend_from_slice(&self.magic);
        v.extend_from_slice(&self.version.to_le_bytes());
        for s in [self.token.as_bytes(), self.peer.as_bytes(), &self.extra] {
            v.extend_from_slice(&(s.len() as u32).to_le_bytes());
            v.extend_from_slice(s);
        }
        v
    }

    fn decode(b: &[u8]) -> Result<Hello, String> {
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
        Ok(Hello { magic, version, token, peer, extra })
    }
}

/// Connecting side: sends `hello`, waits for the answer. A refusal becomes [`NetError::Refused`]
/// with the accepting side's reason.
pub async fn send_hello(stream: &mut TcpStream, hello: &Hello, deadline: Instant, peer: &str) -> Result<(), NetError> {
    let what = "sending the handshake";
    until(deadline, what, peer, async {
        write_frame(stream, &hello.encode()).await.map_err(|e| NetError::io(what, peer, e))?;
        let mut answer = [0u8; 1];
        stream.read_exact(&mut answer).await.map_err(|e| NetError::io("waiting for the handshake answer", peer, e))?;
        if answer[0] == HELLO_OK {
            return Ok(());
        }
        let mut reason = Vec::new();
        read_frame(stream, &mut reason, 64 << 10).await.map_err(|e| NetError::io("reading the refusal", peer, e))?;
        Err(NetError::Refused { peer: peer.into(), reason: String::from_utf8_lossy(&reason).into_owned() })
    })
    .await
}

/// Accepting side: reads a [`Hello`] and checks magic, version and token. On a mismatch it sends
/// the reason to the peer and returns [`NetError::Refused`]; `check_extra` may refuse too.
pub async fn accept_hello(
    stream: &mut TcpStream,
    magic: [u8; 4],
    version: u16,
    token: &str,
    deadline: Instant,
    check_extra: impl FnOnce(&Hello) -> Result<(), String>,
) -> Result<Hello, NetError> {
    let peer_addr = stream.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "?".into());
    let what = "reading the handshake";
    let mut buf = Vec::new();
    until(deadline, what, &peer_addr, async {
        read_frame(stream, &mut buf, 1 << 20).await.map_err(|e| NetError::io(what, peer_addr.as_str(), e))
    })
    .await?;
    let verdict = Hello::decode(&buf).and_then(|h| {
        if h.magic != magic {
            return Err(format!(
                "protocol {:?} where {:?} was expected",
                String::from_utf8_lossy(&h.magic),
                String::from_utf8_lossy(&magic)
            ));
        }
        if h.version != version {
            return Err(format!(
                "protocol version {} where {version} was expected; run matching worker images",
                h.version
            ));
        }
        if h.token != token {
            return Err(format!(
                "job token `{}` does not match `{token}`: the peer belongs to another job or epoch",
                h.token
            ));
        }
        check_extra(&h)?;
        Ok(h)
    });
    match verdict {
        Ok(h) => {
            stream
                .write_all(&[HELLO_OK])
                .await
                .map_err(|e| NetError::io("answering the handshake", h.peer.as_str(), e))?;
            Ok(h)
        }
        Err(reason) => {
            let _ = stream.write_all(&[HELLO_REFUSED]).await;
            let _ = write_frame(stream, reason.as_bytes()).await;
            let _ = stream.flush().await;
            Err(NetError::Refused { peer: peer_addr, reason })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello(token: &str) -> Hello {
        Hello { magic: *b"TEST", version: 1, token: token.into(), peer: "p".into(), extra: vec![1, 2, 3] }
    }

    #[test]
    fn hello_round_trips_and_rejects_truncation() {
        let h = hello("e0-abc");
        let b = h.encode();
        assert_eq!(Hello::decode(&b).unwrap(), h);
        for cut in 0..b.len() {
            assert!(Hello::decode(&b[..cut]).is_err(), "cut at {cut}");
        }
    }

    #[tokio::test]
    async fn token_mismatch_is_refused_with_the_reason_on_both_sides() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let deadline = Instant::now() + Duration::from_secs(5);
        let server = tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            accept_hello(&mut s, *b"TEST", 1, "e1-good", deadline, |_| Ok(())).await
        });
        let mut c = connect_retry(&addr, deadline, "test").await.unwrap();
        let err = send_hello(&mut c, &hello("e0-stale"), deadline, &addr).await.unwrap_err();
        assert!(err.to_string().contains("another job or epoch"), "{err}");
        let server_err = server.await.unwrap().unwrap_err();
        assert!(matches!(server_err, NetError::Refused { .. }));
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
}
