//! The transfer-queue controller: metadata only.
//!
//! It knows which (sample, field) pairs exist, which storage unit holds each sample, sequence
//! lengths and tags — never the bytes. [`Controller`] is the plain state machine (deterministic,
//! clock passed in); [`TqController`] wraps it for the coordinator: shared, served over TCP on the
//! plan's `tq_controller` port, clearing partitions in every storage unit, and watching the units
//! so that a dead one marks its partitions lost.
//!
//! Claims: [`Controller::claim`] hands out ready samples (those having every required field),
//! each exactly once per consumer group, under a lease. A claim not acknowledged before its lease
//! expires (the consumer died) is claimable again; nothing is lost.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use tokio::net::{TcpListener, TcpStream};

use super::codec::{self, Body, CONTROLLER_MAGIC, ErrorCode, Header, ReadError, STORAGE_MAGIC, WIRE_VERSION};
use super::column::{ABSENT, BatchMeta, FieldSpec, SampleKey, SampleTags};
use rlplane_wire::net::{self, Hello, JobAuth, NetError};

/// Most fields a partition may have (ready checks are one 64-bit mask test per sample).
pub const MAX_FIELDS: usize = 64;

/// Errors of the controller. Each names the partition, field, key or unit, and the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ControllerError {
    /// A storage unit holding some of the partition's samples died.
    #[error(
        "partition `{partition}` is lost: storage unit {unit} is gone ({reason}); clear the partition and generate the step again"
    )]
    PartitionLost {
        /// Partition.
        partition: String,
        /// The unit that died.
        unit: u32,
        /// What was seen.
        reason: String,
    },
    /// A put to a unit already known to be dead.
    #[error("storage unit {unit} is lost ({reason}); its samples cannot be registered")]
    UnitLost {
        /// Unit.
        unit: u32,
        /// What was seen.
        reason: String,
    },
    /// A field disagrees with the partition's schema.
    #[error("field `{field}` of partition `{partition}`: {problem}")]
    Schema {
        /// Partition.
        partition: String,
        /// Field.
        field: String,
        /// What disagrees and how to fix it.
        problem: String,
    },
    /// Something asked for is not there.
    #[error("{0}")]
    NotFound(String),
    /// A request that makes no sense.
    #[error("{0}")]
    BadRequest(String),
}

impl ControllerError {
    /// Wire error code.
    pub fn code(&self) -> ErrorCode {
        match self {
            ControllerError::PartitionLost { .. } | ControllerError::UnitLost { .. } => ErrorCode::PartitionLost,
            ControllerError::Schema { .. } => ErrorCode::Schema,
            ControllerError::NotFound(_) => ErrorCode::NotFound,
            ControllerError::BadRequest(_) => ErrorCode::BadRequest,
        }
    }
}

/// Samples handed to one consumer of a group, under a lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Claim {
    /// Consumer group.
    pub group: String,
    /// Id to acknowledge with.
    pub claim_id: u64,
    /// The lease: acknowledge within it, or the samples are handed out again.
    pub lease: Duration,
    /// The claimed samples (possibly none) and the partition's schema.
    pub meta: BatchMeta,
}

/// Result of an acknowledgement.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AckReport {
    /// Samples acknowledged.
    pub acked: u32,
    /// Keys whose lease had expired and that another claim now holds (their new holder will
    /// acknowledge them).
    pub stale: Vec<String>,
}

/// Progress of one consumer group on a partition.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupStatus {
    /// Group name.
    pub group: String,
    /// Samples currently claimed (lease running).
    pub claimed: usize,
    /// Samples acknowledged.
    pub acked: usize,
}

/// What the controller knows about a partition.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PartitionStatus {
    /// Samples registered.
    pub samples: usize,
    /// Fields known.
    pub fields: Vec<String>,
    /// Storage units holding samples.
    pub units: Vec<u32>,
    /// `(unit, reason)` if a unit holding samples died.
    pub lost: Option<(u32, String)>,
    /// Per consumer group.
    pub groups: Vec<GroupStatus>,
}

/// A slot (one per sample of a partition, per group) not handed out yet.
const FREE: u32 = 0;
/// A slot acknowledged: done for the group.
const ACKED: u32 = u32::MAX;

/// One consumer group's progress on a partition.
#[derive(Debug, Default)]
struct Group {
    /// Per sample: [`FREE`], [`ACKED`], or `c` — claimed by `claims[c - 1]`. Four bytes a sample,
    /// so a group's slots for a 4096-sample step are 16 KB.
    slots: Vec<u32>,
    /// The group's claims: id and lease end.
    claims: Vec<(u64, Instant)>,
    /// Every slot before it is acked: claims scan from here.
    first_open: usize,
}

impl Group {
    /// Free, or claimed under a lease that ran out by `now`.
    fn claimable(&self, slot: u32, now: Instant) -> bool {
        match slot {
            FREE => true,
            ACKED => false,
            c => self.claims[c as usize - 1].1 <= now,
        }
    }

    /// Claimed under a lease still running at `now`.
    fn leased(&self, slot: u32, now: Instant) -> bool {
        slot != FREE && slot != ACKED && self.claims[slot as usize - 1].1 > now
    }
}

/// A partition's samples, column by column (as a claim hands them out): sample `i` is entry `i`
/// of every column.
#[derive(Debug)]
struct Samples {
    schema: Vec<FieldSpec>,
    /// Every key's bytes back to back; key `i` ends at `key_ends[i]` and starts where key
    /// `i - 1` ends.
    key_bytes: String,
    key_ends: Vec<usize>,
    /// Storage unit per sample.
    units: Vec<u32>,
    tokens: Vec<u32>,
    /// Per field (schema order), rows per sample ([`ABSENT`] where missing).
    rows: Vec<Vec<u32>>,
    /// Per sample, a bit per field it has.
    present: Vec<u64>,
    /// Distinct tag sets; set 0 is the empty one.
    tag_sets: Vec<SampleTags>,
    /// Per sample, its index in `tag_sets`.
    tag_of: Vec<u32>,
}

