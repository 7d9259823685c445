//! Columns, field specs and sample metadata: the data model of the transfer queue.
//!
//! A *partition* (one RL step) holds *samples*, each keyed by a string (`"{uid}_g{i}"`). A sample's
//! *fields* are columns: a [`Column`] holds one field for many samples in one contiguous
//! little-endian buffer. Ragged fields (per-token tensors of variable length) carry `offsets` in
//! rows — sample `i` owns rows `offsets[i]..offsets[i+1]` — and are never padded. Fixed fields hold
//! one row per sample. A row has shape `inner` (empty for scalars and plain token sequences).

use std::sync::Arc;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

/// Element type of a column, with numpy's name for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DType {
    /// `bool` (one byte, 0 or 1).
    Bool,
    /// `u8` (also opaque bytes).
    U8,
    /// `i8`.
    I8,
    /// `u16`.
    U16,
    /// `i16`.
    I16,
    /// `u32`.
    U32,
    /// `i32`.
    I32,
    /// `u64`.
    U64,
    /// `i64` (token ids).
    I64,
    /// IEEE half.
    F16,
    /// bfloat16.
    BF16,
    /// `f32` (log-probabilities).
    F32,
    /// `f64`.
    F64,
}

impl DType {
    /// Every dtype, in wire-code order.
    pub const ALL: [DType; 13] = [
        DType::Bool,
        DType::U8,
        DType::I8,
        DType::U16,
        DType::I16,
        DType::U32,
        DType::I32,
        DType::U64,
        DType::I64,
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::F64,
    ];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::Bool | DType::U8 | DType::I8 => 1,
            DType::U16 | DType::I16 | DType::F16 | DType::BF16 => 2,
            DType::U32 | DType::I32 | DType::F32 => 4,
            DType::U64 | DType::I64 | DType::F64 => 8,
        }
    }

    /// Wire code (index in [`DType::ALL`]).
    pub fn code(self) -> u8 {
        DType::ALL.iter().position(|&d| d == self).expect("every dtype is in ALL") as u8
    }

    /// The dtype of a wire code.
    pub fn from_code(code: u8) -> Option<DType> {
        DType::ALL.get(code as usize).copied()
    }

    /// numpy's dtype string (`"<i8"`, `"<f4"`, ...); bfloat16 has none in numpy (`"<V2"`, raw).
    pub fn numpy(self) -> &'static str {
        match self {
            DType::Bool => "|b1",
            DType::U8 => "|u1",
            DType::I8 => "|i1",
            DType::U16 => "<u2",
            DType::I16 => "<i2",
            DType::U32 => "<u4",
            DType::I32 => "<i4",
            DType::U64 => "<u8",
            DType::I64 => "<i8",
            DType::F16 => "<f2",
            DType::BF16 => "<V2",
            DType::F32 => "<f4",
            DType::F64 => "<f8",
        }
    }
}

/// Rust element types a [`Column`] can be built from and read as.
pub trait Element: Copy + 'static {
    /// The column dtype.
    const DTYPE: DType;
    /// Appends the little-endian bytes.
    fn put_le(self, out: &mut Vec<u8>);
    /// Reads from exactly `size` little-endian bytes.
    fn from_le(b: &[u8]) -> Self;
}

macro_rules! element {
    ($t:ty, $d:expr) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            fn put_le(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
            fn from_le(b: &[u8]) -> Self {
                <$t>::from_le_bytes(b.try_into().expect("caller passes exactly size_of bytes"))
            }
        }
    };
}
element!(u8, DType::U8);
element!(i8, DType::I8);
element!(u16, DType::U16);
element!(i16, DType::I16);
element!(u32, DType::U32);
element!(i32, DType::I32);
element!(u64, DType::U64);
element!(i64, DType::I64);
element!(f32, DType::F32);
element!(f64, DType::F64);

/// Name, dtype and shape of a field (a column of a partition).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct FieldSpec {
    /// Field name (`input_ids`, `logprobs`, ...).
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Ragged: each sample has a variable number of rows (values + offsets on the wire).
    /// Fixed: each sample has exactly one row.
    pub ragged: bool,
    /// Shape of one row (empty for scalars and plain per-token sequences).
    pub inner: Vec<u32>,
}

impl FieldSpec {
    /// A ragged field of scalar rows (e.g. per-token ids).
    pub fn ragged(name: impl Into<String>, dtype: DType) -> FieldSpec {
        FieldSpec { name: name.into(), dtype, ragged: true, inner: vec![] }
    }

    /// A fixed field of one row of shape `inner` per sample (`inner` empty: a scalar).
    pub fn fixed(name: impl Into<String>, dtype: DType, inner: Vec<u32>) -> FieldSpec {
        FieldSpec { name: name.into(), dtype, ragged: false, inner }
    }

    /// Bytes of one row; `None` if it overflows (a malformed spec).
    pub fn row_bytes(&self) -> Option<u64> {
        self.inner.iter().try_fold(self.dtype.size() as u64, |acc, &d| acc.checked_mul(d as u64))
    }

    /// Same dtype, raggedness and row shape (names aside).
    pub fn same_shape(&self, other: &FieldSpec) -> bool {
        self.dtype == other.dtype && self.ragged == other.ragged && self.inner == other.inner
    }
}

/// Errors building or validating a column. Each names the field and the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("column `{field}`: {problem}")]
pub struct ColumnError {
    /// Field.
    pub field: String,
    /// What is wrong and how to fix it.
    pub problem: String,
}

/// One field for many samples, in one contiguous little-endian buffer.
#[derive(Clone, Debug, PartialEq)]
pub struct Column {
    spec: FieldSpec,
    values: Bytes,
    /// Ragged: `len + 1` row offsets starting at 0. Fixed: empty.
    offsets: Vec<u64>,
    len: usize,
    row_bytes: usize,
}

impl Column {
    /// A ragged column from per-sample slices.
    pub fn ragged<T: Element>(name: impl Into<String>, samples: &[&[T]]) -> Column {
        let spec = FieldSpec::ragged(name, T::DTYPE);
        let total: usize = samples.iter().map(|s| s.len()).sum();
        let mut values = Vec::with_capacity(total * T::DTYPE.size());
        let mut offsets = Vec::with_capacity(samples.len() + 1);
        offsets.push(0u64);
        for s in samples {
            for &x in *s {
                x.put_le(&mut values);
            }
            offsets.push(offsets.last().copied().unwrap_or(0) + s.len() as u64);
        }
        let row_bytes = T::DTYPE.size();
        Column { spec, values: Bytes::from(values), offsets, len: samples.len(), row_bytes }
    }

