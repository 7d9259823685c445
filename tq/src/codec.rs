//! The transfer queue's wire format: one header frame, then raw little-endian buffer frames.
//!
//! ```text
//! header frame : u32 len | version u16 | kind u8 | flags u8 | request_id u32 | token str | body | tag
//! buffer frame : u64 len | records                  (as many as the body's column block declares)
//! records      : the len raw bytes in records of at most 256 KiB (net::record_lens), each
//!                followed by its tag
//! str          : u32 len | UTF-8 bytes
//! ```
//! Everything is little-endian. A tag is the frame's (or record's) 16-byte AES-256-GMAC under the
//! direction's key from the connection's handshake, its number on the connection the nonce
//! ([`rlplane_wire::net::mac`]): nothing is acted on before its tag checks out. Bulk values never pass through the header: a column block in the
//! body declares each column's spec and value length, and the buffers follow as their own frames
//! (for a ragged column: its `n + 1` u64 row offsets, then its values), so a Python peer reads them
//! with `np.frombuffer` and a Rust peer writes them with vectored writes straight from the stored
//! buffers. `docs/transfer-queue.md` documents every body.
//!
//! Batch metadata is columnar: every key in one byte run with `n + 1` offsets, then one `u32` array
//! each for units, tokens and (field by field) rows, then the distinct tag sets once and a set
//! index per sample. Decoding it allocates one buffer for all keys (each [`SampleKey`] shares it)
//! and one per distinct tag set, not one per sample.
//!
//! Decoding never panics and never allocates more than the frame it reads: every count is checked
//! against the bytes left, every length against its declaration.

use std::io::IoSlice;
use std::sync::Arc;

use bytes::Bytes;
use rlplane_wire::net::{self, FrameMac, MacPool, Outbound, RecordChecks};
use tokio::io::{AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::column::{ABSENT, BatchMeta, DType, FieldSpec, SampleTags, extend_le32, read_le32};

/// Version of the wire format; carried by every message. A peer of another version is refused.
/// 5: tags are AES-256-GMAC ([`rlplane_wire::net::gmac`]).
pub const WIRE_VERSION: u16 = 5;

/// Handshake magic of the controller service.
pub const CONTROLLER_MAGIC: [u8; 4] = *b"TQCT";
/// Handshake magic of a storage unit.
pub const STORAGE_MAGIC: [u8; 4] = *b"TQSU";
/// Handshake magic of a fan-out group.
pub const FANOUT_MAGIC: [u8; 4] = *b"TQFO";

/// Largest header frame accepted (metadata only; bulk goes in buffer frames).
pub const MAX_HEADER: u32 = rlplane_wire::net::MAX_FRAME;

/// Most dimensions of a row shape.
pub const MAX_NDIM: usize = 8;

/// A malformed frame: what could not be decoded and where.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed transfer-queue frame at byte {offset}: {what}")]
pub struct CodecError {
    /// Byte offset in the frame.
    pub offset: usize,
    /// What was wrong.
    pub what: String,
}

/// Error codes of an [`Body::Error`] reply.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    /// The frame could not be decoded.
    Malformed,
    /// Another wire version.
    Version,
    /// Another job or epoch.
    Token,
    /// A put waited for capacity until its timeout (backpressure).
    CapacityTimeout,
    /// A put larger than the whole storage unit.
    TooLarge,
    /// A key, field or partition is not there.
    NotFound,
    /// A field's dtype or shape disagrees with the partition's schema.
    Schema,
    /// The partition lost a storage unit.
    PartitionLost,
    /// A well-formed request that makes no sense (wrong counts, unknown kind for this service).
    BadRequest,
    /// A storage unit could not be reached by the controller.
    UnitUnreachable,
    /// A code this build does not know.
    Other(u16),
}

impl ErrorCode {
    /// Wire value.
    pub fn code(self) -> u16 {
        match self {
            ErrorCode::Malformed => 1,
            ErrorCode::Version => 2,
            ErrorCode::Token => 3,
            ErrorCode::CapacityTimeout => 4,
            ErrorCode::TooLarge => 5,
            ErrorCode::NotFound => 6,
            ErrorCode::Schema => 7,
            ErrorCode::PartitionLost => 8,
            ErrorCode::BadRequest => 9,
            ErrorCode::UnitUnreachable => 10,
            ErrorCode::Other(c) => c,
        }
    }

    /// From the wire value.
    pub fn from_code(c: u16) -> ErrorCode {
        match c {
            1 => ErrorCode::Malformed,
            2 => ErrorCode::Version,
            3 => ErrorCode::Token,
            4 => ErrorCode::CapacityTimeout,
            5 => ErrorCode::TooLarge,
            6 => ErrorCode::NotFound,
            7 => ErrorCode::Schema,
            8 => ErrorCode::PartitionLost,
            9 => ErrorCode::BadRequest,
            10 => ErrorCode::UnitUnreachable,
            c => ErrorCode::Other(c),
        }
    }
}

/// The fixed part of every message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    /// Wire version ([`WIRE_VERSION`]).
    pub version: u16,
    /// Request id, echoed by the reply.
    pub request_id: u32,
    /// The job token (epoch-stamped).
    pub token: String,
}

/// The column block of a message carrying bulk data: `n` samples and, per column, its spec and
/// the byte length of its values. The buffers follow the header frame, column by column: a ragged
/// column sends `(n + 1) × u64` row offsets, then its values; a fixed column only its values.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Block {
    /// Samples.
    pub n: u32,
    /// Columns: spec and value bytes.
    pub columns: Vec<(FieldSpec, u64)>,
}

impl Block {
    /// Lengths of the buffer frames that follow, in order.
    pub fn buffer_lens(&self) -> Vec<u64> {
        let mut v = Vec::with_capacity(self.columns.len() * 2);
        for (spec, values) in &self.columns {
            if spec.ragged {
                v.push((self.n as u64 + 1) * 8);
            }
            v.push(*values);
        }
        v
    }

    /// Total value bytes.
    pub fn value_bytes(&self) -> u64 {
        self.columns.iter().map(|(_, v)| *v).fold(0u64, u64::saturating_add)
    }
}

