//! Storage units: bulk columns in memory, with a byte capacity and backpressure.
//!
//! A [`StorageUnit`] holds each (partition, key, field) as a slice of the buffer it arrived in
//! (no copy per sample), counts value bytes against its capacity, and makes a put that does not
//! fit wait for a clear — up to the put timeout, then fail with a clear error. Nothing is ever
//! dropped to make room. [`StorageServer`] serves a unit over TCP; with placement ProducerLocal
//! the producer's own process hosts the unit, puts go straight into it, and consumers read from
//! it in one hop.
//!
//! Over TCP a put reserves its bytes *before* reading them, so a full unit stops reading and TCP
//! pushes back on the producer; if the reservation times out the unit reads and discards the body
//! (keeping the stream in step) and replies with the error.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

use super::codec::{self, Block, Body, ErrorCode, Header, Outgoing, ReadError, STORAGE_MAGIC, WIRE_VERSION};
use super::column::{Column, FieldSpec};
use rlplane_wire::net::{self, Connection, JobAuth, MacPool, NetError, RecordChecks};

/// Errors of a storage unit. Each names the unit and what to change.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum StorageError {
    /// The put is larger than the whole unit.
    #[error(
        "storage unit {unit}: a put of {needed} bytes can never fit its capacity of {capacity} bytes; \
         raise transferQueue.capacityBytes or put fewer samples at once"
    )]
    TooLarge {
        /// Unit.
        unit: u32,
        /// Bytes of the put.
        needed: u64,
        /// Capacity.
        capacity: u64,
    },
    /// The put waited for room until its timeout.
    #[error(
        "storage unit {unit} is full: a put of {needed} bytes waited {waited_s:.1}s for room ({used} of {capacity} bytes \
         held) and gave up; consumers must clear finished steps, or raise transferQueue.capacityBytes or putTimeoutSeconds"
    )]
    CapacityTimeout {
        /// Unit.
        unit: u32,
        /// Bytes of the put.
        needed: u64,
        /// Bytes held when it gave up.
        used: u64,
        /// Capacity.
        capacity: u64,
        /// Seconds waited.
        waited_s: f64,
    },
    /// A key, field or partition is not there.
    #[error("storage unit {unit}: {what}")]
    NotFound {
        /// Unit.
        unit: u32,
        /// What is missing.
        what: String,
    },
    /// A field's spec disagrees with what the unit holds, or a malformed request.
    #[error("storage unit {unit}: {what}")]
    BadRequest {
        /// Unit.
        unit: u32,
        /// What is wrong.
        what: String,
        /// Wire code.
        code: ErrorCode,
    },
}

impl StorageError {
    /// Wire error code.
    pub fn code(&self) -> ErrorCode {
        match self {
            StorageError::TooLarge { .. } => ErrorCode::TooLarge,
            StorageError::CapacityTimeout { .. } => ErrorCode::CapacityTimeout,
            StorageError::NotFound { .. } => ErrorCode::NotFound,
            StorageError::BadRequest { code, .. } => *code,
        }
    }
}

#[derive(Debug, Clone)]
struct Stored {
    bytes: Bytes,
    rows: u32,
}

#[derive(Debug, Default)]
struct PartitionData {
    schema: HashMap<String, FieldSpec>,
    /// key → field → bytes.
    samples: HashMap<String, HashMap<String, Stored>>,
    bytes: u64,
}

#[derive(Debug, Default)]
struct State {
    /// Committed plus reserved bytes.
    used: u64,
    partitions: HashMap<String, PartitionData>,
}

/// The stored bytes of one field for many samples: per-sample slices, ready for a vectored write.
#[derive(Debug, Clone)]
pub struct FieldSlices {
    /// Field spec.
    pub spec: FieldSpec,
    /// Per sample: its bytes (shared, not copied) and its row count.
    pub samples: Vec<(Bytes, u32)>,
}

impl FieldSlices {
    /// Total value bytes.
    pub fn nbytes(&self) -> u64 {
        self.samples.iter().map(|(b, _)| b.len() as u64).sum()
    }

