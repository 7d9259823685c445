//! The transfer-queue client: put, claim, get, ack, write-back, clear.
//!
//! One client per process. It keeps one connection to the controller and one per storage unit,
//! batches every multi-key request into one request per unit (pipelined in chunks on that
//! unit's connection, units in parallel), and writes columns with vectored writes straight from
//! their buffers. A process that hosts a storage unit itself (placement ProducerLocal) puts into
//! it in-process: no copy and no socket, and consumers read it in one hop.
//!
//! `get` returns samples grouped by storage unit (in the metadata's order within each unit); the
//! returned [`Batch::meta`] gives that order. Each column is one contiguous buffer that the
//! sockets read into directly.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use bytes::Bytes;
use rlplane_api::WorkerPlan;
use rlplane_api::plan::ProcessRole;
use rlplane_api::spec::TqPlacement;
use tokio::time::Instant;

use super::TqError;
use super::codec::{self, Block, Body, CONTROLLER_MAGIC, ErrorCode, Header, Outgoing, ReadError, WIRE_VERSION};
use super::column::{ABSENT, Batch, BatchMeta, Column, FieldSpec, SampleTags};
use super::controller::{AckReport, Claim, ClearReport, connect_unit};
use super::storage::{FieldSlices, StorageUnit};
use rlplane_wire::net::{self, Connection, FrameMac, Hello, JobAuth, MacPool, NetError, RecordChecks};

/// Whether this process may write back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WriteRole {
    /// May write back (a data-parallel leader, a generation rank, a tool).
    Writer,
    /// A data-parallel follower: its shard's leader writes; its own write-backs are refused.
    Follower {
        /// The leader's process name.
        leader: String,
    },
}

/// Settings of a [`TqClient`].
#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// The job epoch's token and key, proven on every connection.
    pub auth: JobAuth,
    /// This process's name (e.g. `gen-3`), for the peers' logs and errors.
    pub name: String,
    /// Controller address.
    pub controller: String,
    /// Storage units: id → address.
    pub units: BTreeMap<u32, String>,
    /// Where puts go: this process's own unit (ProducerLocal with a home unit), else keys are
    /// hashed across the units.
    pub placement: TqPlacement,
    /// The storage unit this process hosts (ProducerLocal producers).
    pub home_unit: Option<u32>,
    /// A put blocked by a full unit fails after this long.
    pub put_timeout: Duration,
    /// How long to keep trying to reach a peer that is not up yet.
    pub connect_timeout: Duration,
    /// Writer or follower.
    pub role: WriteRole,
}

impl ClientConfig {
    /// The settings of process `process` of the plan, authenticating with `auth`.
    pub fn from_plan(plan: &WorkerPlan, process: u32, auth: &JobAuth) -> Result<ClientConfig, TqError> {
        let me = plan.processes.get(process as usize).ok_or_else(|| {
            TqError::input(
                format!("process {process} is not in the plan ({} processes)", plan.processes.len()),
                "pass the index of this process in plan.processes",
            )
        })?;
        let role = match me.role {
            ProcessRole::Trainer(c) if !c.leader => {
                let leader = plan
                    .fanout_group_of(process)
                    .map(|g| plan.process(g.leader).name.clone())
                    .unwrap_or_else(|| "the shard's leader".into());
                WriteRole::Follower { leader }
            }
            _ => WriteRole::Writer,
        };
        let home_unit = match plan.transfer_queue.placement {
            TqPlacement::ProducerLocal => plan.storage_units.iter().find(|u| u.process == process).map(|u| u.id),
            TqPlacement::Dedicated => None,
        };
        Ok(ClientConfig {
            auth: auth.clone(),
            name: me.name.clone(),
            controller: plan.tq_controller_address(),
            units: plan.storage_units.iter().filter_map(|u| Some((u.id, plan.storage_address(u.id)?))).collect(),
            placement: plan.transfer_queue.placement,
            home_unit,
            put_timeout: Duration::from_secs(plan.transfer_queue.put_timeout_seconds as u64),
            connect_timeout: Duration::from_secs(60),
            role,
        })
    }
}

/// Per-sample extras of a put.
#[derive(Clone, Debug, Default)]
pub struct PutOptions {
    /// Token counts for balancing, one per key. Default: the longest ragged field's rows.
    pub tokens: Option<Vec<u32>>,
    /// Tags, one list per key (or empty for none).
    pub tags: Vec<Vec<(String, String)>>,
}

/// What a put stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PutReport {
    /// Value bytes stored.
    pub bytes: u64,
    /// Samples per storage unit.
    pub per_unit: BTreeMap<u32, usize>,
}

/// Keys per get request: bounds a request's reply so that requests pipeline.
const GET_CHUNK_KEYS: usize = 256;

/// A transfer-queue client. See the module docs.
#[derive(Debug)]
pub struct TqClient {
    config: ClientConfig,
    local: Option<Arc<StorageUnit>>,
    /// The controller connection (opened at the first request) and the buffer its replies are
    /// read into, kept between requests.
    controller: tokio::sync::Mutex<(Option<Connection>, Vec<u8>)>,
    units: HashMap<u32, tokio::sync::Mutex<Option<Connection>>>,
    next_request: AtomicU32,
    /// Tags and checks the records of puts and gets beside the socket I/O.
    macs: MacPool,
}

