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
use smallvec::SmallVec;

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

/// A sample's rows per field, inline for up to 8 fields: metadata of a 4096-sample step costs
/// no allocation per sample.
pub type FieldRows = SmallVec<[u32; 8]>;

/// A sample's free-form tags. Shared, like [`SampleKey`].
pub type SampleTags = Arc<[(String, String)]>;

/// Metadata of one sample, as the controller hands it out: where it lives and how long it is.
/// Cloning it allocates nothing (for up to 8 fields): claims clone one per sample.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SampleMeta {
    /// Sample key within its partition.
    pub key: SampleKey,
    /// Storage unit holding its fields.
    pub unit: u32,
    /// Token count used for balancing (prompt + response).
    pub tokens: u32,
    /// Rows per field, indexed like [`BatchMeta::schema`]; [`ABSENT`] where the field is missing.
    pub rows: FieldRows,
    /// Free-form tags (e.g. `uid`, `reward_model`).
    pub tags: SampleTags,
}

/// Metadata of a batch of samples of one partition: the schema and each sample's location and
/// lengths. Everything [`crate::tq::client::TqClient::get`] needs to fetch the bytes.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchMeta {
    /// Partition (RL step), e.g. `step-12`.
    pub partition: String,
    /// Fields known for the partition.
    pub schema: Vec<FieldSpec>,
    /// The samples.
    pub samples: Vec<SampleMeta>,
}

impl BatchMeta {
    /// Index of a field in the schema.
    pub fn field_index(&self, name: &str) -> Option<usize> {
        self.schema.iter().position(|f| f.name == name)
    }

    /// The samples at `indices` (e.g. one data-parallel shard of an assignment), same schema.
    pub fn subset(&self, indices: &[usize]) -> BatchMeta {
        BatchMeta {
            partition: self.partition.clone(),
            schema: self.schema.clone(),
            samples: indices.iter().map(|&i| self.samples[i].clone()).collect(),
        }
    }

    /// Total tokens of the samples.
    pub fn tokens(&self) -> u64 {
        self.samples.iter().map(|s| s.tokens as u64).sum()
    }

    /// The keys, in order.
    pub fn keys(&self) -> Vec<&str> {
        self.samples.iter().map(|s| &*s.key).collect()
    }
}

/// Fetched samples: their metadata and the requested columns, sample `i` of every column being
/// `meta.samples[i]`.
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