    /// Row offsets (for ragged fields).
    pub fn offsets(&self) -> Vec<u64> {
        let mut v = Vec::with_capacity(self.samples.len() + 1);
        v.push(0);
        let mut acc = 0u64;
        for (_, r) in &self.samples {
            acc += *r as u64;
            v.push(acc);
        }
        v
    }
}

/// A storage unit: bulk columns in memory with a byte capacity.
#[derive(Debug)]
pub struct StorageUnit {
    id: u32,
    capacity: u64,
    state: Mutex<State>,
    freed: tokio::sync::Notify,
}

/// Bytes reserved for a put; released on drop unless committed.
#[derive(Debug)]
pub struct Reservation<'a> {
    unit: &'a StorageUnit,
    bytes: u64,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if self.bytes > 0 {
            let mut st = self.unit.lock();
            st.used -= self.bytes;
            drop(st);
            self.unit.freed.notify_waiters();
        }
    }
}

impl StorageUnit {
    /// A unit with id `id` holding at most `capacity` value bytes.
    pub fn new(id: u32, capacity: u64) -> StorageUnit {
        StorageUnit { id, capacity, state: Mutex::new(State::default()), freed: tokio::sync::Notify::new() }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // Every method validates before it mutates, so a poisoned lock holds consistent state.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Unit id.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// Capacity in bytes.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Bytes held (and reserved by puts in flight).
    pub fn used(&self) -> u64 {
        self.lock().used
    }

    /// The partitions held, by name.
    pub fn partitions(&self) -> Vec<String> {
        self.lock().partitions.keys().cloned().collect()
    }

    /// Samples held in `partition`.
    pub fn samples(&self, partition: &str) -> usize {
        self.lock().partitions.get(partition).map(|p| p.samples.len()).unwrap_or(0)
    }

    /// Reserves `bytes`, waiting until `deadline` for room (backpressure).
    pub async fn reserve(&self, bytes: u64, deadline: Instant) -> Result<Reservation<'_>, StorageError> {
        if bytes > self.capacity {
            return Err(StorageError::TooLarge { unit: self.id, needed: bytes, capacity: self.capacity });
        }
        let start = Instant::now();
        loop {
            let notified = self.freed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut st = self.lock();
                if st.used + bytes <= self.capacity {
                    st.used += bytes;
                    return Ok(Reservation { unit: self, bytes });
                }
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return Err(StorageError::CapacityTimeout {
                    unit: self.id,
                    needed: bytes,
                    used: self.used(),
                    capacity: self.capacity,
                    waited_s: start.elapsed().as_secs_f64(),
                });
            }
        }
    }

    /// Stores `columns` for `keys` of `partition` under a reservation of their value bytes.
    /// A (key, field) already present is replaced (its old bytes are freed). Checks every field
    /// against the partition's schema first: on error nothing is stored.
    pub fn commit(
        &self,
        mut reservation: Reservation<'_>,
        partition: &str,
        keys: &[String],
        columns: &[Column],
    ) -> Result<u64, StorageError> {
        let bad = |what: String, code: ErrorCode| StorageError::BadRequest { unit: self.id, what, code };
        let total: u64 = columns.iter().map(|c| c.nbytes() as u64).sum();
        if total != reservation.bytes {
            return Err(bad(
                format!("reserved {} bytes for a put of {total} bytes", reservation.bytes),
                ErrorCode::BadRequest,
            ));
        }
        for c in columns {
            if c.len() != keys.len() {
                return Err(bad(
                    format!("column `{}` has {} samples for {} keys", c.name(), c.len(), keys.len()),
                    ErrorCode::BadRequest,
                ));
            }
        }
        for (i, c) in columns.iter().enumerate() {
            if columns[..i].iter().any(|d| d.name() == c.name()) {
                return Err(bad(format!("field `{}` appears twice in one put", c.name()), ErrorCode::BadRequest));
            }
        }
        let mut seen = std::collections::HashSet::with_capacity(keys.len());
        if let Some(k) = keys.iter().find(|k| !seen.insert(k.as_str())) {
            return Err(bad(format!("key `{k}` appears twice in one put"), ErrorCode::BadRequest));
        }
        let mut st = self.lock();
        if let Some(p) = st.partitions.get(partition) {
            for c in columns {
                if let Some(s) = p.schema.get(c.name())
                    && !s.same_shape(c.spec())
                {
                    return Err(bad(
                        format!(
                            "field `{}` of partition `{partition}` is held as {:?} (ragged {}, rows {:?}) but was sent as {:?} (ragged {}, rows {:?})",
                            c.name(),
                            s.dtype,
                            s.ragged,
                            s.inner,
                            c.spec().dtype,
                            c.spec().ragged,
                            c.spec().inner
                        ),
                        ErrorCode::Schema,
                    ));
                }
            }
        }
        let p = st.partitions.entry(partition.to_string()).or_default();
        let mut replaced = 0u64;
        for c in columns {
            p.schema.entry(c.name().to_string()).or_insert_with(|| c.spec().clone());
        }
        for (i, key) in keys.iter().enumerate() {
            let fields = p.samples.entry(key.clone()).or_default();
            for c in columns {
                let new = Stored { bytes: c.sample_bytes(i), rows: c.rows(i) };
                if let Some(old) = fields.insert(c.name().to_string(), new) {
                    replaced += old.bytes.len() as u64;
                }
            }
        }
        p.bytes = p.bytes + total - replaced;
        st.used -= replaced;
        reservation.bytes = 0;
        drop(st);
        if replaced > 0 {
            self.freed.notify_waiters();
        }
        Ok(total)
    }

    /// Puts columns in-process (the producer-local path): reserve, waiting up to `deadline`, then
    /// commit. Returns the value bytes stored.
    pub async fn put(
        &self,
        partition: &str,
        keys: &[String],
        columns: &[Column],
        deadline: Instant,
    ) -> Result<u64, StorageError> {
        let total: u64 = columns.iter().map(|c| c.nbytes() as u64).sum();
        let r = self.reserve(total, deadline).await?;
        self.commit(r, partition, keys, columns)
    }

    /// The stored bytes of `fields` for `keys`, in order (shared, not copied).
    pub fn get(&self, partition: &str, keys: &[String], fields: &[String]) -> Result<Vec<FieldSlices>, StorageError> {
        let st = self.lock();
        let nf = |what: String| StorageError::NotFound { unit: self.id, what };
        let p =
            st.partitions.get(partition).ok_or_else(|| nf(format!("partition `{partition}` holds nothing here")))?;
        let mut out = Vec::with_capacity(fields.len());
        for f in fields {
            let spec =
                p.schema.get(f).ok_or_else(|| nf(format!("field `{f}` of partition `{partition}` is not here")))?;
            let mut samples = Vec::with_capacity(keys.len());
            for k in keys {
                let s = p
                    .samples
                    .get(k)
                    .and_then(|fs| fs.get(f))
                    .ok_or_else(|| nf(format!("key `{k}` field `{f}` of partition `{partition}` is not here")))?;
                samples.push((s.bytes.clone(), s.rows));
            }
            out.push(FieldSlices { spec: spec.clone(), samples });
        }
        Ok(out)
    }

    /// Drops a partition; returns the bytes freed. Wakes puts waiting for room.
    pub fn clear(&self, partition: &str) -> u64 {
        let mut st = self.lock();
        let freed = st.partitions.remove(partition).map(|p| p.bytes).unwrap_or(0);
        st.used -= freed;
        drop(st);
        if freed > 0 {
            self.freed.notify_waiters();
        }
        freed
    }
}