/// Samples of a request that go to one unit: indices into the caller's keys / metadata.
struct UnitPart {
    unit: u32,
    idx: Vec<usize>,
}

fn group_by_unit(units: impl Iterator<Item = u32>) -> Vec<UnitPart> {
    let mut parts: Vec<UnitPart> = Vec::new();
    let mut pos: HashMap<u32, usize> = HashMap::new();
    for (i, u) in units.enumerate() {
        let p = *pos.entry(u).or_insert_with(|| {
            parts.push(UnitPart { unit: u, idx: Vec::new() });
            parts.len() - 1
        });
        parts[p].idx.push(i);
    }
    parts
}

impl TqClient {
    /// A client. `local` is the storage unit this process hosts, if any (its id must be
    /// `config.home_unit`); puts and gets of its samples then stay in-process.
    pub fn new(config: ClientConfig, local: Option<Arc<StorageUnit>>) -> Result<TqClient, TqError> {
        if let Some(l) = &local
            && config.home_unit != Some(l.id())
        {
            return Err(TqError::input(
                format!(
                    "the local storage unit is unit {} but the client's home unit is {:?}",
                    l.id(),
                    config.home_unit
                ),
                "pass the unit this process hosts according to the plan",
            ));
        }
        if let Some(h) = config.home_unit
            && !config.units.contains_key(&h)
        {
            return Err(TqError::input(format!("home unit {h} has no address"), "add it to config.units"));
        }
        let units = config.units.keys().map(|&u| (u, tokio::sync::Mutex::new(None))).collect();
        Ok(TqClient {
            config,
            local,
            controller: tokio::sync::Mutex::new((None, Vec::new())),
            macs: MacPool::new("tq-client", 2),
            units,
            next_request: AtomicU32::new(1),
        })
    }

    /// The settings.
    pub fn config(&self) -> &ClientConfig {
        &self.config
    }

    fn header(&self) -> Header {
        Header {
            version: WIRE_VERSION,
            request_id: self.next_request.fetch_add(1, Ordering::Relaxed),
            token: self.config.auth.token().to_string(),
        }
    }

    fn unit_addr(&self, unit: u32) -> Result<&str, TqError> {
        self.config.units.get(&unit).map(|s| s.as_str()).ok_or_else(|| {
            TqError::input(
                format!("storage unit {unit} is not known to this client (units: {:?})", self.config.units.keys()),
                "build the client from the same plan as the controller",
            )
        })
    }

    fn local_unit(&self, unit: u32) -> Option<&Arc<StorageUnit>> {
        self.local.as_ref().filter(|l| l.id() == unit)
    }

    /// The unit a key is put to.
    pub fn unit_for_key(&self, key: &str) -> Result<u32, TqError> {
        if let (TqPlacement::ProducerLocal, Some(h)) = (self.config.placement, self.config.home_unit) {
            return Ok(h);
        }
        let ids: Vec<u32> = self.config.units.keys().copied().collect();
        if ids.is_empty() {
            return Err(TqError::input("no storage units are configured", "the plan must list storage units"));
        }
        Ok(ids[(xxhash_rust::xxh3::xxh3_64(key.as_bytes()) % ids.len() as u64) as usize])
    }

    // -----------------------------------------------------------------------------------------
    // Controller requests.

    async fn controller_rpc(&self, body: &Body) -> Result<Body, TqError> {
        let mut guard = self.controller.lock().await;
        let (slot, buf) = &mut *guard;
        let addr = self.config.controller.clone();
        if slot.is_none() {
            let deadline = Instant::now() + self.config.connect_timeout;
            let mut s = net::connect_retry(&addr, deadline, "the transfer-queue controller").await?;
            let hello =
                Hello { magic: CONTROLLER_MAGIC, version: WIRE_VERSION, peer: self.config.name.clone(), extra: vec![] };
            let session = net::send_hello(&mut s, &self.config.auth, &hello, deadline, &addr).await?;
            *slot = Some(Connection { stream: s, session });
        }
        let s = slot.as_mut().expect("connected above");
        let h = self.header();
        if buf.capacity() > codec::KEPT_BUFFER {
            *buf = Vec::new();
        }
        let result = async {
            codec::write_message(&mut s.stream, &mut s.session.send, &h, body)
                .await
                .map_err(|e| NetError::io("sending to the controller", &addr, e))?;
            match codec::read_message(&mut s.stream, &mut s.session.recv, buf).await {
                Ok((rh, b)) if rh.request_id == h.request_id => Ok(b),
                Ok((rh, _)) => Err(TqError::Protocol {
                    peer: addr.clone(),
                    what: format!("a reply to request {} while waiting for {}", rh.request_id, h.request_id),
                }),
                Err(ReadError::Io(e)) => Err(NetError::io("reading the controller's reply", &addr, e).into()),
                Err(ReadError::Codec(e)) => Err(TqError::Protocol { peer: addr.clone(), what: e.to_string() }),
            }
        }
        .await;
        match result {
            Ok(Body::Error { code, message }) => Err(TqError::Controller { code, message }),
            Ok(b) => Ok(b),
            Err(e) => {
                *slot = None;
                Err(e)
            }
        }
    }