impl Default for Samples {
    fn default() -> Samples {
        Samples {
            schema: Vec::new(),
            key_bytes: String::new(),
            key_ends: Vec::new(),
            units: Vec::new(),
            tokens: Vec::new(),
            rows: Vec::new(),
            present: Vec::new(),
            tag_sets: vec![SampleTags::default()],
            tag_of: Vec::new(),
        }
    }
}

#[derive(Debug, Default)]
struct Partition {
    samples: Samples,
    by_key: HashMap<SampleKey, usize>,
    groups: HashMap<String, Group>,
    units: BTreeSet<u32>,
    lost: Option<(u32, String)>,
}

impl Samples {
    fn len(&self) -> usize {
        self.units.len()
    }

    fn key_start(&self, i: usize) -> usize {
        if i == 0 { 0 } else { self.key_ends[i - 1] }
    }

    fn key(&self, i: usize) -> &str {
        self.key_bytes.get(self.key_start(i)..self.key_ends[i]).unwrap_or_default()
    }

    /// The metadata of the samples in `runs` (ascending, disjoint ranges; `k` samples in all),
    /// copied run by run: a claim of consecutive samples (a whole step) is one copy per column.
    fn batch(&self, partition: &str, runs: &[(usize, usize)], k: usize) -> Result<BatchMeta, ControllerError> {
        let key_bytes: usize = runs.iter().map(|&(s, e)| self.key_ends[e - 1] - self.key_start(s)).sum();
        if key_bytes > u32::MAX as usize {
            return Err(ControllerError::BadRequest(format!(
                "a claim of {k} samples of partition `{partition}` holds {key_bytes} bytes of keys, over 4 GiB; claim fewer"
            )));
        }
        let mut keys = String::with_capacity(key_bytes);
        let mut key_offsets = Vec::with_capacity(k + 1);
        key_offsets.push(0u32);
        let mut units = Vec::with_capacity(k);
        let mut tokens = Vec::with_capacity(k);
        let mut rows: Vec<Vec<u32>> = self.rows.iter().map(|_| Vec::with_capacity(k)).collect();
        let mut set_map = vec![u32::MAX; self.tag_sets.len()];
        let mut tag_sets = Vec::new();
        let mut tag_index = Vec::with_capacity(k);
        for &(s, e) in runs {
            let (from, to) = (self.key_start(s), keys.len());
            keys.push_str(self.key_bytes.get(from..self.key_ends[e - 1]).unwrap_or_default());
            // Below key_bytes, checked above.
            key_offsets.extend(self.key_ends[s..e].iter().map(|&end| (end - from + to) as u32));
            units.extend_from_slice(&self.units[s..e]);
            tokens.extend_from_slice(&self.tokens[s..e]);
            for (out, col) in rows.iter_mut().zip(&self.rows) {
                out.extend_from_slice(&col[s..e]);
            }
            tag_index.extend(self.tag_of[s..e].iter().map(|&t| {
                let m = &mut set_map[t as usize];
                if *m == u32::MAX {
                    *m = tag_sets.len() as u32;
                    tag_sets.push(self.tag_sets[t as usize].clone());
                }
                *m
            }));
        }
        if k == 0 {
            key_offsets.clear();
        }
        Ok(BatchMeta::from_checked_columns(
            partition.to_string(),
            self.schema.clone(),
            Arc::from(keys),
            key_offsets,
            units,
            tokens,
            rows,
            tag_sets,
            tag_index,
        ))
    }
}

/// `tags` with a name given twice kept once (the last value wins), as a merge would.
fn merged(base: &[(String, String)], add: &[(String, String)]) -> SampleTags {
    let mut tags = base.to_vec();
    for (k, v) in add {
        match tags.iter_mut().find(|(k2, _)| k2 == k) {
            Some(t) => t.1 = v.clone(),
            None => tags.push((k.clone(), v.clone())),
        }
    }
    tags.into()
}

/// The controller's state machine. Not thread-safe by itself; [`TqController`] shares it.
#[derive(Debug)]
pub struct Controller {
    partitions: HashMap<String, Partition>,
    lease: Duration,
    next_claim: u64,
    lost_units: BTreeMap<u32, String>,
}

impl Controller {
    /// A controller whose claims last `lease`.
    pub fn new(lease: Duration) -> Controller {
        Controller { partitions: HashMap::new(), lease, next_claim: 1, lost_units: BTreeMap::new() }
    }