    /// A fixed column of scalars, one per sample.
    pub fn scalars<T: Element>(name: impl Into<String>, values: &[T]) -> Column {
        let spec = FieldSpec::fixed(name, T::DTYPE, vec![]);
        let mut buf = Vec::with_capacity(values.len() * T::DTYPE.size());
        for &x in values {
            x.put_le(&mut buf);
        }
        Column { spec, values: Bytes::from(buf), offsets: vec![], len: values.len(), row_bytes: T::DTYPE.size() }
    }

    /// A ragged column of opaque bytes (dtype u8), one blob per sample.
    pub fn blobs(name: impl Into<String>, samples: &[&[u8]]) -> Column {
        Column::ragged::<u8>(name, samples)
    }

    /// A column from raw parts, validated: `values` little-endian, `offsets` (ragged) in rows with
    /// `len + 1` entries starting at 0 and never decreasing, the last one matching `values`.
    pub fn from_parts(spec: FieldSpec, len: usize, values: Bytes, offsets: Vec<u64>) -> Result<Column, ColumnError> {
        let err = |problem: String| ColumnError { field: spec.name.clone(), problem };
        let row_bytes = spec
            .row_bytes()
            .filter(|&b| b > 0 && b <= u32::MAX as u64)
            .ok_or_else(|| err(format!("row shape {:?} gives a row size that is zero or too large", spec.inner)))?
            as usize;
        if spec.ragged {
            if offsets.len() != len + 1 {
                return Err(err(format!(
                    "{} offsets for {len} samples; a ragged column needs samples + 1 offsets",
                    offsets.len()
                )));
            }
            if offsets[0] != 0 {
                return Err(err(format!("offsets start at {} instead of 0", offsets[0])));
            }
            if let Some(i) = offsets.windows(2).position(|w| w[1] < w[0] || w[1] - w[0] > u32::MAX as u64) {
                return Err(err(format!(
                    "offsets decrease (or jump by more than 2^32 rows) between sample {i} and {}",
                    i + 1
                )));
            }
            let rows = offsets[len];
            if rows.checked_mul(row_bytes as u64) != Some(values.len() as u64) {
                return Err(err(format!("{rows} rows of {row_bytes} bytes do not match {} value bytes", values.len())));
            }
        } else {
            if !offsets.is_empty() {
                return Err(err("a fixed column has no offsets; drop them or declare the field ragged".into()));
            }
            if (len as u64).checked_mul(row_bytes as u64) != Some(values.len() as u64) {
                return Err(err(format!(
                    "{len} samples of {row_bytes} bytes do not match {} value bytes",
                    values.len()
                )));
            }
        }
        Ok(Column { spec, values, offsets, len, row_bytes })
    }

    /// The field spec.
    pub fn spec(&self) -> &FieldSpec {
        &self.spec
    }

    /// The field name.
    pub fn name(&self) -> &str {
        &self.spec.name
    }

    /// Renames the column (e.g. to write back under another field name).
    pub fn with_name(mut self, name: impl Into<String>) -> Column {
        self.spec.name = name.into();
        self
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.len
    }

    /// No samples.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// All values, little-endian.
    pub fn values(&self) -> &Bytes {
        &self.values
    }

    /// Row offsets (ragged) or empty (fixed).
    pub fn offsets(&self) -> &[u64] {
        &self.offsets
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// Rows of sample `i` (1 for fixed columns).
    pub fn rows(&self, i: usize) -> u32 {
        if self.spec.ragged { (self.offsets[i + 1] - self.offsets[i]) as u32 } else { 1 }
    }

    /// Byte range of sample `i` in [`Column::values`].
    pub fn sample_range(&self, i: usize) -> std::ops::Range<usize> {
        if self.spec.ragged {
            self.offsets[i] as usize * self.row_bytes..self.offsets[i + 1] as usize * self.row_bytes
        } else {
            i * self.row_bytes..(i + 1) * self.row_bytes
        }
    }

    /// The bytes of sample `i`, sharing the column's buffer (no copy).
    pub fn sample_bytes(&self, i: usize) -> Bytes {
        self.values.slice(self.sample_range(i))
    }

    /// Sample `i` decoded as `T` (a copy; for tests and small reads).
    pub fn sample_as<T: Element>(&self, i: usize) -> Result<Vec<T>, ColumnError> {
        if T::DTYPE != self.spec.dtype {
            return Err(ColumnError {
                field: self.spec.name.clone(),
                problem: format!("read as {:?} but the column holds {:?}", T::DTYPE, self.spec.dtype),
            });
        }
        let size = T::DTYPE.size();
        Ok(self.values[self.sample_range(i)].chunks_exact(size).map(T::from_le).collect())
    }

    /// Total value bytes.
    pub fn nbytes(&self) -> usize {
        self.values.len()
    }
}

/// Row count meaning "this sample does not have this field (yet)".
pub const ABSENT: u32 = u32::MAX;

/// A sample's key within its partition: a string that shares its buffer. Keys decoded from one
/// message share one buffer (the message's key bytes), and cloning one allocates nothing, so the
/// controller hands out a claim's metadata, and a client decodes one, without an allocation per
/// key. Compares, hashes and orders as its string.
#[derive(Clone)]
pub struct SampleKey {
    buf: Arc<str>,
    start: usize,
    end: usize,
}

impl SampleKey {
    /// The key `buf[range]`, sharing `buf`; `None` if the range is out of bounds or not on
    /// character boundaries.
    pub fn shared(buf: &Arc<str>, range: std::ops::Range<usize>) -> Option<SampleKey> {
        buf.get(range.clone())?;
        Some(SampleKey { buf: buf.clone(), start: range.start, end: range.end })
    }