    /// Claims up to `n` ready samples (having every `required` field) for `group`.
    pub async fn claim(&self, partition: &str, group: &str, n: usize, required: &[&str]) -> Result<Claim, TqError> {
        self.claim_min(partition, group, n, 0, required).await
    }

    /// Like [`TqClient::claim`], but hands out none unless at least `min` are ready.
    pub async fn claim_min(
        &self,
        partition: &str,
        group: &str,
        n: usize,
        min: usize,
        required: &[&str],
    ) -> Result<Claim, TqError> {
        let body = Body::Claim {
            partition: partition.into(),
            group: group.into(),
            n: n.min(u32::MAX as usize) as u32,
            min: min.min(u32::MAX as usize) as u32,
            required: required.iter().map(|s| s.to_string()).collect(),
        };
        match self.controller_rpc(&body).await? {
            Body::Claimed { claim_id, lease_ms, meta } => {
                Ok(Claim { group: group.into(), claim_id, lease: Duration::from_millis(lease_ms), meta })
            }
            other => Err(self.unexpected("the controller", &other)),
        }
    }

    /// Claims exactly `n` samples, waiting (polling) until `n` are ready or `timeout` passes.
    pub async fn claim_wait(
        &self,
        partition: &str,
        group: &str,
        n: usize,
        required: &[&str],
        timeout: Duration,
    ) -> Result<Claim, TqError> {
        let deadline = Instant::now() + timeout;
        let mut pause = Duration::from_micros(500);
        loop {
            let c = self.claim_min(partition, group, n, n, required).await?;
            if !c.meta.is_empty() || n == 0 {
                return Ok(c);
            }
            if Instant::now() + pause > deadline {
                return Err(NetError::Timeout {
                    what: format!("waiting for {n} ready samples of partition `{partition}` for group `{group}`"),
                    peer: self.config.controller.clone(),
                    secs: timeout.as_secs_f64(),
                }
                .into());
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(20));
        }
    }

    /// Acknowledges every sample of a claim.
    pub async fn ack(&self, claim: &Claim) -> Result<AckReport, TqError> {
        let keys: Vec<String> = claim.meta.keys().map(String::from).collect();
        self.ack_keys(&claim.meta.partition, &claim.group, claim.claim_id, &keys).await
    }

    /// Acknowledges some samples of a claim.
    pub async fn ack_keys(
        &self,
        partition: &str,
        group: &str,
        claim_id: u64,
        keys: &[String],
    ) -> Result<AckReport, TqError> {
        let body = Body::Ack { partition: partition.into(), group: group.into(), claim_id, keys: keys.to_vec() };
        match self.controller_rpc(&body).await? {
            Body::Acked { acked, stale } => Ok(AckReport { acked, stale }),
            other => Err(self.unexpected("the controller", &other)),
        }
    }

    /// Clears a partition: its metadata and its bytes in every storage unit.
    pub async fn clear(&self, partition: &str) -> Result<ClearReport, TqError> {
        match self.controller_rpc(&Body::Clear { partition: partition.into() }).await? {
            Body::Cleared { freed, units } => Ok(ClearReport { freed, units, unreachable: vec![] }),
            other => Err(self.unexpected("the controller", &other)),
        }
    }

    /// Tells the controller that a storage unit could not be reached.
    pub async fn report_lost(&self, unit: u32, reason: &str) -> Result<(), TqError> {
        match self.controller_rpc(&Body::ReportLost { unit, reason: reason.into() }).await? {
            Body::Done => Ok(()),
            other => Err(self.unexpected("the controller", &other)),
        }
    }

    async fn register(&self, meta: BatchMeta) -> Result<(), TqError> {
        match self.controller_rpc(&Body::Register(meta)).await? {
            Body::Done => Ok(()),
            other => Err(self.unexpected("the controller", &other)),
        }
    }

    fn unexpected(&self, peer: &str, b: &Body) -> TqError {
        TqError::Protocol { peer: peer.into(), what: format!("an unexpected reply of kind {}", b.kind()) }
    }

    // -----------------------------------------------------------------------------------------
    // Storage connections.

    async fn with_unit<T>(
        &self,
        unit: u32,
        partition: &str,
        work: impl AsyncFnOnce(&mut Connection, &str) -> Result<T, TqError>,
    ) -> Result<T, TqError> {
        let addr = self.unit_addr(unit)?.to_string();
        let slot = self.units.get(&unit).expect("every configured unit has a slot");
        let mut slot = slot.lock().await;
        if slot.is_none() {
            let deadline = Instant::now() + self.config.connect_timeout;
            match connect_unit(&addr, &self.config.auth, &self.config.name, deadline).await {
                Ok(s) => *slot = Some(s),
                Err(e @ NetError::Refused { .. }) => return Err(e.into()),
                Err(e) => return Err(self.lost(unit, &addr, partition, e.to_string()).await),
            }
        }
        let s = slot.as_mut().expect("connected above");
        match work(s, &addr).await {
            Ok(v) => Ok(v),
            Err(e) => {
                // Out of step or dead: never reuse this connection.
                *slot = None;
                match e {
                    TqError::Net(NetError::Closed { .. } | NetError::Io { .. } | NetError::Timeout { .. }) => {
                        Err(self.lost(unit, &addr, partition, e.to_string()).await)
                    }
                    e => Err(e),
                }
            }
        }
    }

