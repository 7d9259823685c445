//! Frames over a stream socket (Unix or TCP), read and written by plain non-blocking system calls.
//!
//! A frame sent is in the kernel when [`FrameLink::send`] returns — no hand-off to another task —
//! and a caller polling for frames reads the socket itself, so a receiver that is already running
//! sees a frame as soon as it lands, without the I/O driver's thread having to wake first (on a
//! virtualized host a thread parked for a few milliseconds took 0.1–0.2 ms to wake,
//! docs/benchmarks.md). Two users whose messages are on a step's critical path: the CUDA IPC
//! transport's control channel (a zeromq channel through a socket task took 0.2–0.3 ms per
//! message there) and the coordinator's control channel, whose waits poll their sockets while a
//! reply is due ([`crate::hot_wait`]). A frame is a little-endian `u32` length, that many bytes and
//! the frame's tag, as [`crate::net::write_tagged_frame`] writes them: a link takes over a
//! connection after its handshake, with the handshake's [`Session`], and refuses any frame whose
//! tag does not check out ([`crate::net::mac`]).

use std::io::{self, Read, Write};
use std::net::TcpStream as StdTcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream as StdUnixStream;

use tokio::io::unix::AsyncFd;
use tokio::time::Instant;

use crate::hot_wait::{Next, Window};
use crate::net::mac::{Session, TAG_LEN};

/// The connected socket under a link.
enum Socket {
    Unix(StdUnixStream),
    Tcp(StdTcpStream),
}

impl Socket {
    fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Socket::Unix(s) => (&*s).read(buf),
            Socket::Tcp(s) => (&*s).read(buf),
        }
    }

    fn write(&self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Socket::Unix(s) => (&*s).write(buf),
            Socket::Tcp(s) => (&*s).write(buf),
        }
    }
}

impl AsRawFd for Socket {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            Socket::Unix(s) => s.as_raw_fd(),
            Socket::Tcp(s) => s.as_raw_fd(),
        }
    }
}

/// One end of a framed stream connection.
pub struct FrameLink {
    fd: AsyncFd<Socket>,
    /// Bytes read and not yet returned as frames, from `start`.
    inbound: Vec<u8>,
    start: usize,
    /// Bytes queued and not yet taken by the socket.
    outbound: Vec<u8>,
    max_frame: u32,
    session: Session,
}

impl FrameLink {
    /// Takes over a connected Unix stream after its handshake, which left `session`; frames over
    /// `max_frame` bytes are refused as malformed.
    pub fn unix(stream: tokio::net::UnixStream, max_frame: u32, session: Session) -> io::Result<FrameLink> {
        // `into_std` leaves the socket non-blocking.
        FrameLink::new(Socket::Unix(stream.into_std()?), max_frame, session)
    }

    /// Takes over a connected TCP stream, as [`FrameLink::unix`].
    pub fn tcp(stream: tokio::net::TcpStream, max_frame: u32, session: Session) -> io::Result<FrameLink> {
        FrameLink::new(Socket::Tcp(stream.into_std()?), max_frame, session)
    }

    fn new(socket: Socket, max_frame: u32, session: Session) -> io::Result<FrameLink> {
        // SAFETY: the socket owns its descriptor and keeps it, unchanged, until the `AsyncFd`
        // that owns the socket drops it.
        let fd = unsafe { AsyncFd::register(socket) }.map_err(|e| e.into_parts().1)?;
        Ok(FrameLink { fd, inbound: Vec::with_capacity(4096), start: 0, outbound: Vec::new(), max_frame, session })
    }

    /// Queues one frame made of `parts` and writes as much of what is queued as the socket
    /// takes now (all of it, unless the peer stopped reading).
    pub fn send(&mut self, parts: &[&[u8]]) -> io::Result<()> {
        self.queue(parts)?;
        self.flush().map(|_| ())
    }