    /// The claim lease.
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// Records samples (a put) or fields of existing samples (a write-back) that a storage unit
    /// now holds. All or nothing: on error nothing changes.
    pub fn register(&mut self, meta: &BatchMeta) -> Result<(), ControllerError> {
        let pname = &meta.partition;
        if pname.is_empty() {
            return Err(ControllerError::BadRequest("partition name is empty; name the step, e.g. `step-12`".into()));
        }
        if !self.lost_units.is_empty()
            && let Some((unit, reason)) = meta.units().iter().find_map(|u| Some((*u, self.lost_units.get(u)?)))
        {
            return Err(ControllerError::UnitLost { unit, reason: reason.clone() });
        }
        let empty = Partition::default();
        let part = self.partitions.get(pname).unwrap_or(&empty);
        if let Some((unit, reason)) = &part.lost {
            return Err(ControllerError::PartitionLost {
                partition: pname.clone(),
                unit: *unit,
                reason: reason.clone(),
            });
        }
        // Map the request's fields onto the partition's, checking shapes.
        let mut new_fields: Vec<FieldSpec> = Vec::new();
        let mut map = Vec::with_capacity(meta.schema.len());
        for f in &meta.schema {
            let existing = part.samples.schema.iter().position(|g| g.name == f.name);
            let idx = match existing {
                Some(i) => {
                    let g = &part.samples.schema[i];
                    if !g.same_shape(f) {
                        return Err(ControllerError::Schema {
                            partition: pname.clone(),
                            field: f.name.clone(),
                            problem: format!(
                                "sent as {:?}{} rows {:?}, but the partition holds it as {:?}{} rows {:?}; \
                                 write it under another name or with the same dtype and shape",
                                f.dtype,
                                if f.ragged { " ragged" } else { " fixed" },
                                f.inner,
                                g.dtype,
                                if g.ragged { " ragged" } else { " fixed" },
                                g.inner
                            ),
                        });
                    }
                    i
                }
                None => match new_fields.iter().position(|g| g.name == f.name) {
                    Some(_) => {
                        return Err(ControllerError::Schema {
                            partition: pname.clone(),
                            field: f.name.clone(),
                            problem: "appears twice in one request".into(),
                        });
                    }
                    None => {
                        new_fields.push(f.clone());
                        part.samples.schema.len() + new_fields.len() - 1
                    }
                },
            };
            map.push(idx);
        }
        if part.samples.schema.len() + new_fields.len() > MAX_FIELDS {
            return Err(ControllerError::Schema {
                partition: pname.clone(),
                field: new_fields.last().map(|f| f.name.clone()).unwrap_or_default(),
                problem: format!("a partition holds at most {MAX_FIELDS} fields; pack related values into one field"),
            });
        }
        let mut seen = std::collections::HashSet::with_capacity(meta.len());
        for s in meta.iter() {
            if !seen.insert(s.key()) {
                return Err(ControllerError::BadRequest(format!("key `{}` appears twice in one request", s.key())));
            }
            if let Some(&i) = part.by_key.get(s.key())
                && part.samples.units[i] != s.unit()
            {
                return Err(ControllerError::BadRequest(format!(
                    "key `{}` of partition `{pname}` already lives on storage unit {}, not {}; keys must be unique per step",
                    s.key(),
                    part.samples.units[i],
                    s.unit()
                )));
            }
        }
        // Apply.
        let part = self.partitions.entry(pname.clone()).or_default();
        for f in new_fields {
            part.samples.schema.push(f);
            part.samples.rows.push(vec![ABSENT; part.samples.len()]);
        }
        let req_rows: Vec<Option<&[u32]>> = (0..meta.schema.len()).map(|f| meta.field_rows(f)).collect();
        // The request's tag sets as the partition holds them, each added once.
        let (req_sets, req_index) = meta.tag_columns();
        let mut set_map: Vec<u32> = vec![u32::MAX; req_sets.len()];
        part.samples.key_bytes.reserve(meta.key_columns().0.len());
        for s in meta.iter() {
            let i = match part.by_key.get(s.key()) {
                Some(&i) => i,
                None => {
                    let i = part.samples.len();
                    part.samples.key_bytes.push_str(s.key());
                    part.samples.key_ends.push(part.samples.key_bytes.len());
                    part.samples.units.push(s.unit());
                    part.samples.tokens.push(s.tokens());
                    for col in &mut part.samples.rows {
                        col.push(ABSENT);
                    }
                    part.samples.present.push(0);
                    part.samples.tag_of.push(0);
                    part.by_key.insert(s.shared_key(), i);
                    part.units.insert(s.unit());
                    i
                }
            };
            for (req_idx, col) in req_rows.iter().enumerate() {
                let rows = col.map_or(ABSENT, |c| c[s.index()]);
                if rows == ABSENT {
                    continue;
                }
                let idx = map[req_idx];
                part.samples.rows[idx][i] = rows;
                part.samples.present[i] |= 1 << idx;
            }
            let t = req_index[s.index()] as usize;
            let add = &req_sets[t];
            if add.is_empty() {
                continue;
            }
            if part.samples.tag_of[i] == 0 {
                // The sample has no tags yet: it takes the request's set, shared with the other
                // samples of the request that name it.
                if set_map[t] == u32::MAX {
                    set_map[t] = part.samples.tag_sets.len() as u32;
                    part.samples.tag_sets.push(merged(&[], add));
                }
                part.samples.tag_of[i] = set_map[t];
            } else {
                let base = &part.samples.tag_sets[part.samples.tag_of[i] as usize];
                let tags = merged(base, add);
                part.samples.tag_of[i] = part.samples.tag_sets.len() as u32;
                part.samples.tag_sets.push(tags);
            }
        }
        Ok(())
    }

    /// Hands out up to `n` ready samples of `partition` (those having every `required` field)
    /// that `group` has not been handed yet, or whose lease expired unacknowledged — or none if
    /// fewer than `min` are ready (so a coordinator can claim a whole step at once). An unknown
    /// partition or field gives an empty claim (the producers may not have put yet); a lost
    /// partition gives [`ControllerError::PartitionLost`].
    pub fn claim(
        &mut self,
        partition: &str,
        group: &str,
        n: usize,
        min: usize,
        required: &[String],
        now: Instant,
    ) -> Result<Claim, ControllerError> {
        let id = self.next_claim;
        self.next_claim += 1;
        let lease = self.lease;
        let meta = BatchMeta::new(partition, Vec::new());
        let Some(part) = self.partitions.get_mut(partition) else {
            return Ok(Claim { group: group.into(), claim_id: id, lease, meta });
        };
        if let Some((unit, reason)) = &part.lost {
            return Err(ControllerError::PartitionLost {
                partition: partition.into(),
                unit: *unit,
                reason: reason.clone(),
            });
        }
        let meta = BatchMeta::new(partition, part.samples.schema.clone());
        let mut mask = 0u64;
        for f in required {
            match part.samples.schema.iter().position(|g| &g.name == f) {
                Some(i) => mask |= 1 << i,
                None => return Ok(Claim { group: group.into(), claim_id: id, lease, meta }),
            }
        }
        let g = part.groups.entry(group.to_string()).or_default();
        g.slots.resize(part.samples.len(), FREE);
        let present = &part.samples.present;
        let ready = |g: &Group, j: usize| g.claimable(g.slots[j], now) && present[j] & mask == mask;
        // The ready samples, as runs of consecutive ones (a whole step is one run).
        let mut runs: Vec<(usize, usize)> = Vec::new();
        let mut picked = 0usize;
        let mut i = g.first_open;
        while i < g.slots.len() && picked < n {
            if ready(g, i) {
                match runs.last_mut() {
                    Some((_, end)) if *end == i => *end = i + 1,
                    _ => runs.push((i, i + 1)),
                }
                picked += 1;
            }
            i += 1;
        }
        if picked < min {
            // With min > n, samples past the n picked count towards min too.
            let more = (i..g.slots.len()).filter(|&j| ready(g, j)).take(min - picked).count();
            if picked + more < min {
                return Ok(Claim { group: group.into(), claim_id: id, lease, meta });
            }
        }
        if picked == 0 {
            return Ok(Claim { group: group.into(), claim_id: id, lease, meta });
        }
        let slot = u32::try_from(g.claims.len() + 1).ok().filter(|&c| c != ACKED).ok_or_else(|| {
            ControllerError::BadRequest(format!(
                "group `{group}` has made {} claims of partition `{partition}`; use a new group or partition",
                g.claims.len()
            ))
        })?;
        let meta = part.samples.batch(partition, &runs, picked)?;
        g.claims.push((id, now + lease));
        for &(s, e) in &runs {
            g.slots[s..e].fill(slot);
        }
        Ok(Claim { group: group.into(), claim_id: id, lease, meta })
    }

