//! NCCL transport (split mode): one communicator per sender — the sender (rank 0, the root) and
//! every generation rank of its refit group.
//!
//! Each bucket is one NCCL group holding **one broadcast per piece**, straight from the sender's
//! tensor into the receiver's tensor wherever the span is contiguous: the engine stages only
//! strided spans (tensor-parallel column slices) and nothing is packed for contiguous ones. That
//! is the design measured at 0.996 of the raw broadcast ceiling in GPU-NOTES.md, against 0.90–0.92
//! for the usual pack → broadcast → unpack.
//!
//! Broadcasts run on the transport's NCCL stream, pack/unpack copies on its copy stream, and
//! tickets are CUDA events. The two streams are not chained on the GPU: the engine already waits
//! for a pack before submitting its bucket, for a bucket before unpacking it and for an unpack
//! before reusing its buffer, and a GPU-side chain would also hold bucket k+1 behind bucket k. Rendezvous: the sender listens on its refit port, hands every receiver the unique
//! id (only after the authenticated handshake of [`rlplane_wire::net`] and the plan-identity check:
//! [`publish_unique_id`], [`fetch_unique_id`]) and that TCP connection then carries the
//! version at `begin` and the receivers' confirmations at `end`. The communicator is non-blocking:
//! every wait polls it and the event, and a deadline or a dead peer aborts it.

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaEvent, CudaStream};
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

use super::{Piece, Transport, TransportError, coalesce, gpu_err};
use crate::gpu::Gpu;
use crate::gpu::nccl::{Comm, UniqueId, group_end, group_start};
use crate::gpu::tensors::DeviceStaging;
use crate::memory::{Copy2d, MemorySpace};
use crate::plan::PlanIdentity;
use rlplane_wire::net::{self, Hello, JobAuth};

/// Handshake magic of the NCCL rendezvous.
pub const MAGIC: [u8; 4] = *b"RNCL";
/// Version of the rendezvous protocol. 2: every message after the handshake carries its tag. 3:
/// tags are AES-256-GMAC.
pub const VERSION: u16 = 3;
/// Bytes of an NCCL unique id.
pub const UNIQUE_ID_LEN: usize = 128;
const DONE: u8 = 0xD0;
/// Pieces smaller than this travel packed: a broadcast has a fixed cost of microseconds that
/// norm and bias tensors of a few KiB do not repay.
pub const SMALL_PIECE: u64 = 1 << 20;

/// A completion: a CUDA event, and for copies the start event (to time the copy engine).
pub struct NcclTicket {
    end: Arc<CudaEvent>,
    start: Option<CudaEvent>,
}

/// One member's side of a sender's NCCL communicator.
pub struct NcclTransport {
    name: String,
    root: bool,
    gpu: Gpu,
    comm: Comm,
    nccl_stream: Arc<CudaStream>,
    copy_stream: Arc<CudaStream>,
    /// Root: one connection per receiver; receiver: the connection to the root.
    peers: Vec<Rendezvous>,
    /// Root: receivers whose confirmation arrived while the root still waited on its buckets.
    confirmed: Vec<bool>,
    copy_busy: Duration,
    timeout: Duration,
    aborted: Option<String>,
}

impl NcclTransport {
    /// The sender's side: accepts `receivers` (by process name) on `listener`, gives each the
    /// communicator's unique id and its rank, and joins the communicator as rank 0.
    ///
    /// `rotation` rotates the receivers' ranks (and so NCCL's ring order: root → rank 1 → rank 2
    /// ...). With several senders, sender `k` rotating by `k` makes each receiver the first hop
    /// of a different sender's ring, so forwarding is spread over the receivers instead of the
    /// first receiver forwarding every sender's bytes.
    #[allow(clippy::too_many_arguments)]
    pub async fn root(
        name: &str,
        gpu: &Gpu,
        listener: &TcpListener,
        receivers: &[String],
        rotation: usize,
        identity: &PlanIdentity,
        auth: &JobAuth,
        timeout: Duration,
        deadline: Instant,
    ) -> Result<NcclTransport, TransportError> {
        let id = UniqueId::new().map_err(|e| gpu_err("creating the NCCL unique id", e))?;
        let world = receivers.len() + 1;
        let peers = publish_unique_id(name, listener, receivers, rotation, identity, auth, &id.0, deadline).await?;
        Self::join(name, true, gpu, &id, 0, world, peers, timeout, deadline).await
    }