    /// The key as a string.
    pub fn as_str(&self) -> &str {
        &self.buf[self.start..self.end]
    }
}

impl From<&str> for SampleKey {
    fn from(s: &str) -> SampleKey {
        SampleKey::from(Arc::<str>::from(s))
    }
}

impl From<String> for SampleKey {
    fn from(s: String) -> SampleKey {
        SampleKey::from(Arc::<str>::from(s))
    }
}

impl From<Arc<str>> for SampleKey {
    fn from(buf: Arc<str>) -> SampleKey {
        SampleKey { end: buf.len(), buf, start: 0 }
    }
}

impl std::ops::Deref for SampleKey {
    type Target = str;
    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl AsRef<str> for SampleKey {
    fn as_ref(&self) -> &str {
        self.as_str()
    }
}

impl std::borrow::Borrow<str> for SampleKey {
    fn borrow(&self) -> &str {
        self.as_str()
    }
}

impl PartialEq for SampleKey {
    fn eq(&self, other: &SampleKey) -> bool {
        self.as_str() == other.as_str()
    }
}

impl Eq for SampleKey {}

impl PartialEq<str> for SampleKey {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<&str> for SampleKey {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl PartialOrd for SampleKey {
    fn partial_cmp(&self, other: &SampleKey) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for SampleKey {
    fn cmp(&self, other: &SampleKey) -> std::cmp::Ordering {
        self.as_str().cmp(other.as_str())
    }
}

impl std::hash::Hash for SampleKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.as_str().hash(state)
    }
}

impl std::fmt::Debug for SampleKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self.as_str(), f)
    }
}

impl std::fmt::Display for SampleKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for SampleKey {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for SampleKey {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<SampleKey, D::Error> {
        String::deserialize(d).map(SampleKey::from)
    }
}

/// A sample's free-form tags, shared: samples with the same tags may share one set, and handing
/// a set out (a claim) clones a pointer, not the strings.
pub type SampleTags = Arc<[(String, String)]>;

/// Batch metadata that cannot be built as asked. Names the partition and what to fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("batch metadata of partition `{partition}`: {problem}")]
pub struct MetaError {
    /// Partition.
    pub partition: String,
    /// What is wrong and how to fix it.
    pub problem: String,
}

/// Metadata of a batch of samples of one partition: the schema and each sample's key, storage
/// unit, token count, rows per field and tags. Everything [`crate::client::TqClient::get`]
/// needs to fetch the bytes.
///
/// Columnar, like its wire form (`docs/transfer-queue.md`, "Batch metadata"): every key in one
/// shared buffer with `n + 1` byte offsets, one `u32` array each for units and tokens, one `u32`
/// array of rows per field, and a tag-set index per sample into the distinct tag sets. There is
/// no per-sample struct: building a claim of 4096 samples copies key bytes and `u32`s, encoding
/// and decoding one copies arrays, and dropping one frees a handful of buffers.
///
/// Build one with [`BatchMetaBuilder`]; read samples with [`BatchMeta::sample`] /
/// [`BatchMeta::iter`] (a [`SampleRef`] each) or whole columns ([`BatchMeta::keys`],
/// [`BatchMeta::units`], [`BatchMeta::tokens`], [`BatchMeta::field_rows`]). Rows are kept per
/// field in `schema` order; a field appended to `schema` afterwards reads as [`ABSENT`] for every
/// sample. Two metas are equal when they hold the same samples (keys, units, tokens, rows and
/// tag contents) in the same order, however their tag sets are shared.
#[derive(Clone, Default)]
pub struct BatchMeta {
    /// Partition (RL step), e.g. `step-12`.
    pub partition: String,
    /// Fields known for the partition.
    pub schema: Vec<FieldSpec>,
    /// Every key's UTF-8, back to back.
    keys: Arc<str>,
    /// `len + 1` byte offsets into `keys` (empty when there are no samples): key `i` is
    /// `keys[key_offsets[i]..key_offsets[i + 1]]`. Start at 0, never decrease, on character
    /// boundaries.
    key_offsets: Vec<u32>,
    /// Storage unit per sample; its length is the number of samples.
    units: Vec<u32>,
    /// Token count per sample.
    tokens: Vec<u32>,
    /// Per field (schema order), rows per sample; [`ABSENT`] where the sample lacks the field.
    rows: Vec<Vec<u32>>,
    /// The distinct tag sets.
    tag_sets: Vec<SampleTags>,
    /// Per sample, its index in `tag_sets`.
    tag_index: Vec<u32>,
}

/// One sample of a [`BatchMeta`], borrowed: its key, unit, tokens, rows and tags.
#[derive(Clone, Copy)]
pub struct SampleRef<'a> {
    meta: &'a BatchMeta,
    i: usize,
}

impl<'a> SampleRef<'a> {
    /// Position in the batch.
    pub fn index(&self) -> usize {
        self.i
    }

    /// Sample key within its partition.
    pub fn key(&self) -> &'a str {
        self.meta.key(self.i)
    }

    /// The key as a [`SampleKey`] sharing the batch's key buffer (no allocation).
    pub fn shared_key(&self) -> SampleKey {
        let o = &self.meta.key_offsets;
        SampleKey { buf: self.meta.keys.clone(), start: o[self.i] as usize, end: o[self.i + 1] as usize }
    }

    /// Storage unit holding its fields.
    pub fn unit(&self) -> u32 {
        self.meta.units[self.i]
    }

    /// Token count used for balancing (prompt + response).
    pub fn tokens(&self) -> u32 {
        self.meta.tokens[self.i]
    }

    /// Rows of field `field` (an index into the schema); [`ABSENT`] where the sample lacks it.
    pub fn rows(&self, field: usize) -> u32 {
        self.meta.rows.get(field).and_then(|r| r.get(self.i)).copied().unwrap_or(ABSENT)
    }

    /// Rows per field, in schema order.
    pub fn all_rows(&self) -> impl ExactSizeIterator<Item = u32> + 'a {
        let (meta, i) = (self.meta, self.i);
        (0..meta.schema.len()).map(move |f| SampleRef { meta, i }.rows(f))
    }

    /// Free-form tags (e.g. `uid`, `reward_model`).
    pub fn tags(&self) -> &'a [(String, String)] {
        self.shared_tags()
    }

    /// The tags as the shared set (clone it to keep it without copying the strings).
    pub fn shared_tags(&self) -> &'a SampleTags {
        &self.meta.tag_sets[self.meta.tag_index[self.i] as usize]
    }
}

impl std::fmt::Debug for SampleRef<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sample")
            .field("key", &self.key())
            .field("unit", &self.unit())
            .field("tokens", &self.tokens())
            .field("rows", &self.all_rows().collect::<Vec<_>>())
            .field("tags", &self.tags())
            .finish()
    }
}

/// Writes `len` little-endian u32s (a copy; on little-endian targets it compiles to one).
pub(crate) fn extend_le32(out: &mut Vec<u8>, v: &[u32]) {
    let at = out.len();
    out.resize(at + 4 * v.len(), 0);
    for (dst, x) in out[at..].chunks_exact_mut(4).zip(v) {
        dst.copy_from_slice(&x.to_le_bytes());
    }
}