    /// Acknowledges samples of a claim: they are done for the group and never handed out again.
    pub fn ack(
        &mut self,
        partition: &str,
        group: &str,
        claim_id: u64,
        keys: &[String],
    ) -> Result<AckReport, ControllerError> {
        let part = self.partitions.get_mut(partition).ok_or_else(|| {
            ControllerError::NotFound(format!("partition `{partition}` is not known (cleared already?)"))
        })?;
        let g = part.groups.get_mut(group).ok_or_else(|| {
            ControllerError::NotFound(format!("group `{group}` has claimed nothing of partition `{partition}`"))
        })?;
        let mut idx = Vec::with_capacity(keys.len());
        for k in keys {
            match part.by_key.get(k.as_str()) {
                Some(&i) if i < g.slots.len() => idx.push(i),
                _ => {
                    return Err(ControllerError::NotFound(format!(
                        "key `{k}` of partition `{partition}` was never claimed by group `{group}`"
                    )));
                }
            }
        }
        let mut report = AckReport { acked: 0, stale: Vec::new() };
        for i in idx {
            match g.slots[i] {
                ACKED => {}
                FREE => report.stale.push(part.samples.key(i).to_string()),
                c if g.claims[c as usize - 1].0 == claim_id => {
                    g.slots[i] = ACKED;
                    report.acked += 1;
                }
                _ => report.stale.push(part.samples.key(i).to_string()),
            }
        }
        while g.first_open < g.slots.len() && g.slots[g.first_open] == ACKED {
            g.first_open += 1;
        }
        Ok(report)
    }

    /// Forgets a partition; returns the storage units that held its samples (None if unknown).
    pub fn clear(&mut self, partition: &str) -> Option<Vec<u32>> {
        self.partitions.remove(partition).map(|p| p.units.into_iter().collect())
    }

    /// Marks a storage unit dead: every partition with samples on it is lost. Returns those
    /// partitions.
    pub fn mark_unit_lost(&mut self, unit: u32, reason: &str) -> Vec<String> {
        self.lost_units.entry(unit).or_insert_with(|| reason.to_string());
        let mut lost = Vec::new();
        for (name, p) in &mut self.partitions {
            if p.units.contains(&unit) && p.lost.is_none() {
                p.lost = Some((unit, reason.to_string()));
                lost.push(name.clone());
            }
        }
        lost.sort();
        lost
    }

    /// Units marked lost, with the reason.
    pub fn lost_units(&self) -> &BTreeMap<u32, String> {
        &self.lost_units
    }

    /// What the controller knows about a partition.
    pub fn status(&self, partition: &str, now: Instant) -> Option<PartitionStatus> {
        let p = self.partitions.get(partition)?;
        let mut groups: Vec<GroupStatus> = p
            .groups
            .iter()
            .map(|(name, g)| GroupStatus {
                group: name.clone(),
                claimed: g.slots.iter().filter(|&&s| g.leased(s, now)).count(),
                acked: g.slots.iter().filter(|&&s| s == ACKED).count(),
            })
            .collect();
        groups.sort_by(|a, b| a.group.cmp(&b.group));
        Some(PartitionStatus {
            samples: p.samples.len(),
            fields: p.samples.schema.iter().map(|f| f.name.clone()).collect(),
            units: p.units.iter().copied().collect(),
            lost: p.lost.clone(),
            groups,
        })
    }
}

// ---------------------------------------------------------------------------------------------
// The shared controller and its TCP service.

/// Settings of a [`TqController`].
#[derive(Clone, Debug)]
pub struct ControllerConfig {
    /// The job epoch's token and key, which every peer must prove it holds.
    pub auth: JobAuth,
    /// Claim lease.
    pub lease: Duration,
    /// Storage units: id → address.
    pub units: BTreeMap<u32, String>,
}

impl ControllerConfig {
    /// From the job's plan, authenticating with `auth`.
    pub fn from_plan(plan: &rlplane_api::WorkerPlan, auth: &JobAuth) -> ControllerConfig {
        ControllerConfig {
            auth: auth.clone(),
            lease: Duration::from_secs(plan.transfer_queue.lease_seconds as u64),
            units: plan.storage_units.iter().filter_map(|u| Some((u.id, plan.storage_address(u.id)?))).collect(),
        }
    }
}

/// Result of clearing a partition everywhere.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClearReport {
    /// Bytes freed across the storage units.
    pub freed: u64,
    /// Units that cleared it.
    pub units: u32,
    /// Units that could not be reached: `(unit, reason)`.
    pub unreachable: Vec<(u32, String)>,
}

/// The controller as the coordinator owns it: shared state, a TCP service, partition clearing in
/// every storage unit and a watch on the units. Cheap to clone.
#[derive(Clone, Debug)]
pub struct TqController {
    core: Arc<Mutex<Controller>>,
    config: Arc<ControllerConfig>,
    /// Units whose watch connection is up (see [`TqController::watch_units`]).
    watched: Arc<Mutex<BTreeSet<u32>>>,
    /// The job is over: units going away are expected, not lost.
    closed: Arc<std::sync::atomic::AtomicBool>,
    /// One connection per unit for clears, opened at the first and kept: a step's clear is then
    /// one small frame each way instead of a connection and an authenticated handshake per unit
    /// per step, which cost the units' processes CPU in the middle of the refit.
    clear_links: Arc<BTreeMap<u32, tokio::sync::Mutex<Option<TcpStream>>>>,
}

