//! The controller's state machine: which (sample, field) pairs exist, where, and who claimed
//! them. Deterministic and synchronous: requests are plain values, the clock is passed in, and
//! nothing here touches a socket or a runtime, so every transition is tested directly.
//!
//! Claims: [`Controller::claim`] hands out ready samples (those having every required field),
//! each exactly once per consumer group, under a lease. A claim not acknowledged before its lease
//! expires (the consumer died) is claimable again; nothing is lost.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::codec::ErrorCode;
use crate::column::{ABSENT, BatchMeta, FieldSpec, SampleKey, SampleRef, SampleTags};

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

    /// Merges the tags `add` into sample `i`'s. `shared` is the set the partition holds for
    /// `add` alone (`u32::MAX` until one is added), which samples without tags share.
    fn add_tags(&mut self, i: usize, add: &SampleTags, shared: &mut u32) {
        if add.is_empty() {
            return;
        }
        if self.tag_of[i] == 0 {
            // The sample has no tags yet: it takes the request's set, shared with the other
            // samples of the request that name it.
            if *shared == u32::MAX {
                *shared = self.tag_sets.len() as u32;
                self.tag_sets.push(merged(&[], add));
            }
            self.tag_of[i] = *shared;
        } else {
            let base = &self.tag_sets[self.tag_of[i] as usize];
            let tags = merged(base, add);
            self.tag_of[i] = self.tag_sets.len() as u32;
            self.tag_sets.push(tags);
        }
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

/// Where a request's fields go in a partition: the fields new to it (appended to its schema in
/// this order) and, per field of the request, its index in the partition's schema.
struct FieldMap {
    new_fields: Vec<FieldSpec>,
    index: Vec<usize>,
}

impl Partition {
    /// Maps a request's fields (`schema`) onto the partition's, checking shapes.
    fn map_fields(&self, partition: &str, schema: &[FieldSpec]) -> Result<FieldMap, ControllerError> {
        let known = &self.samples.schema;
        let mut new_fields: Vec<FieldSpec> = Vec::new();
        let mut index = Vec::with_capacity(schema.len());
        for f in schema {
            let existing = known.iter().position(|g| g.name == f.name);
            let idx = match existing {
                Some(i) => {
                    let g = &known[i];
                    if !g.same_shape(f) {
                        return Err(ControllerError::Schema {
                            partition: partition.into(),
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
                            partition: partition.into(),
                            field: f.name.clone(),
                            problem: "appears twice in one request".into(),
                        });
                    }
                    None => {
                        new_fields.push(f.clone());
                        known.len() + new_fields.len() - 1
                    }
                },
            };
            index.push(idx);
        }
        if known.len() + new_fields.len() > MAX_FIELDS {
            return Err(ControllerError::Schema {
                partition: partition.into(),
                field: new_fields.last().map(|f| f.name.clone()).unwrap_or_default(),
                problem: format!("a partition holds at most {MAX_FIELDS} fields; pack related values into one field"),
            });
        }
        Ok(FieldMap { new_fields, index })
    }

    /// Checks a request's keys: each given once, and one the partition holds already on the
    /// storage unit that holds it (a write-back adds fields where the sample is).
    fn check_keys(&self, partition: &str, meta: &BatchMeta) -> Result<(), ControllerError> {
        let mut seen = std::collections::HashSet::with_capacity(meta.len());
        for s in meta.iter() {
            if !seen.insert(s.key()) {
                return Err(ControllerError::BadRequest(format!("key `{}` appears twice in one request", s.key())));
            }
            if let Some(&i) = self.by_key.get(s.key())
                && self.samples.units[i] != s.unit()
            {
                return Err(ControllerError::BadRequest(format!(
                    "key `{}` of partition `{partition}` already lives on storage unit {}, not {}; keys must be unique per step",
                    s.key(),
                    self.samples.units[i],
                    s.unit()
                )));
            }
        }
        Ok(())
    }

    /// Adds a checked request ([`Partition::map_fields`] gave `fields`,
    /// [`Partition::check_keys`] passed): its new fields, new samples, rows and tags.
    fn apply(&mut self, meta: &BatchMeta, fields: FieldMap) {
        for f in fields.new_fields {
            self.samples.schema.push(f);
            self.samples.rows.push(vec![ABSENT; self.samples.len()]);
        }
        let req_rows: Vec<Option<&[u32]>> = (0..meta.schema.len()).map(|f| meta.field_rows(f)).collect();
        // The request's tag sets as the partition holds them, each added once.
        let (req_sets, req_index) = meta.tag_columns();
        let mut set_map: Vec<u32> = vec![u32::MAX; req_sets.len()];
        self.samples.key_bytes.reserve(meta.key_columns().0.len());
        for s in meta.iter() {
            let i = match self.by_key.get(s.key()) {
                Some(&i) => i,
                None => self.add_sample(&s),
            };
            for (req_idx, col) in req_rows.iter().enumerate() {
                let rows = col.map_or(ABSENT, |c| c[s.index()]);
                if rows == ABSENT {
                    continue;
                }
                let idx = fields.index[req_idx];
                self.samples.rows[idx][i] = rows;
                self.samples.present[i] |= 1 << idx;
            }
            let t = req_index[s.index()] as usize;
            self.samples.add_tags(i, &req_sets[t], &mut set_map[t]);
        }
    }

    /// Adds sample `s` with no fields and no tags yet; returns its index.
    fn add_sample(&mut self, s: &SampleRef<'_>) -> usize {
        let samples = &mut self.samples;
        let i = samples.len();
        samples.key_bytes.push_str(s.key());
        samples.key_ends.push(samples.key_bytes.len());
        samples.units.push(s.unit());
        samples.tokens.push(s.tokens());
        for col in &mut samples.rows {
            col.push(ABSENT);
        }
        samples.present.push(0);
        samples.tag_of.push(0);
        self.by_key.insert(s.shared_key(), i);
        self.units.insert(s.unit());
        i
    }
}

/// The controller's state machine. Not thread-safe by itself; [`TqController`](super::TqController) shares it.
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
        let fields = part.map_fields(pname, &meta.schema)?;
        part.check_keys(pname, meta)?;
        // Checked: from here on nothing fails.
        self.partitions.entry(pname.clone()).or_default().apply(meta, fields);
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