/// The body of a message. Requests first (controller, then storage, then fan-out), then replies.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Body {
    /// Controller: record samples (put) or fields (write-back) that a storage unit now holds.
    Register(BatchMeta),
    /// Controller: claim up to `n` ready samples for a consumer group.
    Claim {
        /// Partition.
        partition: String,
        /// Consumer group (each sample is handed out once per group).
        group: String,
        /// Most samples to hand out.
        n: u32,
        /// Fewest: if fewer are ready, hand out none (all-or-nothing claims of a whole step).
        min: u32,
        /// Fields a sample must have to be ready.
        required: Vec<String>,
    },
    /// Controller: acknowledge claimed samples (they are done for the group).
    Ack {
        /// Partition.
        partition: String,
        /// Consumer group.
        group: String,
        /// The claim's id.
        claim_id: u64,
        /// Keys acknowledged.
        keys: Vec<String>,
    },
    /// Controller: drop a partition's metadata and its bytes in every storage unit.
    Clear {
        /// Partition.
        partition: String,
    },
    /// Controller: a client could not reach a storage unit.
    ReportLost {
        /// Unit.
        unit: u32,
        /// What the client saw.
        reason: String,
    },
    /// Storage: store the block's samples (buffers follow).
    Put {
        /// Partition.
        partition: String,
        /// Keys, one per sample of the block.
        keys: Vec<String>,
        /// Columns.
        block: Block,
    },
    /// Storage: send these fields of these samples.
    Get {
        /// Partition.
        partition: String,
        /// Keys.
        keys: Vec<String>,
        /// Fields.
        fields: Vec<String>,
    },
    /// Storage: drop a partition.
    ClearUnit {
        /// Partition.
        partition: String,
    },
    /// Storage: liveness and fill level.
    Ping,
    /// Fan-out: a whole batch, metadata then columns (buffers follow).
    Fanout {
        /// Batch metadata.
        meta: BatchMeta,
        /// Columns.
        block: Block,
    },
    /// Reply: done, nothing to say.
    Done,
    /// Reply to [`Body::Claim`].
    Claimed {
        /// Id to acknowledge with.
        claim_id: u64,
        /// Lease in milliseconds.
        lease_ms: u64,
        /// Claimed samples (possibly none).
        meta: BatchMeta,
    },
    /// Reply to [`Body::Ack`].
    Acked {
        /// Keys acknowledged.
        acked: u32,
        /// Keys whose lease had expired and that another claim now holds.
        stale: Vec<String>,
    },
    /// Reply to [`Body::Clear`] / [`Body::ClearUnit`].
    Cleared {
        /// Bytes freed.
        freed: u64,
        /// Storage units cleared.
        units: u32,
    },
    /// Reply to [`Body::Put`].
    Stored {
        /// Value bytes stored.
        bytes: u64,
    },
    /// Reply to [`Body::Get`] (buffers follow).
    Data {
        /// Columns.
        block: Block,
    },
    /// Reply to [`Body::Ping`].
    Pong {
        /// Unit id.
        unit: u32,
        /// Bytes held.
        used: u64,
        /// Capacity.
        capacity: u64,
    },
    /// Reply: the request failed.
    Error {
        /// What kind of failure.
        code: ErrorCode,
        /// Human-readable reason, naming the field and the fix.
        message: String,
    },
}

impl Body {
    /// Wire kind byte.
    pub fn kind(&self) -> u8 {
        match self {
            Body::Register(_) => 1,
            Body::Claim { .. } => 2,
            Body::Ack { .. } => 3,
            Body::Clear { .. } => 4,
            Body::ReportLost { .. } => 5,
            Body::Put { .. } => 16,
            Body::Get { .. } => 17,
            Body::ClearUnit { .. } => 18,
            Body::Ping => 19,
            Body::Fanout { .. } => 32,
            Body::Done => 64,
            Body::Claimed { .. } => 65,
            Body::Acked { .. } => 66,
            Body::Cleared { .. } => 67,
            Body::Stored { .. } => 68,
            Body::Data { .. } => 69,
            Body::Pong { .. } => 70,
            Body::Error { .. } => 127,
        }
    }

    /// The column block whose buffers follow this message, if any.
    pub fn block(&self) -> Option<&Block> {
        match self {
            Body::Put { block, .. } | Body::Fanout { block, .. } | Body::Data { block } => Some(block),
            _ => None,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Encoding.

struct Writer<'a>(&'a mut Vec<u8>);

impl Writer<'_> {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn str(&mut self, s: &str) {
        self.u32(s.len() as u32);
        self.0.extend_from_slice(s.as_bytes());
    }
    fn strs(&mut self, v: &[String]) {
        self.u32(v.len() as u32);
        for s in v {
            self.str(s);
        }
    }
    fn spec(&mut self, f: &FieldSpec) {
        self.str(&f.name);
        self.u8(f.dtype.code());
        self.u8(f.ragged as u8);
        self.u8(f.inner.len() as u8);
        for &d in &f.inner {
            self.u32(d);
        }
    }
    fn meta(&mut self, m: &BatchMeta) {
        self.str(&m.partition);
        let nf = m.schema.len();
        self.u32(nf as u32);
        for f in &m.schema {
            self.spec(f);
        }
        let n = m.len();
        self.u32(n as u32);
        let (keys, key_offsets) = m.key_columns();
        let (sets, index) = m.tag_columns();
        self.0.reserve(keys.len() + 4 * (n * (4 + nf) + 2));
        // Keys: n + 1 byte offsets, then every key's bytes back to back.
        if key_offsets.is_empty() {
            self.u32(0);
        } else {
            extend_le32(self.0, key_offsets);
        }
        self.0.extend_from_slice(keys.as_bytes());
        extend_le32(self.0, m.units());
        extend_le32(self.0, m.tokens());
        for f in 0..nf {
            match m.field_rows(f) {
                Some(rows) => extend_le32(self.0, rows),
                None => (0..n).for_each(|_| self.u32(ABSENT)),
            }
        }
        // Tags: each distinct set once (samples share their sets), then every sample's set index.
        self.u32(sets.len() as u32);
        for set in sets {
            self.u32(set.len() as u32);
            for (k, v) in set.iter() {
                self.str(k);
                self.str(v);
            }
        }
        extend_le32(self.0, index);
    }
    fn block(&mut self, b: &Block) {
        self.u32(b.n);
        self.u32(b.columns.len() as u32);
        for (spec, len) in &b.columns {
            self.spec(spec);
            self.u64(*len);
        }
    }
}