fn lock(core: &Mutex<Controller>) -> std::sync::MutexGuard<'_, Controller> {
    // A panic while holding the lock cannot leave the state half-updated (every method validates
    // before it mutates), so a poisoned lock is safe to keep using.
    core.lock().unwrap_or_else(|e| e.into_inner())
}

impl TqController {
    /// A controller with these settings.
    pub fn new(config: ControllerConfig) -> TqController {
        TqController {
            core: Arc::new(Mutex::new(Controller::new(config.lease))),
            clear_links: Arc::new(config.units.keys().map(|&u| (u, tokio::sync::Mutex::new(None))).collect()),
            config: Arc::new(config),
            watched: Arc::default(),
            closed: Arc::default(),
        }
    }

    /// The job is over: from now on a storage unit that goes away (its rank exiting) is not
    /// reported lost.
    pub fn close(&self) {
        self.closed.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// The settings.
    pub fn config(&self) -> &ControllerConfig {
        &self.config
    }

    /// See [`Controller::register`].
    pub fn register(&self, meta: &BatchMeta) -> Result<(), ControllerError> {
        lock(&self.core).register(meta)
    }

    /// See [`Controller::claim`].
    pub fn claim(
        &self,
        partition: &str,
        group: &str,
        n: usize,
        min: usize,
        required: &[String],
    ) -> Result<Claim, ControllerError> {
        lock(&self.core).claim(partition, group, n, min, required, Instant::now())
    }

    /// See [`Controller::ack`].
    pub fn ack(
        &self,
        partition: &str,
        group: &str,
        claim_id: u64,
        keys: &[String],
    ) -> Result<AckReport, ControllerError> {
        lock(&self.core).ack(partition, group, claim_id, keys)
    }

    /// See [`Controller::mark_unit_lost`].
    pub fn mark_unit_lost(&self, unit: u32, reason: &str) -> Vec<String> {
        let lost = lock(&self.core).mark_unit_lost(unit, reason);
        if !lost.is_empty() {
            tracing::warn!(unit, reason, partitions = ?lost, "transfer-queue storage unit lost");
        }
        lost
    }

    /// See [`Controller::status`].
    pub fn status(&self, partition: &str) -> Option<PartitionStatus> {
        lock(&self.core).status(partition, Instant::now())
    }

    /// Forgets `partition` and frees its bytes in every storage unit (all of them: a put may have
    /// stored bytes whose registration failed). Units that cannot be reached are reported, not
    /// fatal: a dead unit holds nothing any more.
    pub async fn clear(&self, partition: &str) -> ClearReport {
        lock(&self.core).clear(partition);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let lost = lock(&self.core).lost_units().clone();
        let jobs = self.config.units.iter().filter(|(u, _)| !lost.contains_key(u)).map(|(&unit, addr)| {
            let auth = &self.config.auth;
            let link = &self.clear_links[&unit];
            async move { (unit, clear_unit(link, addr, auth, partition, deadline).await) }
        });
        let mut report = ClearReport { freed: 0, units: 0, unreachable: Vec::new() };
        for (unit, r) in futures::future::join_all(jobs).await {
            match r {
                Ok(freed) => {
                    report.freed += freed;
                    report.units += 1;
                }
                Err(e) => report.unreachable.push((unit, e)),
            }
        }
        report
    }

    /// Serves clients on `listener` until the listener fails. Each connection runs on its own
    /// task; a bad frame gets an error reply and closes only its own connection.
    pub async fn serve(self, listener: TcpListener) -> Result<(), NetError> {
        net::serve_connections(listener, "controller clients", move |stream| {
            let this = self.clone();
            async move {
                if let Err(e) = this.serve_connection(stream).await {
                    tracing::debug!(error = %e, "transfer-queue controller connection ended");
                }
            }
        })
        .await
    }

    async fn serve_connection(&self, mut stream: TcpStream) -> Result<(), NetError> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        let hello =
            net::accept_hello(&mut stream, &self.config.auth, CONTROLLER_MAGIC, WIRE_VERSION, deadline, |_| Ok(()))
                .await?;
        let peer = hello.peer;
        let mut buf = Vec::new();
        let mut out = Vec::new();
        loop {
            for b in [&mut buf, &mut out] {
                if b.capacity() > codec::KEPT_BUFFER {
                    *b = Vec::new();
                }
            }
            let (header, body) = match codec::read_message(&mut stream, &mut buf).await {
                Ok(m) => m,
                Err(ReadError::Io(e)) => return Err(NetError::io("reading a request", peer.as_str(), e)),
                Err(ReadError::Codec(e)) => {
                    // Out of step with the peer: reply, then close.
                    let reply = Body::Error { code: ErrorCode::Malformed, message: e.to_string() };
                    let _ = codec::write_message(&mut stream, &self.reply_header(0), &reply).await;
                    return Err(NetError::Refused { peer, reason: e.to_string() });
                }
            };
            let reply = if header.token != self.config.auth.token() {
                Body::Error {
                    code: ErrorCode::Token,
                    message: format!(
                        "job token `{}` does not match `{}`: the client belongs to another job or epoch",
                        header.token,
                        self.config.auth.token()
                    ),
                }
            } else {
                self.handle(body).await
            };
            codec::write_message_with(&mut stream, &self.reply_header(header.request_id), &reply, &mut out)
                .await
                .map_err(|e| NetError::io("replying", peer.as_str(), e))?;
        }
    }

    fn reply_header(&self, request_id: u32) -> Header {
        Header { version: WIRE_VERSION, request_id, token: self.config.auth.token().to_string() }
    }