    /// A receiver's side: fetches the unique id from the sender's rendezvous address (retrying
    /// until `deadline`) and joins the communicator.
    #[allow(clippy::too_many_arguments)]
    pub async fn receiver(
        name: &str,
        me: &str,
        gpu: &Gpu,
        root_addr: &str,
        identity: &PlanIdentity,
        auth: &JobAuth,
        timeout: Duration,
        deadline: Instant,
    ) -> Result<NcclTransport, TransportError> {
        let (id, rank, world, s) = fetch_unique_id(me, root_addr, identity, auth, deadline).await?;
        Self::join(name, false, gpu, &UniqueId(id), rank, world, vec![s], timeout, deadline).await
    }

    #[allow(clippy::too_many_arguments)]
    async fn join(
        name: &str,
        root: bool,
        gpu: &Gpu,
        id: &UniqueId,
        rank: usize,
        world: usize,
        peers: Vec<Rendezvous>,
        timeout: Duration,
        deadline: Instant,
    ) -> Result<NcclTransport, TransportError> {
        let gpu2 = gpu.clone();
        let id = *id;
        let dl = deadline.into_std();
        // Communicator init polls until every rank joined; keep it off the async threads.
        let comm = tokio::task::spawn_blocking(move || Comm::init(&gpu2, &id, rank, world, dl))
            .await
            .map_err(|e| TransportError::Config(format!("NCCL init task: {e}")))?
            .map_err(|e| gpu_err(name, e))?;
        let nccl_stream = gpu.stream().map_err(|e| gpu_err(name, e))?;
        let copy_stream = gpu.stream().map_err(|e| gpu_err(name, e))?;
        Ok(NcclTransport {
            name: name.into(),
            root,
            gpu: gpu.clone(),
            comm,
            nccl_stream,
            copy_stream,
            confirmed: vec![false; peers.len()],
            peers,
            copy_busy: Duration::ZERO,
            timeout,
            aborted: None,
        })
    }

    fn check_usable(&self) -> Result<(), TransportError> {
        match &self.aborted {
            Some(reason) => Err(TransportError::Aborted { name: self.name.clone(), reason: reason.clone() }),
            None => Ok(()),
        }
    }

    /// A peer whose rendezvous connection closed. While buckets move nothing else travels on it
    /// but a receiver's confirmation, which a root may see early: it is kept for `end`.
    fn dead_peer(&mut self) -> Option<String> {
        for (i, p) in self.peers.iter_mut().enumerate() {
            if self.confirmed[i] {
                continue;
            }
            match p.try_recv(1) {
                Ok(None) => {}
                Ok(Some(b)) if self.root && b[0] == DONE => self.confirmed[i] = true,
                Ok(Some(b)) => return Some(format!("{} (sent {:#x} in the middle of a refit)", p.peer, b[0])),
                Err(e) if e.kind() == std::io::ErrorKind::InvalidData => return Some(format!("{} ({e})", p.peer)),
                Err(_) => return Some(p.peer.clone()),
            }
        }
        None
    }

    fn fail(&mut self, what: String) -> TransportError {
        self.abort(&what);
        TransportError::Io { peer: self.name.clone(), what, detail: "communicator aborted".into() }
    }
}

impl Transport for NcclTransport {
    type Ticket = NcclTicket;
    type Staging = DeviceStaging;

    fn name(&self) -> &str {
        &self.name
    }

    fn is_root(&self) -> bool {
        self.root
    }

    fn reaches(&self, space: MemorySpace) -> bool {
        space == MemorySpace::Device { ordinal: self.gpu.ordinal() as u32 }
    }

    fn alloc_staging(&mut self, bytes: u64) -> Result<DeviceStaging, TransportError> {
        self.gpu.alloc(bytes as usize).map(DeviceStaging).map_err(|e| gpu_err("allocating a staging buffer", e))
    }