    /// Builds the unit-lost error and tells the controller (best effort: it may be gone too).
    async fn lost(&self, unit: u32, addr: &str, partition: &str, reason: String) -> TqError {
        let report = tokio::time::timeout(Duration::from_secs(2), self.report_lost(unit, &reason)).await;
        if !matches!(report, Ok(Ok(()))) {
            tracing::warn!(unit, %addr, "could not tell the controller that storage unit {unit} is unreachable");
        }
        TqError::StorageUnitLost { unit, addr: addr.into(), partition: partition.into(), reason }
    }

    fn storage_err(unit: u32, addr: &str, code: ErrorCode, message: String) -> TqError {
        TqError::Storage { unit, addr: addr.into(), code, message }
    }

    // -----------------------------------------------------------------------------------------
    // Put and write-back.

    /// Puts samples: `columns[f]` holds field `f` of every key, in key order. Registers them with
    /// the controller once every storage unit has them.
    pub async fn put(&self, partition: &str, keys: &[String], columns: &[Column]) -> Result<PutReport, TqError> {
        self.put_with(partition, keys, columns, &PutOptions::default()).await
    }

    /// [`TqClient::put`] with token counts and tags.
    pub async fn put_with(
        &self,
        partition: &str,
        keys: &[String],
        columns: &[Column],
        opts: &PutOptions,
    ) -> Result<PutReport, TqError> {
        check_put(partition, keys, columns, opts)?;
        let units = keys.iter().map(|k| self.unit_for_key(k)).collect::<Result<Vec<_>, _>>()?;
        let parts = group_by_unit(units.iter().copied());
        let stored = self.store(partition, keys, columns, &parts).await?;
        let tokens: Vec<u32> = match &opts.tokens {
            Some(t) => t.clone(),
            None => (0..keys.len())
                .map(|i| columns.iter().filter(|c| c.spec().ragged).map(|c| c.rows(i)).max().unwrap_or(1))
                .collect(),
        };
        let mut meta = BatchMeta::builder(partition, columns.iter().map(|c| c.spec().clone()).collect());
        meta.reserve(keys.len());
        let tags = shared_tags(&opts.tags, keys.len());
        let mut rows = Vec::with_capacity(columns.len());
        for (i, key) in keys.iter().enumerate() {
            rows.clear();
            rows.extend(columns.iter().map(|c| c.rows(i)));
            meta.push(key, units[i], tokens[i], &rows, &tags[i])
                .map_err(|e| TqError::input(e.to_string(), "put fewer or shorter keys"))?;
        }
        self.register(meta.finish()).await?;
        Ok(PutReport { bytes: stored, per_unit: parts.iter().map(|p| (p.unit, p.idx.len())).collect() })
    }

    /// Writes a field back for the samples of `meta` (e.g. trainer-computed log-probabilities),
    /// into the storage unit that holds each sample, then registers it. `column` holds one entry
    /// per sample of `meta`, in order. Refused for a data-parallel follower.
    pub async fn write_back(&self, meta: &BatchMeta, field: &str, column: &Column) -> Result<(), TqError> {
        if let WriteRole::Follower { leader } = &self.config.role {
            return Err(TqError::FollowerWriteBack {
                process: self.config.name.clone(),
                leader: leader.clone(),
                field: field.into(),
            });
        }
        if column.len() != meta.len() {
            return Err(TqError::input(
                format!("write-back of field `{field}` has {} entries for {} samples", column.len(), meta.len()),
                "give one entry per sample of the metadata, in its order",
            ));
        }
        if field.is_empty() {
            return Err(TqError::input("write-back field name is empty", "name the field, e.g. `old_logprobs`"));
        }
        let column = column.clone().with_name(field);
        let keys: Vec<String> = meta.keys().map(String::from).collect();
        let parts = group_by_unit(meta.units().iter().copied());
        self.store(&meta.partition, &keys, std::slice::from_ref(&column), &parts).await?;
        let rows = (0..column.len()).map(|i| column.rows(i)).collect();
        let reg = meta
            .with_fields(vec![column.spec().clone()], vec![rows])
            .map_err(|e| TqError::input(e.to_string(), "give one entry per sample of the metadata"))?;
        self.register(reg).await
    }

    /// Stores the samples of each part in its unit, units in parallel.
    async fn store(
        &self,
        partition: &str,
        keys: &[String],
        columns: &[Column],
        parts: &[UnitPart],
    ) -> Result<u64, TqError> {
        let jobs = parts.iter().map(|p| self.store_part(partition, keys, columns, p));
        let stored = futures::future::try_join_all(jobs).await?;
        Ok(stored.into_iter().sum())
    }

