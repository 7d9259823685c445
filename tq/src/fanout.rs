//! Leader fetch and fan-out: only a data-parallel shard's leader (tp = cp = pp = 0) fetches its
//! batch from the transfer queue; it then sends the batch to the shard's followers, shapes first
//! (the metadata and every column's length, so a receiver can allocate), then the data.
//!
//! [`FanoutSender`] / [`FanoutReceiver`] are the seam: the CPU transport here is TCP on the
//! leader's `ports.fanout` rendezvous; the GPU transport (an NCCL broadcast over the fan-out
//! group, shapes first the same way) plugs in behind the same traits. Every follower answers one
//! byte once it has the whole batch, so a broadcast returns only when every follower has it.

use std::collections::BTreeSet;
use std::time::Duration;

use bytes::Bytes;
use rlplane_api::WorkerPlan;
use tokio::net::TcpListener;
use tokio::time::Instant;

use super::TqError;
use super::client::TqClient;
use super::codec::{self, Block, Body, FANOUT_MAGIC, Header, Outgoing, ReadError, WIRE_VERSION};
use super::column::{Batch, BatchMeta, Column};
use rlplane_wire::net::{self, Connection, Hello, JobAuth, MacPool, NetError, RecordChecks};

/// Sends a batch to every follower of a fan-out group.
pub trait FanoutSender {
    /// Sends `batch` to every follower; returns once each has all of it.
    fn broadcast(&mut self, batch: &Batch) -> impl Future<Output = Result<(), TqError>> + Send;
}

/// Receives the batches a leader sends.
pub trait FanoutReceiver {
    /// Receives the next batch.
    fn receive(&mut self) -> impl Future<Output = Result<Batch, TqError>> + Send;
}

/// Byte a follower answers once it has a whole batch.
const RECEIVED: u8 = 0;

/// The leader's side of the TCP fan-out.
#[derive(Debug)]
pub struct TcpFanoutLeader {
    token: String,
    followers: Vec<(String, Connection)>,
    macs: MacPool,
}

impl TcpFanoutLeader {
    /// Accepts every follower named in `followers` on `listener` (in any order), refusing peers
    /// without the job epoch's key (of another job or epoch) and peers that are not members.
    pub async fn accept(
        listener: &TcpListener,
        auth: &JobAuth,
        followers: &[String],
        deadline: Instant,
    ) -> Result<TcpFanoutLeader, TqError> {
        let expected: BTreeSet<&str> = followers.iter().map(|s| s.as_str()).collect();
        let mut joined: Vec<(String, Connection)> = Vec::new();
        let local = listener.local_addr().map(|a| a.to_string()).unwrap_or_default();
        while joined.len() < expected.len() {
            let waiting: Vec<&str> = expected.iter().copied().filter(|n| !joined.iter().any(|(j, _)| j == n)).collect();
            let what = format!("waiting for fan-out followers {waiting:?}");
            let (mut s, _) = net::until(deadline, &what, &local, async {
                listener.accept().await.map_err(|e| NetError::io("accepting fan-out followers", local.as_str(), e))
            })
            .await?;
            net::tune(&s);
            let already: Vec<String> = joined.iter().map(|(n, _)| n.clone()).collect();
            let check = |h: &Hello| {
                if !expected.contains(h.peer.as_str()) {
                    return Err(format!("`{}` is not a follower of this fan-out group ({expected:?})", h.peer));
                }
                if already.contains(&h.peer) {
                    return Err(format!("`{}` joined this fan-out group twice", h.peer));
                }
                Ok(())
            };
            match net::accept_hello(&mut s, auth, FANOUT_MAGIC, WIRE_VERSION, deadline, check).await {
                Ok((h, session)) => joined.push((h.peer, Connection { stream: s, session })),
                // A stranger is refused (and told why), a peer that fails its handshake is
                // dropped; keep waiting for the members until the deadline.
                Err(NetError::Refused { peer, reason }) => tracing::warn!(%peer, %reason, "fan-out peer refused"),
                Err(e) => tracing::warn!(error = %e, "fan-out handshake failed"),
            }
        }
        joined.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(TcpFanoutLeader { token: auth.token().into(), followers: joined, macs: MacPool::new("fanout", 2) })
    }