    async fn begin(&mut self, version: Option<u64>, deadline: Instant) -> Result<u64, TransportError> {
        self.check_usable()?;
        match version {
            Some(v) => {
                for p in &mut self.peers {
                    p.send(&v.to_le_bytes(), "announcing the version", deadline).await?;
                }
                Ok(v)
            }
            None => {
                let b = self.peers[0].recv(8, "waiting for the refit's version", deadline).await?;
                Ok(u64::from_le_bytes(b[..].try_into().expect("8 bytes")))
            }
        }
    }

    unsafe fn submit(&mut self, _bucket: u32, pieces: &[Piece]) -> Result<NcclTicket, TransportError> {
        self.check_usable()?;
        self.gpu.bind().map_err(|e| gpu_err(&self.name, e))?;
        group_start().map_err(|e| gpu_err(&self.name, e))?;
        let mut failed = None;
        // One broadcast per piece, runs of tiny ones merged into one (see `stage_below`).
        for span in coalesce(pieces, SMALL_PIECE) {
            // SAFETY: the engine keeps every piece's region valid until the ticket completes; a
            // merged span lies in one staging buffer.
            if let Err(e) = unsafe { self.comm.broadcast(span.addr, span.addr, span.len, 0, &self.nccl_stream) } {
                failed = Some(e);
                break;
            }
        }
        let ended = group_end();
        if let Some(e) = failed.map(Err).unwrap_or(ended).err() {
            return Err(self.fail(format!("enqueueing broadcasts: {e}")));
        }
        let dl = std::time::Instant::now() + self.timeout;
        if let Err(e) = self.comm.wait_ready(dl, "launching broadcasts") {
            return Err(self.fail(e.to_string()));
        }
        let ev = Arc::new(self.gpu.record_event(&self.nccl_stream, false).map_err(|e| gpu_err(&self.name, e))?);
        Ok(NcclTicket { end: ev, start: None })
    }

    unsafe fn copy(&mut self, copies: &[Copy2d]) -> Result<NcclTicket, TransportError> {
        self.check_usable()?;
        // SAFETY: regions valid until the ticket completes (engine contract).
        let (start, end) = unsafe { self.gpu.copy_regions(copies, &self.copy_stream) }
            .map_err(|e| gpu_err("a pack/unpack copy", e))?;
        Ok(NcclTicket { end: Arc::new(end), start: Some(start) })
    }

    async fn wait(&mut self, ticket: NcclTicket, deadline: Instant) -> Result<(), TransportError> {
        self.check_usable()?;
        let began = Instant::now();
        loop {
            match ticket.end.try_is_complete() {
                Ok(true) => break,
                Ok(false) => {}
                Err(e) => return Err(self.fail(format!("waiting for a bucket: {e}"))),
            }
            if let Err(e) = self.comm.poll() {
                return Err(self.fail(format!("NCCL reported {e}")));
            }
            // Over NVLink NCCL itself may never notice a dead peer; its rendezvous connection,
            // which the kernel closes when the process dies, does at once.
            if let Some(peer) = self.dead_peer() {
                self.abort("a peer died");
                return Err(TransportError::Closed {
                    peer,
                    what: "a refit was in flight (communicator aborted)".into(),
                });
            }
            if Instant::now() >= deadline {
                self.abort("timeout");
                return Err(TransportError::Timeout {
                    peer: self.name.clone(),
                    what: "waiting for a bucket on the GPU".into(),
                    secs: began.elapsed().as_secs_f64(),
                });
            }
            tokio::task::yield_now().await;
        }
        if let Some(start) = ticket.start
            && let Ok(ms) = start.elapsed_ms(&ticket.end)
        {
            self.copy_busy += Duration::from_secs_f64(ms as f64 / 1e3);
        }
        Ok(())
    }