    async fn handle(&self, body: Body) -> Body {
        let err = |e: ControllerError| Body::Error { code: e.code(), message: e.to_string() };
        match body {
            Body::Register(meta) => self.register(&meta).map(|_| Body::Done).unwrap_or_else(err),
            Body::Claim { partition, group, n, min, required } => self
                .claim(&partition, &group, n as usize, min as usize, &required)
                .map(|c| Body::Claimed { claim_id: c.claim_id, lease_ms: c.lease.as_millis() as u64, meta: c.meta })
                .unwrap_or_else(err),
            Body::Ack { partition, group, claim_id, keys } => self
                .ack(&partition, &group, claim_id, &keys)
                .map(|r| Body::Acked { acked: r.acked, stale: r.stale })
                .unwrap_or_else(err),
            Body::Clear { partition } => {
                let r = self.clear(&partition).await;
                if r.unreachable.is_empty() {
                    Body::Cleared { freed: r.freed, units: r.units }
                } else {
                    Body::Error {
                        code: ErrorCode::UnitUnreachable,
                        message: format!(
                            "partition `{partition}` cleared in {} units ({} bytes), but these could not be reached: {}",
                            r.units,
                            r.freed,
                            r.unreachable.iter().map(|(u, e)| format!("unit {u}: {e}")).collect::<Vec<_>>().join("; ")
                        ),
                    }
                }
            }
            Body::ReportLost { unit, reason } => {
                if !self.config.units.contains_key(&unit) && !self.config.units.is_empty() {
                    return Body::Error {
                        code: ErrorCode::NotFound,
                        message: format!("storage unit {unit} is not in the plan"),
                    };
                }
                self.mark_unit_lost(unit, &reason);
                Body::Done
            }
            other => Body::Error {
                code: ErrorCode::BadRequest,
                message: format!("message kind {} is not a controller request", other.kind()),
            },
        }
    }

    /// Units whose watch connection is up now.
    pub fn watched_units(&self) -> Vec<u32> {
        self.watched.lock().unwrap_or_else(|e| e.into_inner()).iter().copied().collect()
    }

    /// Watches every storage unit: once connected, a unit whose connection drops or stops
    /// answering pings is marked lost (its partitions too). Units not up yet are retried. The
    /// watchers stop when the last handle of this controller is dropped.
    pub fn watch_units(&self, ping_every: Duration) {
        for (&unit, addr) in &self.config.units {
            let weak: Weak<Mutex<Controller>> = Arc::downgrade(&self.core);
            let addr = addr.clone();
            let auth = self.config.auth.clone();
            let watched = self.watched.clone();
            let closed = self.closed.clone();
            tokio::spawn(async move {
                let connected = || watched.lock().unwrap_or_else(|e| e.into_inner()).insert(unit);
                let reason = watch_unit(&addr, &auth, ping_every, || weak.strong_count() > 0, connected).await;
                watched.lock().unwrap_or_else(|e| e.into_inner()).remove(&unit);
                if closed.load(std::sync::atomic::Ordering::SeqCst) {
                    return;
                }
                if let (Some(core), Some(reason)) = (weak.upgrade(), reason) {
                    let lost = lock(&core).mark_unit_lost(unit, &reason);
                    tracing::warn!(unit, %addr, %reason, partitions = ?lost, "transfer-queue storage unit lost");
                }
            });
        }
    }
}

/// Connects to a storage unit as the controller, with the handshake.
pub(crate) async fn connect_unit(
    addr: &str,
    auth: &JobAuth,
    peer_name: &str,
    deadline: tokio::time::Instant,
) -> Result<TcpStream, NetError> {
    let mut s = net::connect_retry(addr, deadline, "transfer-queue storage").await?;
    let hello = Hello { magic: STORAGE_MAGIC, version: WIRE_VERSION, peer: peer_name.into(), extra: vec![] };
    net::send_hello(&mut s, auth, &hello, deadline, addr).await?;
    Ok(s)
}

/// Clears `partition` in the unit at `addr` over its kept connection `link` (opened if there is
/// none yet). A kept connection that fails is replaced once: the unit may have closed it.
async fn clear_unit(
    link: &tokio::sync::Mutex<Option<TcpStream>>,
    addr: &str,
    auth: &JobAuth,
    partition: &str,
    deadline: tokio::time::Instant,
) -> Result<u64, String> {
    let work = async {
        let mut link = link.lock().await;
        // Out of the slot while in use: a request cut short (the deadline) drops the connection
        // rather than leave its reply for the next clear to read.
        let mut kept = link.take();
        loop {
            let reused = kept.is_some();
            let mut s = match kept.take() {
                Some(s) => s,
                None => connect_unit(addr, auth, "tq-controller", deadline).await.map_err(|e| e.to_string())?,
            };
            match clear_request(&mut s, auth, partition).await {
                Ok(answer) => {
                    *link = Some(s);
                    return answer;
                }
                Err(e) if !reused => return Err(e),
                Err(_) => {}
            }
        }
    };
    match tokio::time::timeout_at(deadline, work).await {
        Ok(r) => r,
        Err(_) => Err(format!("no answer from {addr} within the deadline")),
    }
}

/// One clear request on `s`: the unit's answer (`Ok(Err)` when it refused), or the connection's
/// failure.
async fn clear_request(s: &mut TcpStream, auth: &JobAuth, partition: &str) -> Result<Result<u64, String>, String> {
    let h = Header { version: WIRE_VERSION, request_id: 1, token: auth.token().into() };
    codec::write_message(s, &h, &Body::ClearUnit { partition: partition.into() }).await.map_err(|e| e.to_string())?;
    let mut buf = Vec::new();
    Ok(match codec::read_message(s, &mut buf).await.map_err(|e| e.to_string())? {
        (_, Body::Cleared { freed, .. }) => Ok(freed),
        (_, Body::Error { message, .. }) => Err(message),
        (_, other) => Err(format!("unexpected reply kind {}", other.kind())),
    })
}