/// Serves a [`StorageUnit`] over TCP.
#[derive(Clone, Debug)]
pub struct StorageServer {
    unit: Arc<StorageUnit>,
    auth: JobAuth,
    put_timeout: Duration,
    macs: MacPool,
}

impl StorageServer {
    /// A server for `unit`, refusing peers without the job epoch's key (`auth`), failing puts that wait longer than
    /// `put_timeout` for room.
    pub fn new(unit: Arc<StorageUnit>, auth: &JobAuth, put_timeout: Duration) -> StorageServer {
        StorageServer { unit, auth: auth.clone(), put_timeout, macs: MacPool::new("tq-unit", 2) }
    }

    /// The unit.
    pub fn unit(&self) -> &Arc<StorageUnit> {
        &self.unit
    }

    /// Serves until the listener fails. One task per connection; requests on one connection are
    /// answered in order, so a client may pipeline them.
    pub async fn serve(self, listener: TcpListener) -> Result<(), NetError> {
        net::serve_connections(listener, "storage clients", move |stream| {
            let this = self.clone();
            async move {
                if let Err(e) = this.serve_connection(stream).await {
                    tracing::debug!(unit = this.unit.id, error = %e, "storage connection ended");
                }
            }
        })
        .await
    }

    async fn serve_connection(&self, mut stream: TcpStream) -> Result<(), NetError> {
        let deadline = Instant::now() + Duration::from_secs(30);
        let (hello, session) =
            net::accept_hello(&mut stream, &self.auth, STORAGE_MAGIC, WIRE_VERSION, deadline, |_| Ok(())).await?;
        let peer = hello.peer;
        self.serve_stream(&mut Connection { stream, session }, &peer).await
    }