    /// Binds the leader's fan-out port from the plan and accepts the group's followers.
    pub async fn from_plan(
        plan: &WorkerPlan,
        process: u32,
        auth: &JobAuth,
        deadline: Instant,
    ) -> Result<TcpFanoutLeader, TqError> {
        let group = plan.fanout_group_of(process).filter(|g| g.leader == process).ok_or_else(|| {
            TqError::input(
                format!("process {process} leads no fan-out group"),
                "only a data-parallel leader (tp = cp = pp = 0) accepts followers",
            )
        })?;
        let port = plan.process(process).ports.fanout.ok_or_else(|| {
            TqError::input(format!("leader {} has no fan-out port", plan.process(process).name), "rebuild the plan")
        })?;
        let listener = net::bind(&plan.bind_address(process, port), "the fan-out group").await?;
        let followers: Vec<String> =
            group.members.iter().filter(|&&m| m != process).map(|&m| plan.process(m).name.clone()).collect();
        Self::accept(&listener, auth, &followers, deadline).await
    }

    /// Names of the followers.
    pub fn followers(&self) -> Vec<&str> {
        self.followers.iter().map(|(n, _)| n.as_str()).collect()
    }
}

impl FanoutSender for TcpFanoutLeader {
    async fn broadcast(&mut self, batch: &Batch) -> Result<(), TqError> {
        let n = batch.meta.len();
        if let Some(c) = batch.columns.iter().find(|c| c.len() != n) {
            return Err(TqError::input(
                format!("column `{}` has {} samples but the batch metadata {n}", c.name(), c.len()),
                "broadcast a batch as `get` returned it",
            ));
        }
        let block = Block {
            n: n as u32,
            columns: batch.columns.iter().map(|c| (c.spec().clone(), c.nbytes() as u64)).collect(),
        };
        let h = Header { version: WIRE_VERSION, request_id: 0, token: self.token.clone() };
        let mut out = Outgoing::new(&h, &Body::Fanout { meta: batch.meta.clone(), block });
        for c in &batch.columns {
            if c.spec().ragged {
                out.buffer(vec![Bytes::from(codec::encode_offsets(c.offsets()))]);
            }
            out.buffer(vec![c.values().clone()]);
        }
        let (out, macs) = (&out, &self.macs);
        let sends = self.followers.iter_mut().map(|(name, s)| async move {
            out.write(&mut s.stream, &mut s.session.send, macs)
                .await
                .map_err(|e| NetError::io("fanning out a batch", name.as_str(), e))?;
            let mut ack = Vec::new();
            net::read_tagged_frame(&mut s.stream, &mut s.session.recv, &mut ack, 1)
                .await
                .map_err(|e| NetError::io("waiting for a follower's receipt", name.as_str(), e))?;
            if ack != [RECEIVED] {
                return Err(TqError::Protocol { peer: name.clone(), what: format!("receipt {ack:?}") });
            }
            Ok(())
        });
        futures::future::try_join_all(sends).await.map(|_| ())
    }
}

/// A follower's side of the TCP fan-out.
#[derive(Debug)]
pub struct TcpFanoutFollower {
    leader: String,
    conn: Connection,
    max_bytes: u64,
    macs: MacPool,
}

impl TcpFanoutFollower {
    /// Largest batch a follower accepts by default (its buffers are allocated from the shapes).
    pub const DEFAULT_MAX_BYTES: u64 = 64 << 30;

    /// Connects to the leader at `addr` as `name`.
    pub async fn connect(
        addr: &str,
        auth: &JobAuth,
        name: &str,
        deadline: Instant,
    ) -> Result<TcpFanoutFollower, TqError> {
        let mut stream = net::connect_retry(addr, deadline, "the fan-out leader").await?;
        let hello = Hello { magic: FANOUT_MAGIC, version: WIRE_VERSION, peer: name.into(), extra: vec![] };
        let session = net::send_hello(&mut stream, auth, &hello, deadline, addr).await?;
        Ok(TcpFanoutFollower {
            leader: addr.into(),
            conn: Connection { stream, session },
            max_bytes: Self::DEFAULT_MAX_BYTES,
            macs: MacPool::new("fanout", 2),
        })
    }