/// Reads little-endian u32s (the caller sized `b` to a multiple of 4).
pub(crate) fn read_le32(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

impl BatchMeta {
    /// An empty batch of `partition` with `schema`.
    pub fn new(partition: impl Into<String>, schema: Vec<FieldSpec>) -> BatchMeta {
        BatchMeta { partition: partition.into(), rows: vec![Vec::new(); schema.len()], schema, ..Default::default() }
    }

    /// A builder for a batch of `partition` with `schema` (producers of metadata: puts,
    /// write-backs, tests).
    pub fn builder(partition: impl Into<String>, schema: Vec<FieldSpec>) -> BatchMetaBuilder {
        BatchMetaBuilder::new(partition, schema)
    }

    /// A batch from its columns, checked: `key_offsets` has `n + 1` entries starting at 0, never
    /// decreasing, ending at `keys.len()` and on character boundaries; `units`, `tokens`,
    /// `tag_index` and every `rows` entry have `n`; `rows` has one entry per schema field; every
    /// tag index names a set of `tag_sets`.
    #[allow(clippy::too_many_arguments)]
    pub fn from_columns(
        partition: String,
        schema: Vec<FieldSpec>,
        keys: Arc<str>,
        key_offsets: Vec<u32>,
        units: Vec<u32>,
        tokens: Vec<u32>,
        rows: Vec<Vec<u32>>,
        tag_sets: Vec<SampleTags>,
        tag_index: Vec<u32>,
    ) -> Result<BatchMeta, MetaError> {
        let n = units.len();
        let err = |problem: String| MetaError { partition: partition.clone(), problem };
        if key_offsets.len() != n + 1 && !(n == 0 && key_offsets.is_empty()) {
            return Err(err(format!("{} key offsets for {n} samples; give samples + 1", key_offsets.len())));
        }
        if let Some(&first) = key_offsets.first()
            && first != 0
        {
            return Err(err(format!("key offsets start at {first}, not 0")));
        }
        if let Some(i) = key_offsets
            .windows(2)
            .position(|w| w[1] < w[0] || !keys.is_char_boundary(w[1] as usize) || w[1] as usize > keys.len())
        {
            return Err(err(format!(
                "sample {i}'s key spans bytes {}..{} of {} key bytes: offsets must start at 0, never decrease and \
                 fall on character boundaries",
                key_offsets[i],
                key_offsets[i + 1],
                keys.len()
            )));
        }
        if key_offsets.last().map_or(0, |&l| l as usize) != keys.len() {
            return Err(err(format!("the key offsets end before the {} key bytes do", keys.len())));
        }
        for (what, len) in [("tokens", tokens.len()), ("tag indices", tag_index.len())] {
            if len != n {
                return Err(err(format!("{len} {what} for {n} samples; give one per sample")));
            }
        }
        if rows.len() != schema.len() {
            return Err(err(format!("rows for {} fields but the schema has {}", rows.len(), schema.len())));
        }
        if let Some((f, r)) = rows.iter().enumerate().find(|(_, r)| r.len() != n) {
            return Err(err(format!("field `{}` has {} row counts for {n} samples", schema[f].name, r.len())));
        }
        if let Some((i, t)) = tag_index.iter().enumerate().find(|(_, t)| **t as usize >= tag_sets.len()) {
            return Err(err(format!("sample {i} names tag set {t} of {}", tag_sets.len())));
        }
        Ok(BatchMeta { partition, schema, keys, key_offsets, units, tokens, rows, tag_sets, tag_index })
    }

    /// [`BatchMeta::from_columns`] for columns the caller has checked (the wire decoder, the
    /// controller).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn from_checked_columns(
        partition: String,
        schema: Vec<FieldSpec>,
        keys: Arc<str>,
        key_offsets: Vec<u32>,
        units: Vec<u32>,
        tokens: Vec<u32>,
        rows: Vec<Vec<u32>>,
        tag_sets: Vec<SampleTags>,
        tag_index: Vec<u32>,
    ) -> BatchMeta {
        debug_assert!(key_offsets.len() == units.len() + 1 || (units.is_empty() && key_offsets.is_empty()));
        debug_assert!(rows.iter().all(|r| r.len() == units.len()) && tag_index.len() == units.len());
        BatchMeta { partition, schema, keys, key_offsets, units, tokens, rows, tag_sets, tag_index }
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.units.len()
    }

    /// No samples.
    pub fn is_empty(&self) -> bool {
        self.units.is_empty()
    }

    /// Sample `i`. Panics if `i >= len()`, like indexing a slice.
    pub fn sample(&self, i: usize) -> SampleRef<'_> {
        assert!(i < self.len(), "sample {i} of a batch of {}", self.len());
        SampleRef { meta: self, i }
    }

    /// Sample `i`, or `None` past the end.
    pub fn get(&self, i: usize) -> Option<SampleRef<'_>> {
        (i < self.len()).then_some(SampleRef { meta: self, i })
    }

    /// Every sample, in order.
    pub fn iter(&self) -> Iter<'_> {
        Iter { meta: self, range: 0..self.len() }
    }

    /// Key of sample `i` (empty past the end).
    pub fn key(&self, i: usize) -> &str {
        match (self.key_offsets.get(i), self.key_offsets.get(i + 1)) {
            (Some(&a), Some(&b)) => self.keys.get(a as usize..b as usize).unwrap_or_default(),
            _ => "",
        }
    }

    /// The keys, in order.
    pub fn keys(&self) -> impl ExactSizeIterator<Item = &str> + '_ {
        (0..self.len()).map(move |i| self.key(i))
    }

    /// Every key's bytes back to back, and their `len + 1` offsets (empty with no samples): the
    /// wire layout.
    pub fn key_columns(&self) -> (&str, &[u32]) {
        (&self.keys, &self.key_offsets)
    }

    /// Storage unit per sample.
    pub fn units(&self) -> &[u32] {
        &self.units
    }

    /// Token count per sample.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Total tokens of the samples.
    pub fn total_tokens(&self) -> u64 {
        self.tokens.iter().map(|&t| t as u64).sum()
    }

    /// Rows of field `field` (schema index) per sample; `None` if the batch holds no rows for it
    /// (every sample lacks it).
    pub fn field_rows(&self, field: usize) -> Option<&[u32]> {
        self.rows.get(field).map(Vec::as_slice)
    }

    /// The distinct tag sets and each sample's index into them (the wire layout).
    pub fn tag_columns(&self) -> (&[SampleTags], &[u32]) {
        (&self.tag_sets, &self.tag_index)
    }

    /// Index of a field in the schema.
    pub fn field_index(&self, name: &str) -> Option<usize> {
        self.schema.iter().position(|f| f.name == name)
    }

    /// The samples at `indices`, in that order (e.g. one data-parallel shard of an assignment),
    /// same schema; only the tag sets they use are kept. Panics if an index is out of range,
    /// like indexing a slice.
    pub fn subset(&self, indices: &[usize]) -> BatchMeta {
        let n = self.len();
        if let Some(&i) = indices.iter().find(|&&i| i >= n) {
            panic!("subset names sample {i} of a batch of {n}");
        }
        if indices.len() == n && indices.iter().enumerate().all(|(j, &i)| i == j) {
            return self.clone();
        }
        let key_bytes: usize = indices.iter().map(|&i| (self.key_offsets[i + 1] - self.key_offsets[i]) as usize).sum();
        let mut keys = String::with_capacity(key_bytes);
        let mut key_offsets = Vec::with_capacity(indices.len() + 1);
        key_offsets.push(0u32);
        for &i in indices {
            keys.push_str(self.key(i));
            // At most this batch's own key bytes, which fit in u32.
            key_offsets.push(keys.len() as u32);
        }
        let pick = |col: &[u32]| indices.iter().map(|&i| col[i]).collect::<Vec<u32>>();
        let mut set_map = vec![u32::MAX; self.tag_sets.len()];
        let mut tag_sets = Vec::new();
        let tag_index = indices
            .iter()
            .map(|&i| {
                let t = self.tag_index[i] as usize;
                if set_map[t] == u32::MAX {
                    set_map[t] = tag_sets.len() as u32;
                    tag_sets.push(self.tag_sets[t].clone());
                }
                set_map[t]
            })
            .collect();
        BatchMeta {
            partition: self.partition.clone(),
            schema: self.schema.clone(),
            keys: Arc::from(keys),
            key_offsets,
            units: pick(&self.units),
            tokens: pick(&self.tokens),
            rows: self.rows.iter().map(|r| pick(r)).collect(),
            tag_sets,
            tag_index,
        }
    }

    /// The same samples (keys, units, tokens) with another schema, their rows given per field,
    /// and no tags: what a write-back registers.
    pub fn with_fields(&self, schema: Vec<FieldSpec>, rows: Vec<Vec<u32>>) -> Result<BatchMeta, MetaError> {
        let n = self.len();
        let err = |problem: String| MetaError { partition: self.partition.clone(), problem };
        if rows.len() != schema.len() {
            return Err(err(format!("rows for {} fields but the schema has {}", rows.len(), schema.len())));
        }
        if let Some((f, r)) = rows.iter().enumerate().find(|(_, r)| r.len() != n) {
            return Err(err(format!(
                "field `{}` has {} row counts for {n} samples; give one per sample",
                schema[f].name,
                r.len()
            )));
        }
        Ok(BatchMeta {
            partition: self.partition.clone(),
            schema,
            keys: self.keys.clone(),
            key_offsets: self.key_offsets.clone(),
            units: self.units.clone(),
            tokens: self.tokens.clone(),
            rows,
            tag_sets: if n == 0 { Vec::new() } else { vec![SampleTags::default()] },
            tag_index: vec![0; n],
        })
    }
}