    /// Serves requests on an established (handshaken) connection until it closes or goes out of
    /// step.
    async fn serve_stream(&self, conn: &mut Connection, peer: &str) -> Result<(), NetError> {
        let mut buf = Vec::new();
        loop {
            let (header, body) = match codec::read_message(&mut conn.stream, &mut conn.session.recv, &mut buf).await {
                Ok(m) => m,
                Err(ReadError::Io(e)) => return Err(NetError::io("reading a request", peer, e)),
                Err(ReadError::Codec(e)) => {
                    let _ = self.reply_error(conn, 0, ErrorCode::Malformed, e.to_string()).await;
                    return Err(NetError::Refused { peer: peer.into(), reason: e.to_string() });
                }
            };
            let rid = header.request_id;
            if header.token != self.auth.token() {
                if let Some(block) = body.block() {
                    codec::skip_buffers(&mut conn.stream, &mut conn.session.recv, block)
                        .await
                        .map_err(|e| read_err(peer, e))?;
                }
                let msg = format!(
                    "job token `{}` does not match `{}`: the client belongs to another job or epoch",
                    header.token,
                    self.auth.token()
                );
                self.reply_error(conn, rid, ErrorCode::Token, msg)
                    .await
                    .map_err(|e| NetError::io("replying", peer, e))?;
                continue;
            }
            let result = match body {
                Body::Put { partition, keys, block } => {
                    match self.handle_put(conn, &partition, &keys, &block, peer).await {
                        Ok(r) => r,
                        Err(NetError::Refused { peer, reason }) => {
                            // A malformed buffer (a record whose tag failed): say why, then close.
                            let _ = self.reply_error(conn, rid, ErrorCode::Malformed, reason.clone()).await;
                            return Err(NetError::Refused { peer, reason });
                        }
                        Err(e) => return Err(e),
                    }
                }
                Body::Get { partition, keys, fields } => match self.unit.get(&partition, &keys, &fields) {
                    Ok(slices) => {
                        write_data(conn, &self.macs, &self.header(rid), &slices)
                            .await
                            .map_err(|e| NetError::io("sending data", peer, e))?;
                        continue;
                    }
                    Err(e) => Err(e),
                },
                Body::ClearUnit { partition } => Ok(Body::Cleared { freed: self.unit.clear(&partition), units: 1 }),
                Body::Ping => {
                    Ok(Body::Pong { unit: self.unit.id, used: self.unit.used(), capacity: self.unit.capacity })
                }
                other => {
                    if let Some(block) = other.block() {
                        codec::skip_buffers(&mut conn.stream, &mut conn.session.recv, block)
                            .await
                            .map_err(|e| read_err(peer, e))?;
                    }
                    Err(StorageError::BadRequest {
                        unit: self.unit.id,
                        what: format!("message kind {} is not a storage request", other.kind()),
                        code: ErrorCode::BadRequest,
                    })
                }
            };
            let reply = result.unwrap_or_else(|e| Body::Error { code: e.code(), message: e.to_string() });
            codec::write_message(&mut conn.stream, &mut conn.session.send, &self.header(rid), &reply)
                .await
                .map_err(|e| NetError::io("replying", peer, e))?;
        }
    }