    async fn store_part(
        &self,
        partition: &str,
        keys: &[String],
        columns: &[Column],
        part: &UnitPart,
    ) -> Result<u64, TqError> {
        let whole = part.idx.len() == keys.len();
        let part_keys: Vec<String> =
            if whole { keys.to_vec() } else { part.idx.iter().map(|&i| keys[i].clone()).collect() };
        if let Some(unit) = self.local_unit(part.unit) {
            let cols: Vec<Column> = if whole {
                columns.to_vec()
            } else {
                columns.iter().map(|c| subset_column(c, &part.idx)).collect::<Result<_, _>>()?
            };
            let deadline = Instant::now() + self.config.put_timeout;
            return unit.put(partition, &part_keys, &cols, deadline).await.map_err(|e| {
                Self::storage_err(part.unit, self.unit_addr(part.unit).unwrap_or("local"), e.code(), e.to_string())
            });
        }
        // Per column: the part's offsets (ragged) and values, as slices of the caller's buffers.
        let offsets: Vec<Vec<u8>> = columns
            .iter()
            .map(|c| {
                if !c.spec().ragged {
                    return Vec::new();
                }
                let mut o = Vec::with_capacity(part.idx.len() + 1);
                o.push(0u64);
                for &i in &part.idx {
                    o.push(o.last().copied().unwrap_or(0) + c.rows(i) as u64);
                }
                codec::encode_offsets(&o)
            })
            .collect();
        let block = Block {
            n: part.idx.len() as u32,
            columns: columns
                .iter()
                .map(|c| {
                    let bytes: u64 = if whole {
                        c.nbytes() as u64
                    } else {
                        part.idx.iter().map(|&i| c.sample_range(i).len() as u64).sum()
                    };
                    (c.spec().clone(), bytes)
                })
                .collect(),
        };
        let h = self.header();
        let body = Body::Put { partition: partition.into(), keys: part_keys, block };
        let mut out = Outgoing::new(&h, &body);
        for (c, off) in columns.iter().zip(offsets) {
            if c.spec().ragged {
                out.buffer(vec![Bytes::from(off)]);
            }
            if whole {
                out.buffer(vec![c.values().clone()]);
            } else {
                out.buffer(part.idx.iter().map(|&i| c.values().slice(c.sample_range(i))).collect());
            }
        }
        // The unit may hold the reply for up to the put timeout (backpressure).
        let reply_within = self.config.put_timeout + Duration::from_secs(30);
        self.with_unit(part.unit, partition, async |s: &mut Connection, addr: &str| {
            let what = "putting samples";
            let mut buf = Vec::new();
            let exchange = async {
                out.write(&mut s.stream, &mut s.session.send, &self.macs)
                    .await
                    .map_err(|e| NetError::io(what, addr, e))?;
                read_reply(&mut s.stream, &mut s.session.recv, &mut buf, addr, h.request_id).await
            };
            match tokio::time::timeout(reply_within, exchange).await {
                Err(_) => {
                    Err(NetError::Timeout { what: what.into(), peer: addr.into(), secs: reply_within.as_secs_f64() }
                        .into())
                }
                Ok(Err(e)) => Err(e),
                Ok(Ok(Body::Stored { bytes })) => Ok(bytes),
                Ok(Ok(Body::Error { code, message })) => Err(Self::storage_err(part.unit, addr, code, message)),
                Ok(Ok(other)) => Err(TqError::Protocol {
                    peer: addr.into(),
                    what: format!("an unexpected reply of kind {} to a put", other.kind()),
                }),
            }
        })
        .await
    }

    // -----------------------------------------------------------------------------------------
    // Get.