    async fn end(&mut self, version: u64, deadline: Instant) -> Result<(), TransportError> {
        self.check_usable()?;
        let _ = version;
        if self.root {
            let early = std::mem::replace(&mut self.confirmed, vec![false; self.peers.len()]);
            for (p, early) in self.peers.iter_mut().zip(early) {
                if early {
                    continue;
                }
                let b = p.recv(1, "waiting for a receiver's confirmation", deadline).await?;
                if b[0] != DONE {
                    return Err(TransportError::Protocol {
                        peer: p.peer.clone(),
                        detail: format!("confirmation byte {:#x}", b[0]),
                    });
                }
            }
        } else {
            self.peers[0].send(&[DONE], "confirming the refit", deadline).await?;
        }
        Ok(())
    }

    fn abort(&mut self, reason: &str) {
        if self.aborted.is_none() {
            self.aborted = Some(reason.to_string());
            self.comm.abort();
            if self.gpu.bind().is_ok() {
                // After the abort no kernel of the communicator runs; let the copies finish so no
                // memory handed to us is touched after we return.
                let _ = self.copy_stream.synchronize();
                let _ = self.nccl_stream.synchronize();
            }
        }
    }

    fn copy_busy(&self) -> Duration {
        self.copy_busy
    }

    fn stage_below(&self) -> u64 {
        SMALL_PIECE
    }
}

/// The rendezvous of the sender (rank 0): accepts `receivers` (by process name) on `listener` and
/// gives each that proves it holds the job epoch's key, and belongs to this stream, the
/// communicator's unique id `id`, its rank and the world size. A refused peer learns nothing (the
/// id is sent only after its proof checks out) and is counted in `auth`'s refusals. Returns the
/// receivers' connections by rank − 1.
#[allow(clippy::too_many_arguments)]
pub async fn publish_unique_id(
    name: &str,
    listener: &TcpListener,
    receivers: &[String],
    rotation: usize,
    identity: &PlanIdentity,
    auth: &JobAuth,
    id: &[u8; UNIQUE_ID_LEN],
    deadline: Instant,
) -> Result<Vec<Rendezvous>, TransportError> {
    let world = receivers.len() + 1;
    let mut peers: Vec<Option<Rendezvous>> = (0..receivers.len()).map(|_| None).collect();
    let mut joined = 0;
    while joined < receivers.len() {
        let (mut s, _) = net::until(deadline, "waiting for NCCL receivers", name, async {
            listener.accept().await.map_err(|e| net::NetError::io("accepting an NCCL receiver", name, e))
        })
        .await?;
        net::tune(&s);
        let hello = net::accept_hello(&mut s, auth, MAGIC, VERSION, deadline, |h| {
            let theirs = PlanIdentity::decode(&h.extra).ok_or("malformed plan identity")?;
            if &theirs != identity {
                return Err(identity.mismatch("the sender", &theirs, &h.peer));
            }
            if !receivers.contains(&h.peer) {
                return Err(format!("`{}` is not a receiver of this sender", h.peer));
            }
            Ok(())
        })
        .await;
        let (hello, mut session) = match hello {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!(error = %e, "refused an NCCL rendezvous");
                continue;
            }
        };
        let at = receivers.iter().position(|r| r == &hello.peer).expect("checked");
        let rank = (at + receivers.len() - rotation % receivers.len()) % receivers.len() + 1;
        let mut msg = Vec::with_capacity(UNIQUE_ID_LEN + 8);
        msg.extend_from_slice(id);
        msg.extend_from_slice(&(rank as u32).to_le_bytes());
        msg.extend_from_slice(&(world as u32).to_le_bytes());
        net::write_tagged_frame(&mut s, &mut session.send, &msg)
            .await
            .map_err(|e| net::NetError::io("sending the NCCL id", hello.peer.as_str(), e))?;
        if peers[rank - 1].is_none() {
            joined += 1;
        }
        peers[rank - 1] = Some(Rendezvous::new(hello.peer, s, session));
    }
    Ok(peers.into_iter().map(|p| p.expect("every receiver joined")).collect())
}