/// Encodes a header frame's payload (without its u32 length prefix).
pub fn encode(header: &Header, body: &Body) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    encode_into(&mut out, header, body);
    out
}

/// [`encode`] into `out` (cleared first), reusing its allocation: a service replying on one
/// connection keeps one buffer instead of allocating (and faulting in) one per reply.
pub fn encode_into(out: &mut Vec<u8>, header: &Header, body: &Body) {
    out.clear();
    let mut w = Writer(out);
    w.u16(header.version);
    w.u8(body.kind());
    w.u8(0);
    w.u32(header.request_id);
    w.str(&header.token);
    match body {
        Body::Register(m) => w.meta(m),
        Body::Claim { partition, group, n, min, required } => {
            w.str(partition);
            w.str(group);
            w.u32(*n);
            w.u32(*min);
            w.strs(required);
        }
        Body::Ack { partition, group, claim_id, keys } => {
            w.str(partition);
            w.str(group);
            w.u64(*claim_id);
            w.strs(keys);
        }
        Body::Clear { partition } | Body::ClearUnit { partition } => w.str(partition),
        Body::ReportLost { unit, reason } => {
            w.u32(*unit);
            w.str(reason);
        }
        Body::Put { partition, keys, block } => {
            w.str(partition);
            w.strs(keys);
            w.block(block);
        }
        Body::Get { partition, keys, fields } => {
            w.str(partition);
            w.strs(keys);
            w.strs(fields);
        }
        Body::Ping | Body::Done => {}
        Body::Fanout { meta, block } => {
            w.meta(meta);
            w.block(block);
        }
        Body::Claimed { claim_id, lease_ms, meta } => {
            w.u64(*claim_id);
            w.u64(*lease_ms);
            w.meta(meta);
        }
        Body::Acked { acked, stale } => {
            w.u32(*acked);
            w.strs(stale);
        }
        Body::Cleared { freed, units } => {
            w.u64(*freed);
            w.u32(*units);
        }
        Body::Stored { bytes } => w.u64(*bytes),
        Body::Data { block } => w.block(block),
        Body::Pong { unit, used, capacity } => {
            w.u32(*unit);
            w.u64(*used);
            w.u64(*capacity);
        }
        Body::Error { code, message } => {
            w.u16(code.code());
            w.str(message);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Decoding.

struct Reader<'a> {
    b: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn err(&self, what: impl Into<String>) -> CodecError {
        CodecError { offset: self.pos, what: what.into() }
    }
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], CodecError> {
        if self.b.len() - self.pos < n {
            return Err(
                self.err(format!("truncated inside {what} (needs {n} bytes, {} left)", self.b.len() - self.pos))
            );
        }
        let s = &self.b[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn u8(&mut self, what: &str) -> Result<u8, CodecError> {
        Ok(self.take(1, what)?[0])
    }
    fn u16(&mut self, what: &str) -> Result<u16, CodecError> {
        Ok(u16::from_le_bytes(self.take(2, what)?.try_into().expect("2 bytes")))
    }
    fn u32(&mut self, what: &str) -> Result<u32, CodecError> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().expect("4 bytes")))
    }
    fn u64(&mut self, what: &str) -> Result<u64, CodecError> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().expect("8 bytes")))
    }
    fn str(&mut self, what: &str) -> Result<String, CodecError> {
        self.str_ref(what).map(str::to_owned)
    }
    /// A string borrowed from the frame (the caller picks the owned form it keeps).
    fn str_ref(&mut self, what: &str) -> Result<&'a str, CodecError> {
        let n = self.u32(what)? as usize;
        let at = self.pos;
        let b = self.take(n, what)?;
        std::str::from_utf8(b).map_err(|_| CodecError { offset: at, what: format!("{what} is not UTF-8") })
    }
    /// A count of items each at least `min_size` bytes, refused if the frame cannot hold them.
    fn count(&mut self, min_size: usize, what: &str) -> Result<usize, CodecError> {
        let n = self.u32(what)? as usize;
        let left = self.b.len() - self.pos;
        if n.saturating_mul(min_size) > left {
            return Err(self.err(format!("{what}: {n} items cannot fit in the {left} bytes left")));
        }
        Ok(n)
    }
    fn strs(&mut self, what: &str) -> Result<Vec<String>, CodecError> {
        let n = self.count(4, what)?;
        (0..n).map(|_| self.str(what)).collect()
    }
    fn spec(&mut self) -> Result<FieldSpec, CodecError> {
        let name = self.str("field name")?;
        let code = self.u8("dtype")?;
        let dtype =
            DType::from_code(code).ok_or_else(|| self.err(format!("field `{name}`: unknown dtype code {code}")))?;
        let ragged = match self.u8("ragged flag")? {
            0 => false,
            1 => true,
            x => return Err(self.err(format!("field `{name}`: ragged flag {x} is neither 0 nor 1"))),
        };
        let ndim = self.u8("ndim")? as usize;
        if ndim > MAX_NDIM {
            return Err(self.err(format!("field `{name}`: {ndim} row dimensions, at most {MAX_NDIM}")));
        }
        let inner = (0..ndim).map(|_| self.u32("row dimension")).collect::<Result<Vec<_>, _>>()?;
        let spec = FieldSpec { name, dtype, ragged, inner };
        match spec.row_bytes() {
            Some(b) if b > 0 && b <= u32::MAX as u64 => Ok(spec),
            _ => Err(self.err(format!("field `{}`: row shape {:?} is empty or too large", spec.name, spec.inner))),
        }
    }
    fn meta(&mut self) -> Result<BatchMeta, CodecError> {
        let partition = self.str("partition")?;
        let nf = self.count(7, "schema")?;
        let schema = (0..nf).map(|_| self.spec()).collect::<Result<Vec<_>, _>>()?;
        // Per sample at least: a key offset, unit, tokens, a row count per field, a tag set index.
        let ns = self.count(4 * (4 + nf), "samples")?;
        let offsets_at = self.pos;
        let key_offsets = read_le32(self.take(4 * (ns + 1), "key offsets")?);
        if key_offsets[0] != 0 {
            return Err(CodecError {
                offset: offsets_at,
                what: format!("key offsets start at {}, not 0", key_offsets[0]),
            });
        }
        let keys_len = key_offsets[ns] as usize;
        let keys_at = self.pos;
        let keys = self.take(keys_len, "sample keys")?;
        let keys = std::str::from_utf8(keys)
            .map_err(|_| CodecError { offset: keys_at, what: "the sample keys are not UTF-8".into() })?;
        if let Some(i) = key_offsets.windows(2).position(|w| w[1] < w[0] || !keys.is_char_boundary(w[1] as usize)) {
            return Err(CodecError {
                offset: offsets_at + 4 * i,
                what: format!(
                    "sample {i}'s key spans bytes {}..{} of {keys_len} key bytes: offsets must start at 0, never \
                     decrease and fall on character boundaries",
                    key_offsets[i],
                    key_offsets[i + 1]
                ),
            });
        }
        // One buffer for every key, no allocation per sample.
        let keys: Arc<str> = Arc::from(keys);
        let units = read_le32(self.take(4 * ns, "units")?);
        let tokens = read_le32(self.take(4 * ns, "tokens")?);
        let rows = (0..nf).map(|_| Ok(read_le32(self.take(4 * ns, "rows")?))).collect::<Result<Vec<_>, _>>()?;
        let nsets = self.count(4, "tag sets")?;
        let mut sets = Vec::with_capacity(nsets);
        for _ in 0..nsets {
            let nt = self.count(8, "tags")?;
            sets.push(if nt == 0 {
                SampleTags::default()
            } else {
                (0..nt)
                    .map(|_| Ok((self.str("tag name")?, self.str("tag value")?)))
                    .collect::<Result<SampleTags, _>>()?
            });
        }
        let index_at = self.pos;
        let index = read_le32(self.take(4 * ns, "tag set indices")?);
        if let Some((i, t)) = index.iter().enumerate().find(|(_, t)| **t as usize >= nsets) {
            return Err(CodecError {
                offset: index_at + 4 * i,
                what: format!("sample {i} names tag set {t} of {nsets}"),
            });
        }
        let key_offsets = if ns == 0 { Vec::new() } else { key_offsets };
        Ok(BatchMeta::from_checked_columns(partition, schema, keys, key_offsets, units, tokens, rows, sets, index))
    }
    fn block(&mut self) -> Result<Block, CodecError> {
        let n = self.u32("sample count")?;
        let nc = self.count(15, "columns")?;
        let mut columns = Vec::with_capacity(nc);
        for _ in 0..nc {
            let spec = self.spec()?;
            let len = self.u64("value length")?;
            let row = spec.row_bytes().unwrap_or(1);
            if spec.ragged {
                if len % row != 0 {
                    return Err(self.err(format!(
                        "field `{}`: {len} value bytes are not a whole number of {row}-byte rows",
                        spec.name
                    )));
                }
            } else if (n as u64).checked_mul(row) != Some(len) {
                return Err(self.err(format!(
                    "field `{}`: fixed column of {n} samples × {row} bytes declares {len} bytes",
                    spec.name
                )));
            }
            columns.push((spec, len));
        }
        Ok(Block { n, columns })
    }
}