impl PartialEq for BatchMeta {
    fn eq(&self, other: &BatchMeta) -> bool {
        let n = self.len();
        self.partition == other.partition
            && self.schema == other.schema
            && n == other.len()
            && self.keys().eq(other.keys())
            && self.units == other.units
            && self.tokens == other.tokens
            && (0..self.schema.len()).all(|f| match (self.field_rows(f), other.field_rows(f)) {
                (Some(a), Some(b)) => a == b,
                (Some(r), None) | (None, Some(r)) => r.iter().all(|&x| x == ABSENT),
                (None, None) => true,
            })
            && self.iter().zip(other.iter()).all(|(a, b)| a.tags() == b.tags())
    }
}

impl Eq for BatchMeta {}

impl std::fmt::Debug for BatchMeta {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchMeta")
            .field("partition", &self.partition)
            .field("schema", &self.schema)
            .field("samples", &DebugSamples(self))
            .finish()
    }
}

struct DebugSamples<'a>(&'a BatchMeta);

impl std::fmt::Debug for DebugSamples<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.0.iter()).finish()
    }
}

impl<'a> IntoIterator for &'a BatchMeta {
    type Item = SampleRef<'a>;
    type IntoIter = Iter<'a>;
    fn into_iter(self) -> Iter<'a> {
        self.iter()
    }
}

/// The samples of a [`BatchMeta`], in order ([`BatchMeta::iter`]).
#[derive(Clone, Debug)]
pub struct Iter<'a> {
    meta: &'a BatchMeta,
    range: std::ops::Range<usize>,
}

impl<'a> Iterator for Iter<'a> {
    type Item = SampleRef<'a>;
    fn next(&mut self) -> Option<SampleRef<'a>> {
        self.range.next().map(|i| SampleRef { meta: self.meta, i })
    }
    fn size_hint(&self) -> (usize, Option<usize>) {
        self.range.size_hint()
    }
}

impl DoubleEndedIterator for Iter<'_> {
    fn next_back(&mut self) -> Option<Self::Item> {
        self.range.next_back().map(|i| SampleRef { meta: self.meta, i })
    }
}

impl ExactSizeIterator for Iter<'_> {}

/// Builds a [`BatchMeta`] sample by sample (puts, write-backs, tests). Samples pushed with the
/// same [`SampleTags`] (the same `Arc`) share one tag set; samples without tags share one empty
/// set.
#[derive(Debug)]
pub struct BatchMetaBuilder {
    partition: String,
    schema: Vec<FieldSpec>,
    keys: String,
    key_offsets: Vec<u32>,
    units: Vec<u32>,
    tokens: Vec<u32>,
    rows: Vec<Vec<u32>>,
    tag_sets: Vec<SampleTags>,
    tag_index: Vec<u32>,
    /// Set index by the address of a set's data (the builder keeps every set alive, so an
    /// address is never reused for another set while it builds).
    set_by_addr: std::collections::HashMap<usize, u32>,
    empty_set: Option<u32>,
}

impl BatchMetaBuilder {
    /// A builder for a batch of `partition` with `schema`.
    pub fn new(partition: impl Into<String>, schema: Vec<FieldSpec>) -> BatchMetaBuilder {
        BatchMetaBuilder {
            partition: partition.into(),
            rows: vec![Vec::new(); schema.len()],
            schema,
            keys: String::new(),
            key_offsets: vec![0],
            units: Vec::new(),
            tokens: Vec::new(),
            tag_sets: Vec::new(),
            tag_index: Vec::new(),
            set_by_addr: Default::default(),
            empty_set: None,
        }
    }