    /// Fetches `fields` of the samples of `meta`. Samples come back grouped by storage unit; the
    /// returned batch's `meta` gives their order. Units are read in parallel, each column into one
    /// buffer, straight from the sockets.
    pub async fn get(&self, meta: &BatchMeta, fields: &[&str]) -> Result<Batch, TqError> {
        let fidx: Vec<usize> = fields
            .iter()
            .map(|f| {
                meta.field_index(f).ok_or_else(|| {
                    TqError::input(
                        format!(
                            "field `{f}` is not in partition `{}` (fields: {:?})",
                            meta.partition,
                            meta.schema.iter().map(|s| &s.name).collect::<Vec<_>>()
                        ),
                        "claim with this field in required_fields, or put it first",
                    )
                })
            })
            .collect::<Result<_, _>>()?;
        // Rows of each requested field, per sample of `meta`.
        let mut field_rows: Vec<&[u32]> = Vec::with_capacity(fields.len());
        for (&fi, f) in fidx.iter().zip(fields) {
            let rows = match meta.field_rows(fi) {
                None if meta.is_empty() => Some(&[][..]),
                rows => rows.filter(|r| !r.contains(&ABSENT)),
            };
            let Some(rows) = rows else {
                let i = meta.field_rows(fi).and_then(|r| r.iter().position(|&x| x == ABSENT)).unwrap_or(0);
                return Err(TqError::input(
                    format!("sample `{}` of partition `{}` has no field `{f}`", meta.key(i), meta.partition),
                    "claim with this field in required_fields so that only samples having it are handed out",
                ));
            };
            field_rows.push(rows);
        }
        let specs: Vec<FieldSpec> = fidx.iter().map(|&i| meta.schema[i].clone()).collect();
        let row_bytes: Vec<u64> = specs.iter().map(|s| s.row_bytes().unwrap_or(1)).collect();
        let parts = group_by_unit(meta.units().iter().copied());
        let order: Vec<usize> = parts.iter().flat_map(|p| p.idx.iter().copied()).collect();
        // Sizes: per field, per sample.
        let want = Wanted { names: fields, index: fidx, rows: field_rows, row_bytes };
        let sample_bytes = |f: usize, i: usize| want.rows[f][i] as u64 * want.row_bytes[f];
        let mut buffers: Vec<Vec<u8>> = (0..fields.len())
            .map(|f| codec::receive_buffer(order.iter().map(|&i| sample_bytes(f, i)).sum::<u64>() as usize))
            .collect();
        {
            // Split every field's buffer into one region per part (disjoint, in order).
            let mut regions: Vec<Vec<&mut [u8]>> = parts.iter().map(|_| Vec::with_capacity(fields.len())).collect();
            for (f, buf) in buffers.iter_mut().enumerate() {
                let mut rest: &mut [u8] = buf.as_mut_slice();
                for (p, part) in parts.iter().enumerate() {
                    let n: u64 = part.idx.iter().map(|&i| sample_bytes(f, i)).sum();
                    let (head, tail) = std::mem::take(&mut rest).split_at_mut(n as usize);
                    regions[p].push(head);
                    rest = tail;
                }
            }
            let jobs = parts.iter().zip(regions).map(|(part, regions)| self.get_part(meta, part, &want, regions));
            futures::future::try_join_all(jobs).await?;
        }
        let mut columns = Vec::with_capacity(fields.len());
        for (f, buf) in buffers.into_iter().enumerate() {
            let offsets = if specs[f].ragged {
                let mut o = Vec::with_capacity(order.len() + 1);
                o.push(0u64);
                for &i in &order {
                    o.push(o.last().copied().unwrap_or(0) + want.rows[f][i] as u64);
                }
                o
            } else {
                Vec::new()
            };
            columns.push(Column::from_parts(specs[f].clone(), order.len(), Bytes::from(buf), offsets).map_err(
                |e| TqError::Protocol { peer: "storage".into(), what: format!("data disagreeing with metadata: {e}") },
            )?);
        }
        Ok(Batch { meta: meta.subset(&order), columns })
    }

    /// Reads one unit's samples into its regions (one per field of `want`).
    async fn get_part(
        &self,
        meta: &BatchMeta,
        part: &UnitPart,
        want: &Wanted<'_>,
        mut regions: Vec<&mut [u8]>,
    ) -> Result<(), TqError> {
        let field_names: Vec<String> = want.names.iter().map(|s| s.to_string()).collect();
        if let Some(unit) = self.local_unit(part.unit) {
            let keys: Vec<String> = part.idx.iter().map(|&i| meta.key(i).to_string()).collect();
            let got = unit.get(&meta.partition, &keys, &field_names).map_err(|e| {
                Self::storage_err(part.unit, self.unit_addr(part.unit).unwrap_or("local"), e.code(), e.to_string())
            })?;
            return copy_local_slices(part.unit, want.names, &got, &mut regions);
        }
        // Chunks of keys, each a request; per chunk and field, the expected rows and its region.
        let chunks: Vec<&[usize]> = part.idx.chunks(GET_CHUNK_KEYS).collect();
        let chunk_regions = split_by_chunk(&chunks, want, regions);
        let requests: Vec<(Header, Body)> = chunks
            .iter()
            .map(|chunk| {
                (
                    self.header(),
                    Body::Get {
                        partition: meta.partition.clone(),
                        keys: chunk.iter().map(|&i| meta.key(i).to_string()).collect(),
                        fields: field_names.clone(),
                    },
                )
            })
            .collect();
        let unit = part.unit;
        self.with_unit(unit, &meta.partition, async |s: &mut Connection, addr: &str| {
            let (mut rd, mut wr) = s.stream.split();
            let (send_mac, recv_mac) = (&mut s.session.send, &mut s.session.recv);
            let send = async {
                for (h, b) in &requests {
                    codec::write_message(&mut wr, send_mac, h, b)
                        .await
                        .map_err(|e| NetError::io("sending a get", addr, e))?;
                }
                Ok::<(), TqError>(())
            };
            let receive = async {
                let mut buf = Vec::new();
                for ((chunk, (h, _)), mut regions) in chunks.iter().zip(&requests).zip(chunk_regions) {
                    let block = match read_reply(&mut rd, recv_mac, &mut buf, addr, h.request_id).await? {
                        Body::Data { block } => block,
                        Body::Error { code, message } => return Err(Self::storage_err(unit, addr, code, message)),
                        other => {
                            return Err(TqError::Protocol {
                                peer: addr.into(),
                                what: format!("an unexpected reply of kind {} to a get", other.kind()),
                            });
                        }
                    };
                    let link = (&mut rd, &mut *recv_mac, &self.macs);
                    read_get_columns(link, addr, &block, meta, want, chunk, &mut regions).await?;
                }
                Ok::<(), TqError>(())
            };
            futures::future::try_join(send, receive).await.map(|_| ())
        })
        .await
    }
}