/// A batch's metadata alone, in the same binary layout as inside a claim's reply: for a message
/// of another protocol that carries one (the control plane's `Train`), where JSON would spell out
/// every number (a 512-sample batch: 24 KB of JSON, about 0.1 ms to parse).
pub fn encode_meta(meta: &BatchMeta) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + 48 * meta.len());
    Writer(&mut out).meta(meta);
    out
}

/// Decodes what [`encode_meta`] wrote, checked like any frame; the bytes must hold exactly one
/// batch.
pub fn decode_meta(bytes: &[u8]) -> Result<BatchMeta, CodecError> {
    let mut r = Reader { b: bytes, pos: 0 };
    let meta = r.meta()?;
    if r.pos != bytes.len() {
        return Err(r.err(format!("{} bytes after the batch", bytes.len() - r.pos)));
    }
    Ok(meta)
}

/// Decodes a header frame's payload. Never panics; every error says where and what.
pub fn decode(frame: &[u8]) -> Result<(Header, Body), CodecError> {
    let mut r = Reader { b: frame, pos: 0 };
    let version = r.u16("version")?;
    if version != WIRE_VERSION {
        return Err(CodecError {
            offset: 0,
            what: format!("wire version {version}, this build speaks {WIRE_VERSION}; run matching worker images"),
        });
    }
    let kind = r.u8("kind")?;
    let _flags = r.u8("flags")?;
    let request_id = r.u32("request id")?;
    let token = r.str("token")?;
    let header = Header { version, request_id, token };
    let body = match kind {
        1 => Body::Register(r.meta()?),
        2 => Body::Claim {
            partition: r.str("partition")?,
            group: r.str("group")?,
            n: r.u32("n")?,
            min: r.u32("min")?,
            required: r.strs("required fields")?,
        },
        3 => Body::Ack {
            partition: r.str("partition")?,
            group: r.str("group")?,
            claim_id: r.u64("claim id")?,
            keys: r.strs("keys")?,
        },
        4 => Body::Clear { partition: r.str("partition")? },
        5 => Body::ReportLost { unit: r.u32("unit")?, reason: r.str("reason")? },
        16 => {
            let partition = r.str("partition")?;
            let keys = r.strs("keys")?;
            let block = r.block()?;
            if block.n as usize != keys.len() {
                return Err(r.err(format!("put of {} keys carries a block of {} samples", keys.len(), block.n)));
            }
            Body::Put { partition, keys, block }
        }
        17 => Body::Get { partition: r.str("partition")?, keys: r.strs("keys")?, fields: r.strs("fields")? },
        18 => Body::ClearUnit { partition: r.str("partition")? },
        19 => Body::Ping,
        32 => {
            let meta = r.meta()?;
            let block = r.block()?;
            if block.n as usize != meta.len() {
                return Err(r.err(format!("fan-out of {} samples carries a block of {} samples", meta.len(), block.n)));
            }
            Body::Fanout { meta, block }
        }
        64 => Body::Done,
        65 => Body::Claimed { claim_id: r.u64("claim id")?, lease_ms: r.u64("lease")?, meta: r.meta()? },
        66 => Body::Acked { acked: r.u32("acked")?, stale: r.strs("stale keys")? },
        67 => Body::Cleared { freed: r.u64("freed")?, units: r.u32("units")? },
        68 => Body::Stored { bytes: r.u64("bytes")? },
        69 => Body::Data { block: r.block()? },
        70 => Body::Pong { unit: r.u32("unit")?, used: r.u64("used")?, capacity: r.u64("capacity")? },
        127 => Body::Error { code: ErrorCode::from_code(r.u16("error code")?), message: r.str("message")? },
        k => return Err(CodecError { offset: 2, what: format!("unknown message kind {k}") }),
    };
    if r.pos != frame.len() {
        return Err(r.err(format!("{} trailing bytes after the body", frame.len() - r.pos)));
    }
    Ok((header, body))
}