    /// Reserves room for `samples` more samples.
    pub fn reserve(&mut self, samples: usize) {
        self.key_offsets.reserve(samples);
        self.units.reserve(samples);
        self.tokens.reserve(samples);
        self.tag_index.reserve(samples);
        for r in &mut self.rows {
            r.reserve(samples);
        }
    }

    /// Samples pushed so far.
    pub fn len(&self) -> usize {
        self.units.len()
    }

    /// Nothing pushed yet.
    pub fn is_empty(&self) -> bool {
        self.units.is_empty()
    }

    /// Appends a sample: its key, storage unit, token count, rows per schema field ([`ABSENT`]
    /// where it lacks the field) and tags. Refused (nothing appended) if `rows` does not have one
    /// entry per schema field or the batch's keys would pass 4 GiB.
    pub fn push(
        &mut self,
        key: &str,
        unit: u32,
        tokens: u32,
        rows: &[u32],
        tags: &SampleTags,
    ) -> Result<&mut BatchMetaBuilder, MetaError> {
        let err = |problem: String| MetaError { partition: self.partition.clone(), problem };
        if rows.len() != self.schema.len() {
            return Err(err(format!(
                "sample `{key}` has {} row counts for {} fields; give one per schema field ({} where it lacks one)",
                rows.len(),
                self.schema.len(),
                ABSENT
            )));
        }
        let end = u32::try_from(self.keys.len() + key.len())
            .ok()
            .filter(|_| self.units.len() < u32::MAX as usize)
            .ok_or_else(|| err("more than 4 GiB of keys or 2^32 samples in one batch; split it".into()))?;
        self.keys.push_str(key);
        self.key_offsets.push(end);
        self.units.push(unit);
        self.tokens.push(tokens);
        for (col, &r) in self.rows.iter_mut().zip(rows) {
            col.push(r);
        }
        let sets = &mut self.tag_sets;
        let add = || {
            sets.push(tags.clone());
            sets.len() as u32 - 1
        };
        let set = if tags.is_empty() {
            *self.empty_set.get_or_insert_with(add)
        } else {
            *self.set_by_addr.entry(tags.as_ptr() as usize).or_insert_with(add)
        };
        self.tag_index.push(set);
        Ok(self)
    }

    /// The batch.
    pub fn finish(self) -> BatchMeta {
        let key_offsets = if self.units.is_empty() { Vec::new() } else { self.key_offsets };
        BatchMeta {
            partition: self.partition,
            schema: self.schema,
            keys: Arc::from(self.keys),
            key_offsets,
            units: self.units,
            tokens: self.tokens,
            rows: self.rows,
            tag_sets: self.tag_sets,
            tag_index: self.tag_index,
        }
    }
}

/// The JSON form: columnar like the wire (`keys` a list of strings, `rows` one list per field).
impl Serialize for BatchMeta {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        struct Keys<'a>(&'a BatchMeta);
        impl Serialize for Keys<'_> {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_seq(self.0.keys())
            }
        }
        struct Rows<'a>(&'a BatchMeta);
        impl Serialize for Rows<'_> {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                let m = self.0;
                let absent = vec![ABSENT; m.len()];
                s.collect_seq((0..m.schema.len()).map(|f| m.field_rows(f).unwrap_or(&absent)))
            }
        }
        let mut st = s.serialize_struct("BatchMeta", 8)?;
        st.serialize_field("partition", &self.partition)?;
        st.serialize_field("schema", &self.schema)?;
        st.serialize_field("keys", &Keys(self))?;
        st.serialize_field("units", &self.units)?;
        st.serialize_field("tokens", &self.tokens)?;
        st.serialize_field("rows", &Rows(self))?;
        st.serialize_field("tag_sets", &self.tag_sets)?;
        st.serialize_field("tags", &self.tag_index)?;
        st.end()
    }
}

impl<'de> Deserialize<'de> for BatchMeta {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<BatchMeta, D::Error> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Json {
            partition: String,
            #[serde(default)]
            schema: Vec<FieldSpec>,
            #[serde(default)]
            keys: Vec<String>,
            #[serde(default)]
            units: Vec<u32>,
            #[serde(default)]
            tokens: Vec<u32>,
            #[serde(default)]
            rows: Vec<Vec<u32>>,
            #[serde(default)]
            tag_sets: Vec<SampleTags>,
            /// Absent: no sample has tags.
            #[serde(default)]
            tags: Option<Vec<u32>>,
        }
        let j = Json::deserialize(d)?;
        let n = j.keys.len();
        let mut keys = String::with_capacity(j.keys.iter().map(String::len).sum());
        let mut key_offsets = Vec::with_capacity(n + 1);
        key_offsets.push(0u32);
        for k in &j.keys {
            keys.push_str(k);
            key_offsets.push(u32::try_from(keys.len()).map_err(|_| {
                serde::de::Error::custom(format!("batch metadata of partition `{}`: over 4 GiB of keys", j.partition))
            })?);
        }
        if n == 0 {
            key_offsets.clear();
        }
        if j.units.len() != n {
            return Err(serde::de::Error::custom(format!(
                "batch metadata of partition `{}`: {} units for {n} keys; give one unit per key",
                j.partition,
                j.units.len()
            )));
        }
        let (tag_sets, tag_index) = match j.tags {
            Some(t) => (j.tag_sets, t),
            None if n == 0 => (j.tag_sets, Vec::new()),
            None => (vec![SampleTags::default()], vec![0; n]),
        };
        BatchMeta::from_columns(
            j.partition,
            j.schema,
            Arc::from(keys),
            key_offsets,
            j.units,
            j.tokens,
            j.rows,
            tag_sets,
            tag_index,
        )
        .map_err(serde::de::Error::custom)
    }
}

/// Fetched samples: their metadata and the requested columns, sample `i` of every column being
/// `meta.sample(i)`.
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    /// Metadata, in the batch's sample order.
    pub meta: BatchMeta,
    /// Columns, in the requested field order.
    pub columns: Vec<Column>,
}

impl Batch {
    /// A column by field name.
    pub fn column(&self, name: &str) -> Option<&Column> {
        self.columns.iter().find(|c| c.name() == name)
    }