    fn header(&self, request_id: u32) -> Header {
        Header { version: WIRE_VERSION, request_id, token: self.auth.token().to_string() }
    }

    async fn reply_error(
        &self,
        conn: &mut Connection,
        rid: u32,
        code: ErrorCode,
        message: String,
    ) -> std::io::Result<()> {
        codec::write_message(
            &mut conn.stream,
            &mut conn.session.send,
            &self.header(rid),
            &Body::Error { code, message },
        )
        .await
    }

    /// Reserves, reads, validates and commits a put. Errors that leave the stream in step become
    /// the reply; errors that do not end the connection.
    async fn handle_put(
        &self,
        conn: &mut Connection,
        partition: &str,
        keys: &[String],
        block: &Block,
        peer: &str,
    ) -> Result<Result<Body, StorageError>, NetError> {
        let total = block.value_bytes();
        let reservation = match self.unit.reserve(total, Instant::now() + self.put_timeout).await {
            Ok(r) => r,
            Err(e) => {
                codec::skip_buffers(&mut conn.stream, &mut conn.session.recv, block)
                    .await
                    .map_err(|e| read_err(peer, e))?;
                return Ok(Err(e));
            }
        };
        let mut raw = Vec::with_capacity(block.columns.len());
        // Declared after `raw`, so dropped first: a drop waits for the checks reading its buffers.
        let mut checks = RecordChecks::new();
        let link = &mut (&mut conn.stream, &mut conn.session.recv, &self.macs);
        for (spec, len) in &block.columns {
            let offsets = if spec.ragged {
                // SAFETY: the buffer goes into `raw`, owned by this future, until the checks finish.
                let b = unsafe { codec::read_buffer_later(link, &mut checks, (block.n as u64 + 1) * 8, &spec.name) };
                Some(b.await.map_err(|e| read_err(peer, e))?)
            } else {
                None
            };
            // SAFETY: as above.
            let values = unsafe { codec::read_buffer_later(link, &mut checks, *len, &spec.name) };
            raw.push((spec, offsets, values.await.map_err(|e| read_err(peer, e))?));
        }
        codec::finish_checks(&mut checks).await.map_err(|e| read_err(peer, e))?;
        let mut columns = Vec::with_capacity(raw.len());
        for (spec, offsets, values) in raw {
            let bad = |what: String| StorageError::BadRequest { unit: self.unit.id, what, code: ErrorCode::Malformed };
            let offsets = match offsets {
                Some(b) => {
                    match codec::decode_offsets(
                        &spec.name,
                        &b,
                        block.n,
                        values.len() as u64,
                        spec.row_bytes().unwrap_or(1),
                    ) {
                        Ok(o) => o,
                        Err(e) => return Ok(Err(bad(e.to_string()))),
                    }
                }
                None => Vec::new(),
            };
            match Column::from_parts(spec.clone(), block.n as usize, Bytes::from(values), offsets) {
                Ok(c) => columns.push(c),
                Err(e) => return Ok(Err(bad(e.to_string()))),
            }
        }
        Ok(self.unit.commit(reservation, partition, keys, &columns).map(|bytes| Body::Stored { bytes }))
    }
}

fn read_err(peer: &str, e: ReadError) -> NetError {
    match e {
        ReadError::Io(e) => NetError::io("reading a request's buffers", peer, e),
        ReadError::Codec(e) => NetError::Refused { peer: peer.into(), reason: e.to_string() },
    }
}