/// Copies what the storage unit this process hosts (`unit`) returned for a get, field by field
/// (`names`), into `regions`: each must be filled exactly, as the metadata sized it.
fn copy_local_slices(unit: u32, names: &[&str], got: &[FieldSlices], regions: &mut [&mut [u8]]) -> Result<(), TqError> {
    for (f, slices) in got.iter().enumerate() {
        let mut at = 0usize;
        for (b, _) in &slices.samples {
            let dst = regions[f].get_mut(at..at + b.len()).ok_or_else(|| TqError::Protocol {
                peer: format!("local unit {unit}"),
                what: format!("more bytes of field `{}` than the metadata says", names[f]),
            })?;
            dst.copy_from_slice(b);
            at += b.len();
        }
        if at != regions[f].len() {
            return Err(TqError::Protocol {
                peer: format!("local unit {unit}"),
                what: format!("fewer bytes of field `{}` than the metadata says", names[f]),
            });
        }
    }
    Ok(())
}

/// Splits a unit's regions (one per field of `want`) by the chunks of keys requested one at a
/// time: per chunk, one region per field, disjoint and in order.
fn split_by_chunk<'r>(chunks: &[&[usize]], want: &Wanted<'_>, regions: Vec<&'r mut [u8]>) -> Vec<Vec<&'r mut [u8]>> {
    let mut chunk_regions: Vec<Vec<&mut [u8]>> = chunks.iter().map(|_| Vec::new()).collect();
    for (f, region) in regions.into_iter().enumerate() {
        let mut rest: &mut [u8] = region;
        for (c, chunk) in chunks.iter().enumerate() {
            let n: u64 = chunk.iter().map(|&i| want.rows[f][i] as u64 * want.row_bytes[f]).sum();
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(n as usize);
            chunk_regions[c].push(head);
            rest = tail;
        }
    }
    chunk_regions
}

/// Reads the columns of a get reply's `block` (the samples `chunk` of `meta`) from `rd` into
/// `regions`, one per field of `want`, after checking that the unit sends what the controller's
/// metadata says: the samples and fields asked for, with the same shapes, bytes and row counts.
async fn read_get_columns<R: tokio::io::AsyncReadExt + net::ReadVectored + Unpin>(
    (rd, mac, pool): (&mut R, &mut FrameMac, &MacPool),
    addr: &str,
    block: &Block,
    meta: &BatchMeta,
    want: &Wanted<'_>,
    chunk: &[usize],
    regions: &mut [&mut [u8]],
) -> Result<(), TqError> {
    let bad = |what: String| TqError::Protocol { peer: addr.into(), what };
    // The checks of every field's records: each runs beside the reading of the next.
    let mut checks = RecordChecks::new();
    if block.n as usize != chunk.len() || block.columns.len() != want.names.len() {
        return Err(bad(format!(
            "{} samples × {} fields where {} × {} were asked for",
            block.n,
            block.columns.len(),
            chunk.len(),
            want.names.len()
        )));
    }
    for (f, ((spec, len), region)) in block.columns.iter().zip(regions.iter_mut()).enumerate() {
        let expected = &meta.schema[want.index[f]];
        if spec.name != expected.name || !spec.same_shape(expected) || *len != region.len() as u64 {
            return Err(bad(format!(
                "field `{}` as {:?} with {len} bytes where the metadata says `{}` {:?} with {} bytes",
                spec.name,
                spec.dtype,
                expected.name,
                expected.dtype,
                region.len()
            )));
        }
        if spec.ragged {
            let raw = codec::read_buffer(rd, mac, pool, (chunk.len() as u64 + 1) * 8, &spec.name)
                .await
                .map_err(|e| read_error(addr, e))?;
            let got = codec::decode_offsets(&spec.name, &raw, block.n, *len, want.row_bytes[f])
                .map_err(|e| bad(e.to_string()))?;
            let rows = chunk.iter().map(|&i| want.rows[f][i] as u64);
            if got.windows(2).map(|w| w[1] - w[0]).ne(rows) {
                return Err(bad(format!(
                    "row counts of field `{}` that disagree with the controller's metadata",
                    spec.name
                )));
            }
        }
        // SAFETY: the regions are parts of the buffers `TqClient::get` allocated: they belong to
        // its future (leaked, they leak with it), and the checks finish below, before it uses them.
        unsafe { codec::read_buffer_into((&mut *rd, &mut *mac, pool), &mut checks, region, &spec.name) }
            .await
            .map_err(|e| read_error(addr, e))?;
    }
    codec::finish_checks(&mut checks).await.map_err(|e| read_error(addr, e))
}

/// The fields a get reads: their names, schema indices, rows per sample of the metadata and
/// bytes per row.
struct Wanted<'a> {
    names: &'a [&'a str],
    index: Vec<usize>,
    rows: Vec<&'a [u32]>,
    row_bytes: Vec<u64>,
}

fn read_error(addr: &str, e: ReadError) -> TqError {
    match e {
        ReadError::Io(e) => NetError::io("reading data", addr, e).into(),
        ReadError::Codec(e) => TqError::Protocol { peer: addr.into(), what: e.to_string() },
    }
}

