//! Sockets: deadlines, connecting with backoff, binding and serving listeners.

use std::io;
use std::time::Duration;

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