/// Checks a ragged column's offsets buffer (u64 LE, `n + 1` entries) against its declared value
/// length and returns the offsets. Starts at 0, never decreases, ends at `values / row_bytes`.
pub fn decode_offsets(field: &str, buf: &[u8], n: u32, values: u64, row_bytes: u64) -> Result<Vec<u64>, CodecError> {
    let err = |what: String| CodecError { offset: 0, what: format!("field `{field}` offsets: {what}") };
    if buf.len() as u64 != (n as u64 + 1) * 8 {
        return Err(err(format!("{} bytes where {} samples need {}", buf.len(), n, (n as u64 + 1) * 8)));
    }
    let offsets: Vec<u64> = buf.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect();
    if offsets[0] != 0 {
        return Err(err(format!("start at {} instead of 0", offsets[0])));
    }
    if let Some(i) = offsets.windows(2).position(|w| w[1] < w[0] || w[1] - w[0] > u32::MAX as u64) {
        return Err(err(format!("decrease (or jump past 2^32 rows) between sample {i} and {}", i + 1)));
    }
    let rows = offsets[n as usize];
    if rows.checked_mul(row_bytes) != Some(values) {
        return Err(err(format!("end at {rows} rows of {row_bytes} bytes but {values} value bytes were declared")));
    }
    Ok(offsets)
}

/// Encodes offsets as u64 LE.
pub fn encode_offsets(offsets: &[u64]) -> Vec<u8> {
    let mut v = Vec::with_capacity(offsets.len() * 8);
    for o in offsets {
        v.extend_from_slice(&o.to_le_bytes());
    }
    v
}

/// A whole message decoded from bytes: the header, the body and its buffers (a ragged column's
/// offsets already checked against its values).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecodedMessage {
    /// Header.
    pub header: Header,
    /// Body.
    pub body: Body,
    /// Buffer frames, in order.
    pub buffers: Vec<Vec<u8>>,
}

/// Decodes one complete message — the u32-length-prefixed header frame and every buffer frame its
/// block declares — from `bytes`, checking what the stream decoders check. Returns the message
/// and the bytes it used. For tools, tests and the fuzz target; services decode from streams.
pub fn decode_message_bytes(bytes: &[u8]) -> Result<(DecodedMessage, usize), CodecError> {
    let mut r = Reader { b: bytes, pos: 0 };
    let len = r.u32("header frame length")?;
    if len > MAX_HEADER {
        return Err(r.err(format!("header frame of {len} bytes exceeds the limit of {MAX_HEADER}")));
    }
    let frame = r.take(len as usize, "header frame")?;
    let (header, body) = decode(frame).map_err(|e| CodecError { offset: e.offset + 4, what: e.what })?;
    let mut buffers = Vec::new();
    if let Some(block) = body.block() {
        for (spec, values) in &block.columns {
            let mut frames = Vec::with_capacity(2);
            if spec.ragged {
                frames.push(((block.n as u64 + 1) * 8, "offsets"));
            }
            frames.push((*values, "values"));
            for (expected, what) in frames {
                let at = r.pos;
                let got = r.u64(what)?;
                if got != expected {
                    return Err(CodecError {
                        offset: at,
                        what: format!("field `{}` {what} frame of {got} bytes, {expected} declared", spec.name),
                    });
                }
                let n = usize::try_from(got).map_err(|_| r.err("buffer larger than memory"))?;
                buffers.push(r.take(n, what)?.to_vec());
            }
            if spec.ragged {
                let offsets = &buffers[buffers.len() - 2];
                decode_offsets(&spec.name, offsets, block.n, *values, spec.row_bytes().unwrap_or(1))?;
            }
        }
    }
    Ok((DecodedMessage { header, body, buffers }, r.pos))
}

/// Encodes a message with its buffers into one byte vector, without tags (the inverse of
/// [`decode_message_bytes`]; services write with [`Outgoing`] instead, without copying, and
/// [`tag_message_bytes`] makes what travels).
pub fn encode_message_bytes(header: &Header, body: &Body, buffers: &[&[u8]]) -> Vec<u8> {
    let frame = encode(header, body);
    let mut v = Vec::with_capacity(4 + frame.len() + buffers.iter().map(|b| 8 + b.len()).sum::<usize>());
    v.extend_from_slice(&(frame.len() as u32).to_le_bytes());
    v.extend_from_slice(&frame);
    for b in buffers {
        v.extend_from_slice(&(b.len() as u64).to_le_bytes());
        v.extend_from_slice(b);
    }
    v
}

/// A message with its buffers as it travels on a connection whose next frames `mac` tags: the
/// header frame and its tag, then each buffer frame's length and its tagged records.
pub fn tag_message_bytes(mac: &mut FrameMac, header: &Header, body: &Body, buffers: &[&[u8]]) -> Vec<u8> {
    let frame = encode(header, body);
    let mut v = Vec::new();
    v.extend_from_slice(&(frame.len() as u32).to_le_bytes());
    v.extend_from_slice(&frame);
    v.extend_from_slice(&mac.tag(&[&frame]));
    for b in buffers {
        v.extend_from_slice(&(b.len() as u64).to_le_bytes());
        let mut rest = *b;
        for len in net::record_lens(b.len()) {
            let (record, after) = rest.split_at(len);
            v.extend_from_slice(record);
            v.extend_from_slice(&mac.tag(&[record]));
            rest = after;
        }
    }
    v
}

// ---------------------------------------------------------------------------------------------
// Stream I/O.

/// One outgoing message: its header frame and its buffer frames, each buffer made of any number
/// of shared parts (e.g. the stored bytes of every sample), written with vectored writes, without
/// copying them.
pub struct Outgoing {
    frame: Vec<u8>,
    buffers: Vec<Vec<Bytes>>,
}

impl Outgoing {
    /// A message without buffers.
    pub fn new(header: &Header, body: &Body) -> Outgoing {
        Outgoing { frame: encode(header, body), buffers: Vec::new() }
    }