/// Returns why the unit is considered dead, or None if the watch ended because `alive` said so.
async fn watch_unit(
    addr: &str,
    auth: &JobAuth,
    ping_every: Duration,
    alive: impl Fn() -> bool,
    connected: impl FnOnce() -> bool,
) -> Option<String> {
    // Connect (the unit may start after the controller), retrying while the controller lives.
    let mut s = loop {
        if !alive() {
            return None;
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        match connect_unit(addr, auth, "tq-controller-watch", deadline).await {
            Ok(s) => {
                connected();
                break s;
            }
            Err(NetError::Refused { reason, .. }) => return Some(format!("refused the controller: {reason}")),
            Err(_) => continue,
        }
    };
    let mut buf = Vec::new();
    let h = Header { version: WIRE_VERSION, request_id: 0, token: auth.token().into() };
    let answer_within = ping_every.max(Duration::from_millis(100)) * 10;
    loop {
        if !alive() {
            return None;
        }
        if let Err(e) = codec::write_message(&mut s, &h, &Body::Ping).await {
            return Some(format!("connection to {addr} failed: {e}"));
        }
        match tokio::time::timeout(answer_within, codec::read_message(&mut s, &mut buf)).await {
            Ok(Ok((_, Body::Pong { .. }))) => {}
            Ok(Ok((_, other))) => return Some(format!("answered a ping with kind {}", other.kind())),
            Ok(Err(e)) => return Some(format!("connection to {addr} closed: {e}")),
            Err(_) => return Some(format!("no ping answer from {addr} within {answer_within:?}")),
        }
        tokio::time::sleep(ping_every).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::column::DType;

    fn meta(partition: &str, unit: u32, keys: std::ops::Range<u32>) -> BatchMeta {
        let mut b = BatchMeta::builder(partition, vec![FieldSpec::ragged("ids", DType::I64)]);
        let none = SampleTags::default();
        for i in keys {
            b.push(&format!("k{i}"), unit, i + 1, &[i + 1], &none).unwrap();
        }
        b.finish()
    }

    fn req(f: &str) -> Vec<String> {
        vec![f.to_string()]
    }

    #[test]
    fn each_sample_is_claimed_once_per_group_and_again_after_the_lease() {
        let mut c = Controller::new(Duration::from_secs(10));
        c.register(&meta("p", 0, 0..10)).unwrap();
        let t0 = Instant::now();
        let a = c.claim("p", "train", 4, 0, &req("ids"), t0).unwrap();
        let b = c.claim("p", "train", 100, 0, &req("ids"), t0).unwrap();
        assert_eq!(a.meta.len(), 4);
        assert_eq!(b.meta.len(), 6);
        assert!(c.claim("p", "train", 100, 0, &req("ids"), t0).unwrap().meta.is_empty());
        // Another group sees everything.
        assert_eq!(c.claim("p", "eval", 100, 0, &req("ids"), t0).unwrap().meta.len(), 10);
        // Ack a; b's lease runs out; b's samples come back, a's never.
        let keys: Vec<String> = a.meta.keys().map(String::from).collect();
        assert_eq!(c.ack("p", "train", a.claim_id, &keys).unwrap().acked, 4);
        let train = |c: &Controller, at| {
            let g = c.status("p", at).unwrap().groups.into_iter().find(|g| g.group == "train").unwrap();
            (g.claimed, g.acked)
        };
        assert_eq!(train(&c, t0), (6, 4));
        let later = t0 + Duration::from_secs(11);
        assert_eq!(train(&c, later), (0, 4), "b's lease ran out");
        let again = c.claim("p", "train", 100, 0, &req("ids"), later).unwrap();
        assert!(again.meta.keys().eq(b.meta.keys()));
        // b's late ack is stale for the keys the new claim holds.
        let bkeys: Vec<String> = b.meta.keys().map(String::from).collect();
        let r = c.ack("p", "train", b.claim_id, &bkeys).unwrap();
        assert_eq!((r.acked, r.stale.len()), (0, 6));
        assert_eq!(train(&c, later), (6, 4));
        // Acking again changes nothing; the new claim's ack counts.
        assert_eq!(c.ack("p", "train", a.claim_id, &keys).unwrap(), AckReport { acked: 0, stale: vec![] });
        assert_eq!(c.ack("p", "train", again.claim_id, &bkeys).unwrap().acked, 6);
        assert_eq!(train(&c, later), (0, 10));
        assert!(c.claim("p", "train", 100, 0, &req("ids"), later + Duration::from_secs(60)).unwrap().meta.is_empty());
    }

    #[test]
    fn required_fields_gate_readiness_and_write_back_adds_them() {
        let mut c = Controller::new(Duration::from_secs(10));
        c.register(&meta("p", 0, 0..3)).unwrap();
        let now = Instant::now();
        assert!(c.claim("p", "g", 10, 0, &req("old_logprobs"), now).unwrap().meta.is_empty());
        let mut wb = BatchMeta::builder("p", vec![FieldSpec::ragged("old_logprobs", DType::F32)]);
        wb.push("k1", 0, 0, &[2], &SampleTags::default()).unwrap();
        let wb = wb.finish();
        c.register(&wb).unwrap();
        let got = c.claim("p", "g", 10, 0, &["ids".into(), "old_logprobs".into()], now).unwrap();
        assert_eq!(got.meta.keys().collect::<Vec<_>>(), ["k1"]);
        assert_eq!(got.meta.sample(0).all_rows().collect::<Vec<_>>(), [2, 2]);
        assert_eq!(got.meta.sample(0).tokens(), 2, "a write-back keeps the sample's tokens");
    }

    #[test]
    fn schema_conflicts_and_bad_requests_change_nothing() {
        let mut c = Controller::new(Duration::from_secs(10));
        c.register(&meta("p", 0, 0..2)).unwrap();
        let mut bad = meta("p", 0, 5..6);
        bad.schema[0].dtype = DType::I32;
        let e = c.register(&bad).unwrap_err();
        assert!(matches!(e, ControllerError::Schema { ref field, .. } if field == "ids"), "{e}");
        let moved = meta("p", 1, 0..1);
        assert!(c.register(&moved).unwrap_err().to_string().contains("already lives on storage unit 0"));
        assert_eq!(c.status("p", Instant::now()).unwrap().samples, 2);
    }

    #[test]
    fn a_lost_unit_loses_its_partitions_only() {
        let mut c = Controller::new(Duration::from_secs(10));
        c.register(&meta("a", 0, 0..2)).unwrap();
        c.register(&meta("b", 1, 0..2)).unwrap();
        assert_eq!(c.mark_unit_lost(1, "connection closed"), vec!["b".to_string()]);
        let e = c.claim("b", "g", 1, 0, &[], Instant::now()).unwrap_err();
        assert!(e.to_string().contains("storage unit 1") && e.to_string().contains("connection closed"), "{e}");
        assert_eq!(c.claim("a", "g", 5, 0, &[], Instant::now()).unwrap().meta.len(), 2);
        assert!(matches!(c.register(&meta("c", 1, 0..1)), Err(ControllerError::UnitLost { unit: 1, .. })));
        assert_eq!(c.clear("b"), Some(vec![1]));
        assert!(c.status("b", Instant::now()).is_none());
    }

    #[test]
    fn claims_hand_out_each_samples_columns_and_tags_as_registered() {
        let mut c = Controller::new(Duration::from_secs(10));
        let schema = vec![FieldSpec::ragged("ids", DType::I64), FieldSpec::fixed("r", DType::F32, vec![])];
        let group_a: SampleTags = vec![("uid".to_string(), "a".to_string())].into();
        let mut b = BatchMeta::builder("p", schema.clone());
        for i in 0..10u32 {
            let own: SampleTags = vec![("n".to_string(), i.to_string())].into();
            let tags = match i % 3 {
                0 => &group_a,
                1 => &own,
                _ => &SampleTags::default(),
            };
            b.push(&format!("key-{i}"), i % 2, 100 + i, &[i, if i == 4 { ABSENT } else { 1 }], tags).unwrap();
        }
        c.register(&b.finish()).unwrap();
        let now = Instant::now();
        // Take samples 1 and 5 out first: the next claim is of non-consecutive samples.
        let first = c.claim("p", "g", 2, 0, &[], now).unwrap();
        assert_eq!(first.meta.keys().collect::<Vec<_>>(), ["key-0", "key-1"]);
        let r = c.claim("p", "g", 100, 0, &["ids".into(), "r".into()], now).unwrap();
        let want: Vec<u32> = vec![2, 3, 5, 6, 7, 8, 9];
        assert_eq!(r.meta.keys().collect::<Vec<_>>(), want.iter().map(|i| format!("key-{i}")).collect::<Vec<_>>());
        assert_eq!(r.meta.units(), want.iter().map(|i| i % 2).collect::<Vec<_>>());
        assert_eq!(r.meta.tokens(), want.iter().map(|i| 100 + i).collect::<Vec<_>>());
        assert_eq!(r.meta.field_rows(0), Some(&want[..]));
        assert_eq!(r.meta.schema, schema);
        for s in &r.meta {
            let i = want[s.index()];
            let expect: Vec<(String, String)> = match i % 3 {
                0 => vec![("uid".into(), "a".into())],
                1 => vec![("n".into(), i.to_string())],
                _ => vec![],
            };
            assert_eq!(s.tags(), expect, "sample {i}");
        }
        // One set for the group's shared tags (samples 3, 6, 9), one each for 7's own, one empty.
        assert_eq!(r.meta.tag_columns().0.len(), 3);
        // Sample 4 lacks `r`: a claim not requiring it gets it with the field absent.
        let rest = c.claim("p", "g", 100, 0, &["ids".into()], now).unwrap();
        assert_eq!(rest.meta.keys().collect::<Vec<_>>(), ["key-4"]);
        assert_eq!(rest.meta.sample(0).all_rows().collect::<Vec<_>>(), [4, ABSENT]);
    }

    #[test]
    fn registering_tags_again_merges_them_and_the_last_value_wins() {
        let mut c = Controller::new(Duration::from_secs(10));
        let reg = |c: &mut Controller, tags: &[(&str, &str)]| {
            let tags: SampleTags = tags.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
            let mut b = BatchMeta::builder("p", vec![FieldSpec::ragged("ids", DType::I64)]);
            b.push("k", 0, 1, &[1], &tags).unwrap();
            b.push("plain", 0, 1, &[1], &SampleTags::default()).unwrap();
            c.register(&b.finish()).unwrap();
        };
        reg(&mut c, &[("a", "1"), ("a", "2")]);
        reg(&mut c, &[]);
        let tags_of = |c: &mut Controller, g: &str| {
            let m = c.claim("p", g, 10, 0, &[], Instant::now()).unwrap().meta;
            m.iter().map(|s| s.tags().to_vec()).collect::<Vec<_>>()
        };
        let pair = |k: &str, v: &str| (k.to_string(), v.to_string());
        assert_eq!(tags_of(&mut c, "g0"), [vec![pair("a", "2")], vec![]]);
        reg(&mut c, &[("b", "x"), ("a", "3")]);
        assert_eq!(tags_of(&mut c, "g1"), [vec![pair("a", "3"), pair("b", "x")], vec![]]);
        assert_eq!(c.status("p", Instant::now()).unwrap().samples, 2);
    }

    #[test]
    fn a_minimum_above_n_counts_the_samples_past_the_first_n() {
        let mut c = Controller::new(Duration::from_secs(10));
        c.register(&meta("p", 0, 0..10)).unwrap();
        let now = Instant::now();
        assert!(c.claim("p", "g", 3, 11, &[], now).unwrap().meta.is_empty(), "only 10 ready");
        assert_eq!(c.claim("p", "g", 3, 10, &[], now).unwrap().meta.len(), 3);
    }

    #[test]
    fn every_group_claims_a_whole_4096_sample_partition_at_once() {
        // The coordinator claims a whole step in one call; its latency is measured by
        // `rlplane bench tq` (claim_all), not here.
        let mut c = Controller::new(Duration::from_secs(10));
        c.register(&meta("p", 0, 0..4096)).unwrap();
        for round in 0..3 {
            let group = format!("g{round}");
            let got = c.claim("p", &group, 4096, 4096, &req("ids"), Instant::now()).unwrap();
            let keys: Vec<&str> = got.meta.keys().collect();
            assert_eq!(keys.len(), 4096);
            assert_eq!(keys.iter().collect::<BTreeSet<_>>().len(), 4096, "every sample once");
            assert!(c.claim("p", &group, 4096, 0, &req("ids"), Instant::now()).unwrap().meta.is_empty());
        }
    }
}