    /// Connects to this follower's leader from the plan.
    pub async fn from_plan(
        plan: &WorkerPlan,
        process: u32,
        auth: &JobAuth,
        deadline: Instant,
    ) -> Result<TcpFanoutFollower, TqError> {
        let group = plan.fanout_group_of(process).filter(|g| g.leader != process).ok_or_else(|| {
            TqError::input(
                format!("process {process} follows no fan-out group"),
                "only data-parallel followers (tp, cp or pp ≠ 0) receive a fan-out",
            )
        })?;
        let port = plan.process(group.leader).ports.fanout.ok_or_else(|| {
            TqError::input(
                format!("leader {} has no fan-out port", plan.process(group.leader).name),
                "rebuild the plan",
            )
        })?;
        let addr = plan.address(group.leader, port);
        Self::connect(&addr, auth, &plan.process(process).name, deadline).await
    }

    /// Sets the largest batch accepted.
    pub fn with_max_bytes(mut self, max: u64) -> TcpFanoutFollower {
        self.max_bytes = max;
        self
    }
}

impl FanoutReceiver for TcpFanoutFollower {
    async fn receive(&mut self) -> Result<Batch, TqError> {
        let peer = self.leader.clone();
        let bad = |what: String| TqError::Protocol { peer: peer.clone(), what };
        let mut buf = Vec::new();
        let (meta, block): (BatchMeta, Block) =
            match codec::read_message(&mut self.conn.stream, &mut self.conn.session.recv, &mut buf).await {
                Ok((_, Body::Fanout { meta, block })) => (meta, block),
                Ok((_, other)) => return Err(bad(format!("a message of kind {} instead of a batch", other.kind()))),
                Err(ReadError::Io(e)) => return Err(NetError::io("receiving a batch", peer.as_str(), e).into()),
                Err(ReadError::Codec(e)) => return Err(bad(e.to_string())),
            };
        let total: u64 = block.buffer_lens().iter().fold(0u64, |a, &b| a.saturating_add(b));
        if total > self.max_bytes {
            return Err(bad(format!("a batch of {total} bytes, over this follower's limit of {}", self.max_bytes)));
        }
        let rd = |e| match e {
            ReadError::Io(e) => TqError::from(NetError::io("receiving a batch", peer.as_str(), e)),
            ReadError::Codec(e) => bad(e.to_string()),
        };
        // Every buffer first, each one's checks beside the reading of the next; nothing is decoded
        // before all of them checked out. `raw` is declared before `checks`, so dropped after it
        // (a drop waits for the checks reading its buffers).
        let mut raw = Vec::with_capacity(block.columns.len());
        let mut checks = RecordChecks::new();
        let link = &mut (&mut self.conn.stream, &mut self.conn.session.recv, &self.macs);
        for (spec, len) in &block.columns {
            let offsets = if spec.ragged {
                // SAFETY: the buffer goes into `raw`, owned by this future, until the checks finish.
                let b = unsafe { codec::read_buffer_later(link, &mut checks, (block.n as u64 + 1) * 8, &spec.name) };
                Some(b.await.map_err(rd)?)
            } else {
                None
            };
            // SAFETY: as above.
            let values = unsafe { codec::read_buffer_later(link, &mut checks, *len, &spec.name) };
            raw.push((spec, offsets, values.await.map_err(rd)?));
        }
        codec::finish_checks(&mut checks).await.map_err(rd)?;
        let mut columns = Vec::with_capacity(raw.len());
        for (spec, offsets, values) in raw {
            let offsets = match offsets {
                Some(b) => {
                    codec::decode_offsets(&spec.name, &b, block.n, values.len() as u64, spec.row_bytes().unwrap_or(1))
                        .map_err(|e| bad(e.to_string()))?
                }
                None => Vec::new(),
            };
            columns.push(
                Column::from_parts(spec.clone(), block.n as usize, Bytes::from(values), offsets)
                    .map_err(|e| bad(e.to_string()))?,
            );
        }
        net::write_tagged_frame(&mut self.conn.stream, &mut self.conn.session.send, &[RECEIVED])
            .await
            .map_err(|e| NetError::io("acknowledging a batch", peer.as_str(), e))?;
        Ok(Batch { meta, columns })
    }
}

/// A leader's step: fetch the shard's batch from the transfer queue, fan it out, return it.
pub async fn leader_fetch<S: FanoutSender>(
    client: &TqClient,
    sender: &mut S,
    meta: &BatchMeta,
    fields: &[&str],
) -> Result<Batch, TqError> {
    let batch = client.get(meta, fields).await?;
    sender.broadcast(&batch).await?;
    Ok(batch)
}

/// How long followers and leaders wait for each other by default.
pub const DEFAULT_RENDEZVOUS: Duration = Duration::from_secs(120);