    /// Appends one buffer frame made of `parts`.
    pub fn buffer(&mut self, parts: Vec<Bytes>) {
        self.buffers.push(parts);
    }

    /// Writes the message, tagging its frames and records with `mac` (large records on `pool`'s
    /// threads, all of them started before the first byte goes out).
    pub async fn write<W: AsyncWrite + Unpin>(
        &self,
        w: &mut W,
        mac: &mut FrameMac,
        pool: &MacPool,
    ) -> std::io::Result<()> {
        let mut head = Vec::with_capacity(4 + self.frame.len() + net::TAG_LEN);
        head.extend_from_slice(&(self.frame.len() as u32).to_le_bytes());
        head.extend_from_slice(&self.frame);
        head.extend_from_slice(&mac.tag(&[&self.frame]));
        let mut message = vec![Outbound::Plain(Bytes::from(head))];
        for parts in &self.buffers {
            let len = parts.iter().map(|s| s.len() as u64).sum::<u64>();
            message.push(Outbound::Plain(Bytes::copy_from_slice(&len.to_le_bytes())));
            message.push(Outbound::Records(parts.clone()));
        }
        net::write_message(w, mac, pool, &message).await
    }
}

/// Writes a message without buffers, tagged with `mac`.
pub async fn write_message<W: AsyncWrite + Unpin>(
    w: &mut W,
    mac: &mut FrameMac,
    header: &Header,
    body: &Body,
) -> std::io::Result<()> {
    let mut frame = Vec::new();
    write_message_with(w, mac, header, body, &mut frame).await
}

/// [`write_message`], encoding into `frame` (kept by the caller between messages).
pub async fn write_message_with<W: AsyncWrite + Unpin>(
    w: &mut W,
    mac: &mut FrameMac,
    header: &Header,
    body: &Body,
    frame: &mut Vec<u8>,
) -> std::io::Result<()> {
    encode_into(frame, header, body);
    let len = (frame.len() as u32).to_le_bytes();
    let tag = mac.tag(&[frame]);
    net::write_all_slices(w, &mut [IoSlice::new(&len), IoSlice::new(frame), IoSlice::new(&tag)]).await?;
    w.flush().await
}

/// Largest buffer a connection keeps between messages; one left larger by a big message is
/// dropped, so that an idle connection does not hold it.
pub const KEPT_BUFFER: usize = 4 << 20;

/// Failure reading a message from a stream.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// The stream failed or closed.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// The frame was malformed (the stream may be out of step: close it after replying).
    #[error(transparent)]
    Codec(#[from] CodecError),
}

/// Reads one header frame into `buf`, checks its tag with `mac` and decodes it.
pub async fn read_message<R: AsyncReadExt + Unpin>(
    r: &mut R,
    mac: &mut FrameMac,
    buf: &mut Vec<u8>,
) -> Result<(Header, Body), ReadError> {
    net::read_tagged_frame(r, mac, buf, MAX_HEADER).await.map_err(|e| {
        if e.kind() == std::io::ErrorKind::InvalidData {
            ReadError::Codec(CodecError { offset: 0, what: e.to_string() })
        } else {
            ReadError::Io(e)
        }
    })?;
    Ok(decode(buf)?)
}

/// A record whose tag failed is a malformed frame (close the stream after replying); other
/// failures are the stream's.
fn records_error(e: std::io::Error) -> ReadError {
    if e.kind() == std::io::ErrorKind::InvalidData {
        ReadError::Codec(CodecError { offset: 0, what: e.to_string() })
    } else {
        ReadError::Io(e)
    }
}

async fn read_len<R: AsyncReadExt + Unpin>(r: &mut R, expected: u64, what: &str) -> Result<(), ReadError> {
    let mut len = [0u8; 8];
    r.read_exact(&mut len).await?;
    let len = u64::from_le_bytes(len);
    if len != expected {
        return Err(ReadError::Codec(CodecError {
            offset: 0,
            what: format!("buffer frame for {what} has {len} bytes where the header declared {expected}"),
        }));
    }
    Ok(())
}

/// Reads one buffer frame straight into `dst`, whose length is the declared one, starting its
/// records' checks in `checks` (large records on `pool`'s threads, while the next ones arrive).
/// The bytes may be used once `checks` finished without an error ([`finish_checks`]).
///
/// # Safety
/// As [`RecordChecks::read`]: `dst` stays allocated, and nothing else writes it, until `checks`
/// are finished or dropped, even if this future is leaked.
pub async unsafe fn read_buffer_into<R: AsyncReadExt + net::ReadVectored + Unpin>(
    (r, mac, pool): (&mut R, &mut FrameMac, &MacPool),
    checks: &mut RecordChecks,
    dst: &mut [u8],
    what: &str,
) -> Result<(), ReadError> {
    read_len(r, dst.len() as u64, what).await?;
    let mut dsts = [dst];
    // SAFETY: forwarded from the caller.
    unsafe { checks.read(r, mac, pool, &mut dsts) }.await.map_err(records_error)
}

/// [`read_buffer`] leaving its records' checks in `checks`: the bytes may be used once `checks`
/// finished without an error ([`finish_checks`]).
///
/// # Safety
/// The returned vector stays allocated, and nothing writes it, until `checks` are finished or
/// dropped, even if the caller's future is leaked (keep it in that future, dropped after
/// `checks`).
pub async unsafe fn read_buffer_later<R: AsyncReadExt + net::ReadVectored + Unpin>(
    (r, mac, pool): &mut (&mut R, &mut FrameMac, &MacPool),
    checks: &mut RecordChecks,
    expected: u64,
    what: &str,
) -> Result<Vec<u8>, ReadError> {
    read_len(r, expected, what).await?;
    let mut v = receive_buffer(expected as usize);
    let mut dsts = [&mut v[..]];
    // SAFETY: forwarded from the caller (moving the vector does not move its bytes).
    unsafe { checks.read(*r, mac, pool, &mut dsts) }.await.map_err(records_error)?;
    Ok(v)
}

/// Waits for `checks`: a record whose tag failed is a malformed frame.
pub async fn finish_checks(checks: &mut RecordChecks) -> Result<(), ReadError> {
    checks.finish().await.map_err(records_error)
}