    /// Total value bytes of every column.
    pub fn nbytes(&self) -> usize {
        self.columns.iter().map(|c| c.nbytes()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ragged_column_round_trips_and_slices_without_padding() {
        let a: &[i64] = &[1, 2, 3];
        let b: &[i64] = &[];
        let c: &[i64] = &[7];
        let col = Column::ragged("ids", &[a, b, c]);
        assert_eq!(col.offsets(), &[0, 3, 3, 4]);
        assert_eq!(col.nbytes(), 4 * 8);
        assert_eq!(col.sample_as::<i64>(0).unwrap(), vec![1, 2, 3]);
        assert_eq!(col.sample_as::<i64>(1).unwrap(), Vec::<i64>::new());
        assert_eq!(col.rows(2), 1);
        assert!(col.sample_as::<f32>(0).is_err());
        let again = Column::from_parts(col.spec().clone(), 3, col.values().clone(), col.offsets().to_vec()).unwrap();
        assert_eq!(again, col);
    }

    #[test]
    fn shared_keys_behave_as_their_strings() {
        let buf: Arc<str> = Arc::from("a_g0é_g1");
        let a = SampleKey::shared(&buf, 0..4).unwrap();
        let b = SampleKey::shared(&buf, 4..9).unwrap();
        assert_eq!((a.as_str(), &*b), ("a_g0", "é_g1"));
        assert!(SampleKey::shared(&buf, 4..5).is_none(), "splits the é");
        assert!(SampleKey::shared(&buf, std::ops::Range { start: 6, end: 4 }).is_none(), "reversed");
        assert!(SampleKey::shared(&buf, 0..10).is_none());
        assert_eq!(a, SampleKey::from("a_g0"));
        assert!(a < b && a == "a_g0");
        let map: std::collections::HashMap<SampleKey, u32> = [(a.clone(), 0), (b, 1)].into_iter().collect();
        assert_eq!(map.get("é_g1"), Some(&1));
        assert_eq!(serde_json::to_string(&a).unwrap(), "\"a_g0\"");
        assert_eq!(serde_json::from_str::<SampleKey>("\"a_g0\"").unwrap(), a);
        assert_eq!(format!("{a} {a:?}"), "a_g0 \"a_g0\"");
    }

    fn tags(pairs: &[(&str, &str)]) -> SampleTags {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    /// Four samples, two fields (the second absent for one sample); tags: one set shared by two
    /// samples, none, and a separate set with the shared one's content.
    fn sample_meta() -> BatchMeta {
        let shared = tags(&[("uid", "u0")]);
        let mut b = BatchMeta::builder(
            "step-3",
            vec![FieldSpec::ragged("ids", DType::I64), FieldSpec::fixed("reward", DType::F32, vec![])],
        );
        b.push("u0_g0", 0, 7, &[7, 1], &shared).unwrap();
        b.push("é_g1", 1, 3, &[3, ABSENT], &SampleTags::default()).unwrap();
        b.push("u0_g1", 0, 5, &[5, 1], &shared).unwrap();
        b.push("", 1, 0, &[0, 1], &tags(&[("uid", "u0")])).unwrap();
        b.finish()
    }

    #[test]
    fn columnar_meta_reads_back_what_was_pushed_and_shares_tag_sets() {
        let m = sample_meta();
        assert_eq!((m.len(), m.is_empty()), (4, false));
        assert_eq!(m.keys().collect::<Vec<_>>(), ["u0_g0", "é_g1", "u0_g1", ""]);
        assert_eq!((m.units(), m.tokens(), m.total_tokens()), (&[0, 1, 0, 1][..], &[7, 3, 5, 0][..], 15));
        assert_eq!(m.field_rows(0), Some(&[7, 3, 5, 0][..]));
        assert_eq!(m.field_rows(1), Some(&[1, ABSENT, 1, 1][..]));
        assert_eq!(m.field_rows(2), None);
        let s = m.sample(1);
        assert_eq!((s.index(), s.key(), s.unit(), s.tokens(), s.rows(0), s.rows(1)), (1, "é_g1", 1, 3, 3, ABSENT));
        assert_eq!(s.rows(9), ABSENT, "a field past the schema is absent");
        assert_eq!(s.shared_key(), SampleKey::from("é_g1"));
        assert!(s.tags().is_empty());
        assert_eq!(m.sample(0).all_rows().collect::<Vec<_>>(), [7, 1]);
        assert!(m.get(4).is_none());
        // Shared sets once (the same Arc), the empty set once, equal content from another Arc apart.
        let (sets, index) = m.tag_columns();
        assert_eq!(index, [0, 1, 0, 2]);
        assert_eq!(sets.len(), 3);
        assert!(Arc::ptr_eq(m.sample(0).shared_tags(), m.sample(2).shared_tags()));
        assert_eq!(m.sample(3).tags(), m.sample(0).tags());
        let (keys, offsets) = m.key_columns();
        assert_eq!((keys, offsets), ("u0_g0é_g1u0_g1", &[0, 5, 10, 15, 15][..]));
        assert_eq!(m.iter().rev().map(|s| s.tokens()).collect::<Vec<_>>(), [0, 5, 3, 7]);
        assert_eq!((&m).into_iter().len(), 4);
    }

    #[test]
    fn subset_picks_samples_in_order_and_keeps_only_their_tag_sets() {
        let m = sample_meta();
        let sub = m.subset(&[2, 1]);
        assert_eq!(sub.keys().collect::<Vec<_>>(), ["u0_g1", "é_g1"]);
        assert_eq!((sub.units(), sub.tokens()), (&[0, 1][..], &[5, 3][..]));
        assert_eq!(sub.field_rows(1), Some(&[1, ABSENT][..]));
        assert_eq!(sub.sample(0).tags(), [("uid".to_string(), "u0".to_string())]);
        assert_eq!(sub.tag_columns().0.len(), 2, "the shared set and the empty one");
        assert_eq!((sub.partition.as_str(), &sub.schema), ("step-3", &m.schema));
        assert_eq!(m.subset(&[0, 1, 2, 3]), m);
        assert!(m.subset(&[]).is_empty());
        let twice = m.subset(&[0, 0]);
        assert_eq!(twice.keys().collect::<Vec<_>>(), ["u0_g0", "u0_g0"]);
    }

    #[test]
    fn equality_compares_samples_not_how_tag_sets_are_shared() {
        let m = sample_meta();
        let mut b = BatchMeta::builder("step-3", m.schema.clone());
        for s in &m {
            // A fresh set per sample: same contents, no sharing.
            b.push(s.key(), s.unit(), s.tokens(), &s.all_rows().collect::<Vec<_>>(), &s.tags().into()).unwrap();
        }
        let fresh = b.finish();
        assert_eq!(fresh.tag_columns().0.len(), 4, "three tagged sets and one empty");
        assert_eq!(fresh, m);
        let mut other = m.clone();
        other.partition = "step-4".into();
        assert_ne!(other, m);
        assert_ne!(m.subset(&[1, 0]), m.subset(&[0, 1]));
        // A field appended to the schema reads as absent everywhere.
        let mut wider = m.clone();
        wider.schema.push(FieldSpec::ragged("extra", DType::U8));
        assert_eq!(wider.sample(0).rows(2), ABSENT);
        assert!(format!("{m:?}").contains("é_g1"));
    }

    #[test]
    fn builder_refuses_a_sample_with_the_wrong_number_of_rows() {
        let mut b = BatchMeta::builder("step-3", vec![FieldSpec::ragged("ids", DType::I64)]);
        let e = b.push("k", 0, 1, &[1, 2], &SampleTags::default()).unwrap_err();
        assert!(e.to_string().contains("step-3") && e.to_string().contains("2 row counts for 1 fields"), "{e}");
        assert!(b.is_empty(), "nothing appended");
        let m = b.finish();
        assert!(m.is_empty() && m.key_columns().1.is_empty());
    }

    #[test]
    fn json_is_columnar_round_trips_and_refuses_inconsistent_columns() {
        let m = sample_meta();
        let v = serde_json::to_value(&m).unwrap();
        assert_eq!(v["keys"], serde_json::json!(["u0_g0", "é_g1", "u0_g1", ""]));
        assert_eq!(v["rows"], serde_json::json!([[7, 3, 5, 0], [1, ABSENT, 1, 1]]));
        assert_eq!(v["tags"], serde_json::json!([0, 1, 0, 2]));
        assert_eq!(serde_json::from_value::<BatchMeta>(v.clone()).unwrap(), m);
        let empty = BatchMeta::new("p", vec![FieldSpec::ragged("ids", DType::I64)]);
        assert_eq!(serde_json::from_str::<BatchMeta>(&serde_json::to_string(&empty).unwrap()).unwrap(), empty);
        // Without tags: every sample untagged.
        let mut untagged = v.clone();
        untagged.as_object_mut().unwrap().remove("tags");
        untagged.as_object_mut().unwrap().remove("tag_sets");
        let u = serde_json::from_value::<BatchMeta>(untagged).unwrap();
        assert!(u.iter().all(|s| s.tags().is_empty()) && u.len() == 4);
        let broken = |key: &str, value: serde_json::Value| {
            let mut b = v.clone();
            b[key] = value;
            serde_json::from_value::<BatchMeta>(b).unwrap_err().to_string()
        };
        assert!(broken("units", serde_json::json!([0])).contains("1 units for 4 keys"));
        assert!(broken("tokens", serde_json::json!([0])).contains("1 tokens for 4 samples"));
        assert!(broken("rows", serde_json::json!([[1, 2, 3, 4]])).contains("rows for 1 fields but the schema has 2"));
        assert!(broken("rows", serde_json::json!([[1, 2, 3, 4], [1]])).contains("field `reward` has 1 row counts"));
        assert!(broken("tags", serde_json::json!([0, 1, 0, 3])).contains("sample 3 names tag set 3 of 3"));
    }

    #[test]
    fn from_columns_checks_every_column() {
        let cols = |offsets: Vec<u32>, units: Vec<u32>, index: Vec<u32>| {
            BatchMeta::from_columns(
                "p".into(),
                vec![],
                Arc::from("abé"),
                offsets,
                units,
                vec![1, 1],
                vec![],
                vec![SampleTags::default()],
                index,
            )
        };
        assert_eq!(cols(vec![0, 2, 4], vec![0, 0], vec![0, 0]).unwrap().keys().collect::<Vec<_>>(), ["ab", "é"]);
        let e = |r: Result<BatchMeta, MetaError>| r.unwrap_err().to_string();
        assert!(e(cols(vec![1, 2, 4], vec![0, 0], vec![0, 0])).contains("start at 1"));
        assert!(e(cols(vec![0, 3, 4], vec![0, 0], vec![0, 0])).contains("character boundaries"));
        assert!(e(cols(vec![0, 2, 5], vec![0, 0], vec![0, 0])).contains("spans bytes 2..5"));
        assert!(e(cols(vec![0, 2, 3], vec![0, 0], vec![0, 0])).contains("character boundaries"));
        assert!(e(cols(vec![0, 1, 2], vec![0, 0], vec![0, 0])).contains("end before"));
        assert!(e(cols(vec![0, 4], vec![0, 0], vec![0, 0])).contains("2 key offsets for 2 samples"));
        assert!(e(cols(vec![0, 2, 4], vec![0, 0], vec![0, 1])).contains("sample 1 names tag set 1 of 1"));
    }

    #[test]
    fn with_fields_keeps_the_samples_and_drops_the_tags() {
        let m = sample_meta();
        let wb = m.with_fields(vec![FieldSpec::ragged("old_logprobs", DType::F32)], vec![vec![6, 2, 4, 0]]).unwrap();
        assert!(wb.keys().eq(m.keys()) && wb.units() == m.units() && wb.tokens() == m.tokens());
        assert_eq!(wb.field_rows(0), Some(&[6, 2, 4, 0][..]));
        assert!(wb.iter().all(|s| s.tags().is_empty()));
        let e = m.with_fields(vec![FieldSpec::ragged("x", DType::F32)], vec![vec![1]]).unwrap_err();
        assert!(e.to_string().contains("field `x` has 1 row counts for 4 samples"), "{e}");
    }

    #[test]
    fn from_parts_names_the_field_on_bad_offsets() {
        let spec = FieldSpec::ragged("logprobs", DType::F32);
        let e = Column::from_parts(spec.clone(), 2, Bytes::from(vec![0u8; 8]), vec![0, 2, 1]).unwrap_err();
        assert!(e.to_string().contains("logprobs") && e.to_string().contains("decrease"), "{e}");
        let e = Column::from_parts(spec.clone(), 2, Bytes::from(vec![0u8; 8]), vec![0, 1, 3]).unwrap_err();
        assert!(e.to_string().contains("do not match"), "{e}");
        let e = Column::from_parts(spec, 2, Bytes::from(vec![0u8; 8]), vec![0, 2]).unwrap_err();
        assert!(e.to_string().contains("samples + 1"), "{e}");
    }
}