    /// Queues one frame made of `parts` without writing it: frames queued together go out in
    /// one write at the next [`FrameLink::flush`] (so the peer finds them in one read).
    pub fn queue(&mut self, parts: &[&[u8]]) -> io::Result<()> {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        let len = u32::try_from(len)
            .ok()
            .filter(|&l| l <= self.max_frame)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, format!("a frame of {len} bytes")))?;
        self.outbound.extend_from_slice(&len.to_le_bytes());
        for p in parts {
            self.outbound.extend_from_slice(p);
        }
        let tag = self.session.send.tag(parts);
        self.outbound.extend_from_slice(&tag);
        Ok(())
    }

    /// Writes what is queued without waiting; true when nothing is left.
    pub fn flush(&mut self) -> io::Result<bool> {
        while !self.outbound.is_empty() {
            match self.fd.get_ref().write(&self.outbound) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    self.outbound.drain(..n);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(true)
    }

    /// Waits until everything queued is written.
    pub async fn flushed(&mut self) -> io::Result<()> {
        while !self.flush()? {
            let mut ready = self.fd.writable().await?;
            ready.clear_ready();
        }
        Ok(())
    }

    /// The next whole frame, reading what has arrived first if none is buffered; never waits.
    /// A peer that closed the connection is an `UnexpectedEof` error.
    pub fn try_recv(&mut self) -> io::Result<Option<Vec<u8>>> {
        if let Some(f) = self.buffered_frame()? {
            return Ok(Some(f));
        }
        if self.start > 0 {
            self.inbound.drain(..self.start);
            self.start = 0;
        }
        let mut chunk = [0u8; 16 << 10];
        loop {
            match self.fd.get_ref().read(&mut chunk) {
                Ok(0) => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the peer closed the connection")),
                Ok(n) => {
                    self.inbound.extend_from_slice(&chunk[..n]);
                    if n < chunk.len() {
                        break;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        self.buffered_frame()
    }

    fn buffered_frame(&mut self) -> io::Result<Option<Vec<u8>>> {
        let have = &self.inbound[self.start..];
        let Some(len) = have.get(..4).map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes"))) else {
            return Ok(None);
        };
        if len > self.max_frame {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("a frame of {len} bytes exceeds the limit of {}", self.max_frame),
            ));
        }
        let end = 4 + len as usize;
        if have.len() < end + TAG_LEN {
            return Ok(None);
        }
        let frame = &have[4..end];
        self.session.recv.check(&[frame], &have[end..end + TAG_LEN])?;
        let frame = frame.to_vec();
        self.start += end + TAG_LEN;
        Ok(Some(frame))
    }

    /// The next frame: polls for it inside `window` and parks on the socket outside it
    /// ([`crate::hot_wait`]); `None` once `deadline` (if any) passed without one.
    pub async fn recv(&mut self, window: Window, deadline: Option<Instant>) -> io::Result<Option<Vec<u8>>> {
        loop {
            if let Some(f) = self.try_recv()? {
                return Ok(Some(f));
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                return Ok(None);
            }
            match window.next(now) {
                Next::Poll => tokio::task::yield_now().await,
                Next::Park(until) => {
                    let wake = match (until, deadline) {
                        (Some(u), Some(d)) => Some(u.min(d)),
                        (u, d) => u.or(d),
                    };
                    match wake {
                        Some(w) => {
                            if let Ok(r) = tokio::time::timeout_at(w, self.readable()).await {
                                r?;
                            }
                        }
                        None => self.readable().await?,
                    }
                }
            }
        }
    }

    /// Closes the sending direction: the peer reads the end of the stream after what was sent.
    pub fn shutdown_write(&self) -> io::Result<()> {
        match self.fd.get_ref() {
            Socket::Unix(s) => s.shutdown(std::net::Shutdown::Write),
            Socket::Tcp(s) => s.shutdown(std::net::Shutdown::Write),
        }
    }

    /// Waits until the socket has something to read (or was closed). Spurious returns are
    /// possible: callers read with [`FrameLink::try_recv`] and wait again if nothing came.
    pub async fn readable(&self) -> io::Result<()> {
        let mut ready = self.fd.readable().await?;
        // Cleared before the caller reads: anything arriving after that read raises it again.
        ready.clear_ready();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn pair() -> (FrameLink, FrameLink) {
        let (a, b) = tokio::net::UnixStream::pair().unwrap();
        let (sa, sb) = Session::fixed_pair(1);
        (FrameLink::unix(a, 1 << 20, sa).unwrap(), FrameLink::unix(b, 1 << 20, sb).unwrap())
    }

    async fn recv(l: &mut FrameLink) -> Vec<u8> {
        loop {
            if let Some(f) = l.try_recv().unwrap() {
                return f;
            }
            tokio::time::timeout(Duration::from_secs(10), l.readable()).await.unwrap().unwrap();
        }
    }

    #[tokio::test]
    async fn frames_arrive_whole_and_in_order() {
        let (mut a, mut b) = pair();
        assert!(b.try_recv().unwrap().is_none(), "nothing sent yet");
        a.send(&[b"B", &7u64.to_le_bytes()]).unwrap();
        a.send(&[b"K", &[9u8; 5000]]).unwrap();
        a.send(&[]).unwrap();
        let first = recv(&mut b).await;
        assert_eq!(first[0], b'B');
        assert_eq!(u64::from_le_bytes(first[1..9].try_into().unwrap()), 7);
        let second = recv(&mut b).await;
        assert_eq!(second.len(), 5001);
        assert!(second[1..].iter().all(|&x| x == 9));
        assert!(recv(&mut b).await.is_empty());
    }

    #[tokio::test]
    async fn an_injected_or_altered_frame_is_refused() {
        let (mut a, mut b) = pair();
        // Written raw, as an attacker on the path would: a well-formed frame with a made-up tag.
        let mut forged = 3u32.to_le_bytes().to_vec();
        forged.extend_from_slice(b"END");
        forged.extend_from_slice(&[0u8; TAG_LEN]);
        assert_eq!(a.fd.get_ref().write(&forged).unwrap(), forged.len());
        let e = recv_err(&mut b).await;
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        assert!(e.to_string().contains("frame 0 of this connection failed its authentication tag"), "{e}");
        // A genuine frame altered on the way.
        let (mut a2, mut b2) = pair();
        a2.queue(&[b"version 7"]).unwrap();
        a2.outbound[4 + 8] = b'8';
        a2.flush().unwrap();
        assert_eq!(recv_err(&mut b2).await.kind(), io::ErrorKind::InvalidData);
        a.send(&[b"fine"]).unwrap();
    }

    async fn recv_err(l: &mut FrameLink) -> io::Error {
        loop {
            match l.try_recv() {
                Err(e) => return e,
                Ok(Some(f)) => panic!("a forged frame was accepted: {f:?}"),
                Ok(None) => tokio::time::timeout(Duration::from_secs(10), l.readable()).await.unwrap().unwrap(),
            }
        }
    }

    #[tokio::test]
    async fn a_peer_that_stops_reading_holds_frames_until_flushed() {
        let (mut a, mut b) = pair();
        // Far more than a socket buffer: `send` queues what the socket does not take.
        let big = vec![3u8; 900 << 10];
        for _ in 0..4 {
            a.send(&[&big]).unwrap();
        }
        assert!(!a.flush().unwrap(), "the socket cannot hold 3.6 MB unread");
        let reader = tokio::spawn(async move {
            let mut n = 0;
            for _ in 0..4 {
                n += recv(&mut b).await.len();
            }
            n
        });
        tokio::time::timeout(Duration::from_secs(10), a.flushed()).await.unwrap().unwrap();
        assert_eq!(reader.await.unwrap(), 4 * (900 << 10));
    }

    #[tokio::test]
    async fn recv_polls_inside_its_window_parks_outside_and_keeps_its_deadline() {
        use crate::hot_wait::Forecast;
        let (mut a, mut b) = pair();
        let mut due = Forecast::polling();
        due.learn(Duration::from_millis(30));
        let ms = Duration::from_millis;
        // Due, on time (inside the window), then late (after it, while parked), then never.
        for (after, expect) in [(ms(30), true), (ms(80), true), (ms(0), false)] {
            let start = Instant::now();
            let window = due.window(start);
            let sender = tokio::spawn(async move {
                if expect {
                    tokio::time::sleep(after).await;
                    a.send(&[b"cmd"]).unwrap();
                }
                a
            });
            let deadline = Some(start + if expect { Duration::from_secs(10) } else { ms(50) });
            let got = b.recv(window, deadline).await.unwrap();
            assert_eq!(got.is_some(), expect, "sent after {after:?}");
            if expect {
                assert_eq!(got.unwrap(), b"cmd");
                assert!(start.elapsed() >= after);
            } else {
                assert!(start.elapsed() >= ms(50), "returned before its deadline");
            }
            a = sender.await.unwrap();
        }
    }

    #[tokio::test]
    async fn oversized_frames_and_closed_peers_are_errors() {
        let (mut a, mut b) = pair();
        let e = a.send(&[&vec![0u8; (1 << 20) + 1]]).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        // A length over the limit, written raw.
        assert_eq!(a.fd.get_ref().write(&(2u32 << 20).to_le_bytes()).unwrap(), 4);
        tokio::time::timeout(Duration::from_secs(10), b.readable()).await.unwrap().unwrap();
        assert_eq!(b.try_recv().unwrap_err().kind(), io::ErrorKind::InvalidData);
        let (a, mut b) = pair();
        drop(a);
        tokio::time::timeout(Duration::from_secs(10), b.readable()).await.unwrap().unwrap();
        assert_eq!(b.try_recv().unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
    }
}