/// A zeroed buffer of `len` bytes for a socket to fill. Large ones ask for transparent huge pages
/// first: receiving into fresh 4 KiB pages costs one page fault per 4 KiB, which on loopback is
/// comparable to the copy itself. (The allocation is fresh zero pages from the kernel, not yet
/// touched, so the advice applies before the first fault.)
pub fn receive_buffer(len: usize) -> Vec<u8> {
    let v = vec![0u8; len];
    #[cfg(target_os = "linux")]
    if len >= 4 << 20 {
        const HUGE: usize = 2 << 20;
        let start = (v.as_ptr() as usize).next_multiple_of(HUGE);
        let end = (v.as_ptr() as usize + len) & !(HUGE - 1);
        if end > start {
            // SAFETY: [start, end) lies inside `v`'s allocation; MADV_HUGEPAGE is advice about how
            // to back those pages and changes neither their contents nor their validity.
            unsafe {
                libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
            }
        }
    }
    v
}

/// Reads one buffer frame of the declared length into a new vector. The caller bounds `expected`
/// (a storage unit by its capacity), so a lying header cannot make it allocate without limit.
pub async fn read_buffer<R: AsyncReadExt + net::ReadVectored + Unpin>(
    r: &mut R,
    mac: &mut FrameMac,
    pool: &MacPool,
    expected: u64,
    what: &str,
) -> Result<Vec<u8>, ReadError> {
    read_len(r, expected, what).await?;
    let mut v = receive_buffer(expected as usize);
    // SAFETY: `v` belongs to this future: leaked, it leaks with it; else it outlives the checks.
    unsafe { net::read_records(r, mac, pool, &mut v) }.await.map_err(records_error)?;
    Ok(v)
}