async fn read_reply<R: tokio::io::AsyncReadExt + Unpin>(
    r: &mut R,
    mac: &mut FrameMac,
    buf: &mut Vec<u8>,
    addr: &str,
    request_id: u32,
) -> Result<Body, TqError> {
    match codec::read_message(r, mac, buf).await {
        Ok((h, b)) if h.request_id == request_id => Ok(b),
        Ok((_, Body::Error { code, message })) => {
            Err(TqError::Storage { unit: u32::MAX, addr: addr.into(), code, message })
        }
        Ok((h, _)) => Err(TqError::Protocol {
            peer: addr.into(),
            what: format!("a reply to request {} while waiting for {request_id}", h.request_id),
        }),
        Err(e) => Err(read_error(addr, e)),
    }
}

/// One tag set per sample (empty where none is given), equal lists sharing one set: a batch's
/// metadata carries each distinct set once (GRPO's samples share their prompt's `uid`, so a
/// 128-sample put with 16 prompts holds 16 sets, not 128 — a `Train` command's JSON took 9.9 KB and
/// 72 µs to read with one set per sample here).
fn shared_tags(lists: &[Vec<(String, String)>], n: usize) -> Vec<SampleTags> {
    let untagged = SampleTags::default();
    let mut seen: HashMap<&[(String, String)], SampleTags> = HashMap::new();
    (0..n)
        .map(|i| match lists.get(i).filter(|t| !t.is_empty()) {
            Some(t) => seen.entry(t.as_slice()).or_insert_with(|| SampleTags::from(t.as_slice())).clone(),
            None => untagged.clone(),
        })
        .collect()
}

fn check_put(partition: &str, keys: &[String], columns: &[Column], opts: &PutOptions) -> Result<(), TqError> {
    if partition.is_empty() {
        return Err(TqError::input("partition name is empty", "name the step, e.g. `step-12`"));
    }
    if columns.is_empty() {
        return Err(TqError::input("a put with no columns", "pass at least one field"));
    }
    for c in columns {
        if c.len() != keys.len() {
            return Err(TqError::input(
                format!("column `{}` has {} samples for {} keys", c.name(), c.len(), keys.len()),
                "give every column one entry per key, in key order",
            ));
        }
        if c.name().is_empty() {
            return Err(TqError::input("a column has an empty name", "name every field"));
        }
    }
    for (i, c) in columns.iter().enumerate() {
        if columns[..i].iter().any(|d| d.name() == c.name()) {
            return Err(TqError::input(format!("field `{}` appears twice", c.name()), "pass each field once"));
        }
    }
    let mut seen = std::collections::HashSet::with_capacity(keys.len());
    if let Some(k) = keys.iter().find(|k| !seen.insert(k.as_str())) {
        return Err(TqError::input(format!("key `{k}` appears twice in one put"), "keys must be unique per step"));
    }
    if let Some(t) = &opts.tokens
        && t.len() != keys.len()
    {
        return Err(TqError::input(
            format!("{} token counts for {} keys", t.len(), keys.len()),
            "give one token count per key (or none)",
        ));
    }
    if !opts.tags.is_empty() && opts.tags.len() != keys.len() {
        return Err(TqError::input(
            format!("{} tag lists for {} keys", opts.tags.len(), keys.len()),
            "give one tag list per key (or none)",
        ));
    }
    Ok(())
}

/// The samples `idx` of a column, copied into a new buffer.
fn subset_column(c: &Column, idx: &[usize]) -> Result<Column, TqError> {
    let mut values = Vec::with_capacity(idx.iter().map(|&i| c.sample_range(i).len()).sum());
    let mut offsets = Vec::new();
    if c.spec().ragged {
        offsets.push(0u64);
    }
    for &i in idx {
        values.extend_from_slice(&c.values()[c.sample_range(i)]);
        if c.spec().ragged {
            offsets.push(offsets.last().copied().unwrap_or(0) + c.rows(i) as u64);
        }
    }
    Column::from_parts(c.spec().clone(), idx.len(), Bytes::from(values), offsets)
        .map_err(|e| TqError::input(e.to_string(), "this is a bug in subsetting; report it"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_tag_lists_share_one_set_and_missing_ones_are_empty() {
        let tag = |uid: &str| vec![("uid".to_string(), uid.to_string()), ("engine".to_string(), "0".to_string())];
        let lists = vec![tag("p0"), tag("p0"), vec![], tag("p1"), tag("p0")];
        let sets = shared_tags(&lists, 6);
        assert_eq!(sets.len(), 6);
        assert!(Arc::ptr_eq(&sets[0], &sets[1]) && Arc::ptr_eq(&sets[0], &sets[4]), "equal lists share a set");
        assert!(!Arc::ptr_eq(&sets[0], &sets[3]));
        assert_eq!(&sets[3][..], &tag("p1")[..]);
        assert!(sets[2].is_empty() && sets[5].is_empty(), "no tags: the empty set");
        // A batch built from them holds each distinct set once.
        let mut b = BatchMeta::builder("p", vec![]);
        for (i, t) in sets.iter().enumerate() {
            b.push(&format!("k{i}"), 0, 1, &[], t).unwrap();
        }
        let json = serde_json::to_string(&b.finish()).unwrap();
        assert_eq!(json.matches("\"p0\"").count(), 1, "{json}");
    }
}