/// A receiver's side of the rendezvous: connects to the sender's `root_addr` (retrying until
/// `deadline`), proves it holds the job epoch's key (and checks that the sender does), and
/// returns the unique id, its rank, the world size and the connection.
pub async fn fetch_unique_id(
    me: &str,
    root_addr: &str,
    identity: &PlanIdentity,
    auth: &JobAuth,
    deadline: Instant,
) -> Result<([u8; UNIQUE_ID_LEN], usize, usize, Rendezvous), TransportError> {
    let mut s = net::connect_retry(root_addr, deadline, "the NCCL rendezvous").await?;
    let hello = Hello { magic: MAGIC, version: VERSION, peer: me.into(), extra: identity.encode().to_vec() };
    let mut session = net::send_hello(&mut s, auth, &hello, deadline, root_addr).await?;
    let mut buf = Vec::new();
    net::until(deadline, "receiving the NCCL unique id", root_addr, async {
        net::read_tagged_frame(&mut s, &mut session.recv, &mut buf, 1024)
            .await
            .map_err(|e| net::NetError::io("receiving the NCCL id", root_addr, e))
    })
    .await?;
    if buf.len() != UNIQUE_ID_LEN + 8 {
        return Err(TransportError::Protocol {
            peer: root_addr.into(),
            detail: format!("an NCCL id message of {} bytes", buf.len()),
        });
    }
    let id: [u8; UNIQUE_ID_LEN] = buf[..UNIQUE_ID_LEN].try_into().expect("128 bytes");
    let rank = u32::from_le_bytes(buf[UNIQUE_ID_LEN..UNIQUE_ID_LEN + 4].try_into().expect("4 bytes")) as usize;
    let world = u32::from_le_bytes(buf[UNIQUE_ID_LEN + 4..].try_into().expect("4 bytes")) as usize;
    Ok((id, rank, world, Rendezvous::new(root_addr.into(), s, session)))
}

/// A rendezvous connection kept for the communicator's life: versions, confirmations and liveness,
/// every message tagged ([`net::mac`]).
pub struct Rendezvous {
    /// The peer's name (a receiver) or address (the root).
    peer: String,
    stream: TcpStream,
    session: net::Session,
    /// Bytes of a message read before the rest of it arrived.
    inbound: Vec<u8>,
}

impl Rendezvous {
    fn new(peer: String, stream: TcpStream, session: net::Session) -> Rendezvous {
        Rendezvous { peer, stream, session, inbound: Vec::new() }
    }

    /// Sends `msg` and its tag.
    async fn send(&mut self, msg: &[u8], what: &str, deadline: Instant) -> Result<(), TransportError> {
        let (peer, s, mac) = (self.peer.as_str(), &mut self.stream, &mut self.session.send);
        net::until(deadline, what, peer, async {
            net::write_tagged(s, mac, msg).await.map_err(|e| net::NetError::io(what, peer, e))
        })
        .await?;
        Ok(())
    }

    /// Receives a message of `len` bytes and checks its tag.
    async fn recv(&mut self, len: usize, what: &str, deadline: Instant) -> Result<Vec<u8>, TransportError> {
        let want = len + net::TAG_LEN;
        let (peer, s, inbound) = (self.peer.as_str(), &mut self.stream, &mut self.inbound);
        let have = inbound.len();
        inbound.resize(want, 0);
        net::until(deadline, what, peer, async {
            s.read_exact(&mut inbound[have..]).await.map_err(|e| net::NetError::io(what, peer, e))
        })
        .await?;
        self.open(len).map_err(|e| net::NetError::io(what, &self.peer, e).into())
    }

    /// A message of `len` bytes if it has arrived whole, without waiting.
    fn try_recv(&mut self, len: usize) -> std::io::Result<Option<Vec<u8>>> {
        let want = len + net::TAG_LEN;
        while self.inbound.len() < want {
            let mut b = [0u8; 64];
            let room = want - self.inbound.len();
            match self.stream.try_read(&mut b[..room.min(64)]) {
                Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => self.inbound.extend_from_slice(&b[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(None),
                Err(e) => return Err(e),
            }
        }
        self.open(len).map(Some)
    }

    fn open(&mut self, len: usize) -> std::io::Result<Vec<u8>> {
        let b = std::mem::take(&mut self.inbound);
        self.session.recv.check(&[&b[..len]], &b[len..])?;
        Ok(b[..len].to_vec())
    }
}