/// Writes a [`Body::Data`] reply: the block, then per field its offsets (ragged) and its values
/// as one buffer frame made of every sample's stored slice (vectored, no copy).
pub async fn write_data(
    conn: &mut Connection,
    pool: &MacPool,
    header: &Header,
    fields: &[FieldSlices],
) -> std::io::Result<()> {
    let n = fields.first().map(|f| f.samples.len()).unwrap_or(0) as u32;
    let block = Block { n, columns: fields.iter().map(|f| (f.spec.clone(), f.nbytes())).collect() };
    let offsets: Vec<Vec<u8>> =
        fields.iter().map(|f| if f.spec.ragged { codec::encode_offsets(&f.offsets()) } else { Vec::new() }).collect();
    let mut out = Outgoing::new(header, &Body::Data { block });
    for (f, off) in fields.iter().zip(offsets) {
        if f.spec.ragged {
            out.buffer(vec![Bytes::from(off)]);
        }
        out.buffer(f.samples.iter().map(|(b, _)| b.clone()).collect());
    }
    out.write(&mut conn.stream, &mut conn.session.send, pool).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn col(n: usize, len: usize) -> Column {
        let rows: Vec<Vec<i64>> = (0..n).map(|i| vec![i as i64; len]).collect();
        let refs: Vec<&[i64]> = rows.iter().map(|r| r.as_slice()).collect();
        Column::ragged("ids", &refs)
    }

    fn keys(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("k{i}")).collect()
    }

    #[tokio::test]
    async fn put_waits_for_a_clear_then_succeeds_and_times_out_without_one() {
        let unit = Arc::new(StorageUnit::new(3, 1000));
        // 10 samples × 10 × 8 bytes = 800 bytes.
        unit.put("a", &keys(10), &[col(10, 10)], Instant::now() + Duration::from_secs(1)).await.unwrap();
        assert_eq!(unit.used(), 800);
        let e = unit.put("b", &keys(10), &[col(10, 10)], Instant::now() + Duration::from_millis(50)).await.unwrap_err();
        assert!(matches!(e, StorageError::CapacityTimeout { unit: 3, needed: 800, .. }), "{e}");
        assert!(e.to_string().contains("capacityBytes"), "{e}");
        assert_eq!(unit.used(), 800, "a failed put reserves nothing");
        let u2 = unit.clone();
        let waiter = tokio::spawn(async move {
            u2.put("b", &keys(10), &[col(10, 10)], Instant::now() + Duration::from_secs(5)).await
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiter.is_finished(), "the put waits while the unit is full");
        assert_eq!(unit.clear("a"), 800);
        assert_eq!(waiter.await.unwrap().unwrap(), 800);
        assert_eq!(unit.samples("a"), 0);
        assert_eq!(unit.samples("b"), 10);
    }

    #[tokio::test]
    async fn too_large_fails_at_once_and_overwrite_frees_the_old_bytes() {
        let unit = StorageUnit::new(0, 1000);
        let e = unit.put("a", &keys(20), &[col(20, 10)], Instant::now() + Duration::from_secs(5)).await.unwrap_err();
        assert!(matches!(e, StorageError::TooLarge { needed: 1600, .. }), "{e}");
        unit.put("a", &keys(2), &[col(2, 10)], Instant::now()).await.unwrap();
        unit.put("a", &keys(2), &[col(2, 5)], Instant::now()).await.unwrap();
        assert_eq!(unit.used(), 80);
        let got = unit.get("a", &keys(2), &["ids".into()]).unwrap();
        assert_eq!(got[0].samples[1].1, 5);
        assert_eq!(unit.clear("a"), 80);
        assert_eq!(unit.used(), 0);
    }

    #[tokio::test]
    async fn schema_conflict_stores_nothing() {
        let unit = StorageUnit::new(0, 1 << 20);
        unit.put("a", &keys(2), &[col(2, 3)], Instant::now()).await.unwrap();
        let other = Column::ragged::<i32>("ids", &[&[1], &[2]]);
        let e = unit.put("a", &["x".into(), "y".into()], &[other], Instant::now()).await.unwrap_err();
        assert!(e.to_string().contains("field `ids`"), "{e}");
        assert_eq!(unit.samples("a"), 2);
        assert_eq!(unit.used(), 48);
    }
}