/// Reads and discards the buffer frames of `block` (after refusing a request), keeping the stream
/// in step. Stops at the first frame whose length disagrees.
pub async fn skip_buffers<R: AsyncReadExt + Unpin>(
    r: &mut R,
    mac: &mut FrameMac,
    block: &Block,
) -> Result<(), ReadError> {
    for len in block.buffer_lens() {
        read_len(r, len, "a refused request").await?;
        net::skip_records(r, mac, len).await.map_err(records_error)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_batch_alone_round_trips_and_refuses_trailing_or_missing_bytes() {
        let m = meta();
        let b = encode_meta(&m);
        assert_eq!(decode_meta(&b).unwrap(), m);
        let mut longer = b.clone();
        longer.push(0);
        assert!(decode_meta(&longer).unwrap_err().what.contains("1 bytes after the batch"));
        for cut in [0, 1, b.len() / 2, b.len() - 1] {
            assert!(decode_meta(&b[..cut]).is_err(), "cut at {cut}");
        }
    }

    fn meta() -> BatchMeta {
        let mut b = BatchMeta::builder(
            "step-1",
            vec![FieldSpec::ragged("ids", DType::I64), FieldSpec::fixed("reward", DType::F32, vec![])],
        );
        b.push("a_g0", 0, 5, &[5, 1], &SampleTags::default()).unwrap();
        b.push("a_g1", 1, 2, &[2, ABSENT], &vec![("uid".to_string(), "a".to_string())].into()).unwrap();
        b.finish()
    }

    pub(crate) fn every_body() -> Vec<Body> {
        let block = Block {
            n: 2,
            columns: vec![(FieldSpec::ragged("ids", DType::I64), 56), (FieldSpec::fixed("r", DType::F32, vec![2]), 16)],
        };
        vec![
            Body::Register(meta()),
            Body::Claim { partition: "p".into(), group: "g".into(), n: 3, min: 1, required: vec!["ids".into()] },
            Body::Ack { partition: "p".into(), group: "g".into(), claim_id: 9, keys: vec!["k".into()] },
            Body::Clear { partition: "p".into() },
            Body::ReportLost { unit: 3, reason: "closed".into() },
            Body::Put { partition: "p".into(), keys: vec!["a".into(), "b".into()], block: block.clone() },
            Body::Get { partition: "p".into(), keys: vec!["a".into()], fields: vec!["ids".into()] },
            Body::ClearUnit { partition: "p".into() },
            Body::Ping,
            Body::Fanout { meta: meta(), block: block.clone() },
            Body::Done,
            Body::Claimed { claim_id: 1, lease_ms: 30_000, meta: meta() },
            Body::Acked { acked: 2, stale: vec!["x".into()] },
            Body::Cleared { freed: 10, units: 2 },
            Body::Stored { bytes: 72 },
            Body::Data { block },
            Body::Pong { unit: 1, used: 2, capacity: 3 },
            Body::Error { code: ErrorCode::CapacityTimeout, message: "full".into() },
        ]
    }

    #[test]
    fn every_body_round_trips_and_every_truncation_is_an_error() {
        for body in every_body() {
            let h = Header { version: WIRE_VERSION, request_id: 7, token: "e0-abc".into() };
            let frame = encode(&h, &body);
            assert_eq!(decode(&frame).unwrap(), (h.clone(), body.clone()));
            for cut in 0..frame.len() {
                assert!(decode(&frame[..cut]).is_err(), "{body:?} cut at {cut}");
            }
            let mut longer = frame.clone();
            longer.push(0);
            assert!(decode(&longer).is_err());
        }
    }

    /// Metadata with random schemas, keys (any Unicode), rows (absent or not) and tags: shared
    /// sets, fresh per-sample sets and none.
    fn any_meta() -> impl Strategy<Value = BatchMeta> {
        let field = ("[a-z_]{1,8}", 0..DType::ALL.len(), any::<bool>(), prop::collection::vec(1u32..5, 0..3));
        let sample = (
            "\\PC{0,6}",
            any::<u32>(),
            any::<u32>(),
            prop::collection::vec(prop_oneof![Just(ABSENT), 0u32..9999], 5),
            0..4usize,
        );
        ("\\PC{0,10}", prop::collection::vec(field, 0..5), prop::collection::vec(sample, 0..40)).prop_map(
            |(partition, fields, samples)| {
                let schema: Vec<FieldSpec> = fields
                    .into_iter()
                    .map(|(name, d, ragged, inner)| FieldSpec { name, dtype: DType::ALL[d], ragged, inner })
                    .collect();
                let nf = schema.len();
                let shared: SampleTags = vec![("uid".into(), "ü-7".into()), ("rm".into(), String::new())].into();
                let mut b = BatchMeta::builder(partition, schema);
                for (i, (key, unit, tokens, rows, t)) in samples.into_iter().enumerate() {
                    let tags = match t {
                        0 => SampleTags::default(),
                        1 => shared.clone(),
                        2 => vec![("uid".into(), "ü-7".into()), ("rm".into(), String::new())].into(),
                        _ => vec![("n".into(), i.to_string())].into(),
                    };
                    b.push(&key, unit, tokens, &rows[..nf], &tags).unwrap();
                }
                b.finish()
            },
        )
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config { cases: 128, ..Default::default() })]

        #[test]
        fn columnar_meta_round_trips_in_every_body_and_every_truncation_is_an_error(meta in any_meta()) {
            let h = Header { version: WIRE_VERSION, request_id: 3, token: "e0-abc".into() };
            let block = Block { n: meta.len() as u32, columns: vec![] };
            for body in [
                Body::Register(meta.clone()),
                Body::Claimed { claim_id: 1, lease_ms: 5, meta: meta.clone() },
                Body::Fanout { meta: meta.clone(), block },
            ] {
                let frame = encode(&h, &body);
                proptest::prop_assert_eq!(decode(&frame).unwrap(), (h.clone(), body.clone()));
                for cut in 0..frame.len() {
                    proptest::prop_assert!(decode(&frame[..cut]).is_err(), "cut at {}", cut);
                }
            }
        }

        #[test]
        fn corrupted_columnar_meta_fails_cleanly_or_re_encodes_stably(
            meta in any_meta(),
            flips in prop::collection::vec((any::<usize>(), 1u8..), 1..4),
        ) {
            let h = Header { version: WIRE_VERSION, request_id: 3, token: "t".into() };
            let mut frame = encode(&h, &Body::Claimed { claim_id: 1, lease_ms: 5, meta });
            for (at, x) in flips {
                let at = at % frame.len();
                frame[at] ^= x;
            }
            if let Ok((h, body)) = decode(&frame) {
                proptest::prop_assert_eq!(decode(&encode(&h, &body)).unwrap(), (h, body));
            }
        }
    }

    #[test]
    fn bad_key_offsets_and_tag_set_indices_are_errors() {
        // Two samples, no fields, no tags: the body ends with key offsets (12 bytes), keys "ab" and
        // "é" (4 bytes), units (8), tokens (8), one empty tag set (8) and the set indices (8).
        let mut b = BatchMeta::builder("p", vec![]);
        for k in ["ab", "é"] {
            b.push(k, 0, 1, &[], &SampleTags::default()).unwrap();
        }
        let meta = b.finish();
        let h = Header { version: WIRE_VERSION, request_id: 1, token: "t".into() };
        let frame = encode(&h, &Body::Register(meta.clone()));
        assert_eq!(decode(&frame).unwrap().1, Body::Register(meta));
        let offsets = frame.len() - 48;
        assert_eq!(&frame[offsets..offsets + 12], &[0, 0, 0, 0, 2, 0, 0, 0, 4, 0, 0, 0]);
        let patched = |at: usize, v: u32| {
            let mut f = frame.clone();
            f[at..at + 4].copy_from_slice(&v.to_le_bytes());
            decode(&f).unwrap_err().to_string()
        };
        assert!(patched(offsets, 1).contains("start at 1"));
        assert!(patched(offsets + 4, 3).contains("character boundaries"), "splits the é");
        assert!(patched(offsets + 4, 5).contains("spans bytes 0..5"), "past the key bytes");
        assert!(patched(frame.len() - 4, 1).contains("tag set 1 of 1"));
    }

    #[test]
    fn meta_is_laid_out_as_documented() {
        // docs/transfer-queue.md, "Batch metadata": the bytes a Python peer reads.
        let mut want = vec![WIRE_VERSION as u8, 0, 1, 0, 7, 0, 0, 0, 1, 0, 0, 0, b't'];
        let s = |w: &mut Vec<u8>, x: &str| {
            w.extend_from_slice(&(x.len() as u32).to_le_bytes());
            w.extend_from_slice(x.as_bytes());
        };
        let u32s = |w: &mut Vec<u8>, xs: &[u32]| xs.iter().for_each(|x| w.extend_from_slice(&x.to_le_bytes()));
        s(&mut want, "step-1");
        u32s(&mut want, &[2]);
        s(&mut want, "ids");
        want.extend_from_slice(&[DType::I64.code(), 1, 0]);
        s(&mut want, "reward");
        want.extend_from_slice(&[DType::F32.code(), 0, 0]);
        u32s(&mut want, &[2]); // nsamples
        u32s(&mut want, &[0, 4, 8]); // key offsets
        want.extend_from_slice(b"a_g0a_g1");
        u32s(&mut want, &[0, 1]); // units
        u32s(&mut want, &[5, 2]); // tokens
        u32s(&mut want, &[5, 2, 1, ABSENT]); // rows, field by field
        u32s(&mut want, &[2, 0, 1]); // two tag sets: the empty one, then one tag
        s(&mut want, "uid");
        s(&mut want, "a");
        u32s(&mut want, &[0, 1]); // each sample's set
        let h = Header { version: WIRE_VERSION, request_id: 7, token: "t".into() };
        assert_eq!(encode(&h, &Body::Register(meta())), want);
        assert_eq!(decode(&want).unwrap().1, Body::Register(meta()));
    }

    #[test]
    fn another_version_is_refused_before_the_body() {
        let mut frame = encode(&Header { version: WIRE_VERSION, request_id: 0, token: "t".into() }, &Body::Ping);
        frame[0] = 9;
        let e = decode(&frame).unwrap_err();
        assert!(e.what.contains("wire version 9"), "{e}");
    }

    #[test]
    fn offsets_are_checked() {
        let ok = encode_offsets(&[0, 2, 5]);
        assert_eq!(decode_offsets("ids", &ok, 2, 40, 8).unwrap(), vec![0, 2, 5]);
        assert!(decode_offsets("ids", &ok, 2, 48, 8).is_err());
        assert!(decode_offsets("ids", &encode_offsets(&[1, 2, 5]), 2, 32, 8).is_err());
        assert!(decode_offsets("ids", &encode_offsets(&[0, 6, 5]), 2, 40, 8).is_err());
        assert!(decode_offsets("ids", &ok, 3, 40, 8).is_err());
    }
}
