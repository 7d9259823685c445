//! The local API's wire format (docs/local-api.md): 4-byte little-endian length + one JSON object,
//! requests tagged by `op`, replies `{"ok": true, …}` or `{"ok": false, "error": {kind, message}}`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The protocol version this sidecar speaks.
pub const PROTOCOL_VERSION: u32 = 1;

/// The largest message either side may send.
pub const MAX_MESSAGE: usize = 64 << 20;

/// What kind of error a reply carries (the `kind` field; the Python client maps each to an
/// exception class).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// Malformed message, unknown op, unsupported version: the connection is closed.
    Protocol,
    /// Another process holds this rank's socket.
    Busy,
    /// A field is missing or wrong.
    Invalid,
    /// Registered tensors do not match the job's model.
    Mismatch,
    /// The call does not fit the rank's state.
    State,
    /// A wait ran past its deadline.
    Timeout,
    /// The rank's command failed.
    Failed,
    /// The job ended or the rank is stopping.
    Shutdown,
}

/// An error reply: its kind and a message that says what to do.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    /// The kind.
    pub kind: ErrorKind,
    /// What went wrong and what to do.
    pub message: String,
}

impl ApiError {
    /// An error of `kind`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> ApiError {
        ApiError { kind, message: message.into() }
    }

    /// The reply carrying it.
    pub fn reply(&self) -> Value {
        json!({"ok": false, "error": {"kind": self.kind, "message": self.message}})
    }
}

/// Shorthands.
pub fn invalid(message: impl Into<String>) -> ApiError {
    ApiError::new(ErrorKind::Invalid, message)
}

/// A `state` error.
pub fn state(message: impl Into<String>) -> ApiError {
    ApiError::new(ErrorKind::State, message)
}

/// A memory descriptor: where bytes live (docs/local-api.md, "Memory descriptors").
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum MemoryDesc {
    /// A shared-memory file.
    Shm {
        /// Its path.
        path: String,
        /// Offset of the first byte.
        offset: u64,
        /// Bytes.
        nbytes: u64,
    },
    /// A CUDA IPC handle of an allocation and an offset in it.
    CudaIpc {
        /// 64 bytes as 128 hex digits.
        handle: String,
        /// Offset from the allocation's base.
        offset: u64,
        /// Bytes.
        nbytes: u64,
    },
}

impl MemoryDesc {
    /// Bytes described.
    pub fn nbytes(&self) -> u64 {
        match self {
            MemoryDesc::Shm { nbytes, .. } | MemoryDesc::CudaIpc { nbytes, .. } => *nbytes,
        }
    }
}

/// A tensor in `register_weights`.
#[derive(Clone, Debug, Deserialize)]
pub struct TensorReg {
    /// The process's name for it (mapped through `name_map`).
    pub name: String,
    /// Element type, as the manifest names it.
    pub dtype: String,
    /// Shape.
    pub shape: Vec<u64>,
    /// Where its bytes are.
    pub memory: MemoryDesc,
}

/// A column of a put or a batch.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ColumnDesc {
    /// Field name.
    pub name: String,
    /// Element type (`i64`, `f32`, `bf16`, …).
    pub dtype: String,
    /// Ragged (values + offsets) or fixed (one row per sample).
    pub ragged: bool,
    /// Shape of one row.
    #[serde(default)]
    pub inner: Vec<u32>,
    /// Samples.
    pub len: usize,
    /// The values.
    pub values: MemoryDesc,
    /// Ragged: `len + 1` u64 row offsets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offsets: Option<MemoryDesc>,
}

/// A request (the `op` names the variant).
#[derive(Clone, Debug, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// The handshake.
    Hello {
        /// Protocol version.
        protocol: u32,
        /// `trainer` or `engine`.
        role: String,
        /// Free-form client name.
        #[serde(default)]
        client: Option<String>,
        /// What this connection does on the rank: `all` (default), or on an engine rank
        /// `rollouts` (steps and puts) or `weights` (registration and staged loads), so that an
        /// engine's driver and its tensor-parallel workers share a rank.
        #[serde(default)]
        session: Option<String>,
    },
    /// The GPUs the user's process sees (UUIDs), to check that the rank's GPU is one of them.
    CheckGpus {
        /// `GPU-…` UUIDs, as CUDA or nvidia-smi name them.
        uuids: Vec<String>,
    },
    /// Scalars about a step's learning (reward, KL, lengths…), for the job's metrics and status.
    ReportScalars {
        /// The step they belong to: the rank's current step.
        step: u64,
        /// Name → value.
        values: std::collections::BTreeMap<String, f64>,
    },
    /// Register weights.
    RegisterWeights {
        /// `direct` (default) or `staged`.
        #[serde(default)]
        mode: Option<String>,
        /// The tensors.
        #[serde(default)]
        tensors: Vec<TensorReg>,
        /// Process names → model names.
        #[serde(default)]
        name_map: BTreeMap<String, String>,
    },
    /// Trainer: the weights hold `version`.
    Publish {
        /// The version (the step).
        version: u64,
    },
    /// Trainer: a checkpoint of the trainer's state after `step` is saved at `uri`; a gang
    /// restart resumes from the newest one.
    CheckpointSaved {
        /// The step whose state (and weights version) it holds.
        step: u64,
        /// Where it is (a path or URI of the user's choosing).
        uri: String,
    },
    /// Trainer: the next step's batch.
    NextBatch {},
    /// Engine producer: the next step to generate.
    NextStep {},
    /// Engine producer: rollouts.
    Put {
        /// The step.
        step: u32,
        /// Sample keys.
        #[serde(default)]
        keys: Option<Vec<String>>,
        /// Tokens per sample.
        #[serde(default)]
        tokens: Option<Vec<u32>>,
        /// Tags per sample.
        #[serde(default)]
        tags: Option<Vec<Vec<(String, String)>>>,
        /// The columns.
        columns: Vec<ColumnDesc>,
    },
    /// Engine producer: the step's rollouts are all put.
    EndStep {
        /// The step.
        step: u32,
    },
    /// Engine: the weights' version.
    Version {},
    /// Engine: wait for a version.
    WaitVersion {
        /// The version.
        version: u64,
        /// Seconds to wait.
        #[serde(default)]
        timeout_s: Option<f64>,
    },
    /// Engine, staged: borrow the staging buffers at `version` or later.
    AcquireStaged {
        /// The version.
        version: u64,
        /// Seconds to wait.
        #[serde(default)]
        timeout_s: Option<f64>,
    },
    /// Engine, staged: give the staging buffers back.
    ReleaseStaged {},
    /// Fail the rank's command with a message.
    Fail {
        /// Why.
        message: String,
    },
    /// Close cleanly.
    Bye {},
}

/// The ops this protocol version knows.
pub const OPS: &[&str] = &[
    "hello",
    "register_weights",
    "publish",
    "checkpoint_saved",
    "report_scalars",
    "check_gpus",
    "next_batch",
    "next_step",
    "put",
    "end_step",
    "version",
    "wait_version",
    "acquire_staged",
    "release_staged",
    "fail",
    "bye",
];

/// Parses a request, with errors that name the op and the field.
pub fn parse(bytes: &[u8]) -> Result<Request, ApiError> {
    let v: Value = serde_json::from_slice(bytes)
        .map_err(|e| ApiError::new(ErrorKind::Protocol, format!("a message is not JSON: {e}")))?;
    let op = v.get("op").and_then(Value::as_str).ok_or_else(|| {
        ApiError::new(ErrorKind::Protocol, "a request without an \"op\" string; see docs/local-api.md")
    })?;
    if !OPS.contains(&op) {
        return Err(ApiError::new(
            ErrorKind::Protocol,
            format!("unknown op {op:?}; protocol {PROTOCOL_VERSION} knows {}", OPS.join(", ")),
        ));
    }
    let op = op.to_string();
    serde_json::from_value(v).map_err(|e| invalid(format!("op {op}: {e}")))
}

/// Reads one message; `None` at a clean end of stream.
pub async fn read_message<R: AsyncReadExt + Unpin>(r: &mut R) -> std::io::Result<Option<Vec<u8>>> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let n = u32::from_le_bytes(len) as usize;
    if n > MAX_MESSAGE {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("a message of {n} bytes (at most {MAX_MESSAGE}); describe bulk bytes in shared memory"),
        ));
    }
    let mut buf = vec![0u8; n];
    r.read_exact(&mut buf).await?;
    Ok(Some(buf))
}

/// Writes one message.
pub async fn write_message<W: AsyncWriteExt + Unpin>(w: &mut W, v: &Value) -> std::io::Result<()> {
    let body = serde_json::to_vec(v).map_err(std::io::Error::other)?;
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(&body);
    w.write_all(&frame).await
}

/// Parses a CUDA IPC handle: 128 hex digits (`cudaIpcMemHandle_t`), or PyTorch's 132 (a version
/// byte and a type byte before the same 64 bytes, as `_share_cuda_()` returns it).
pub fn parse_handle(hex: &str) -> Result<[u8; 64], ApiError> {
    let bad = || {
        invalid(format!(
            "memory.handle: {} characters; a CUDA IPC handle is 128 hex digits (or PyTorch's 132)",
            hex.len()
        ))
    };
    if !hex.is_ascii() || (hex.len() != 128 && hex.len() != 132) {
        return Err(bad());
    }
    let bytes: Vec<u8> = (0..hex.len() / 2)
        .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16))
        .collect::<Result<_, _>>()
        .map_err(|_| bad())?;
    let raw = match bytes.len() {
        64 => &bytes[..],
        _ => match bytes[1] {
            b'c' => &bytes[2..],
            b'e' => {
                return Err(invalid(
                    "memory.handle: PyTorch shared an expandable segment (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), which has no CUDA IPC handle; turn expandable segments off for the registered tensors",
                ));
            }
            t => return Err(invalid(format!("memory.handle: unknown PyTorch handle type {t:#04x}"))),
        },
    };
    Ok(raw.try_into().expect("64 bytes"))
}

/// 64 bytes as hex.
pub fn handle_hex(h: &[u8; 64]) -> String {
    h.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_parse_and_bad_ones_name_the_op_and_field() {
        let r = parse(br#"{"op":"publish","version":3}"#).unwrap();
        assert!(matches!(r, Request::Publish { version: 3 }));
        assert!(matches!(parse(br#"{"op":"next_batch"}"#).unwrap(), Request::NextBatch {}));
        let e = parse(br#"{"op":"publish"}"#).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Invalid);
        assert!(e.message.contains("publish") && e.message.contains("version"), "{}", e.message);
        let e = parse(br#"{"op":"launch"}"#).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Protocol);
        assert!(e.message.contains("launch") && e.message.contains("next_batch"), "{}", e.message);
        assert_eq!(parse(b"nope").unwrap_err().kind, ErrorKind::Protocol);
    }

    #[test]
    fn handles_round_trip_through_hex() {
        let mut h = [0u8; 64];
        for (i, b) in h.iter_mut().enumerate() {
            *b = (i * 7) as u8;
        }
        assert_eq!(parse_handle(&handle_hex(&h)).unwrap(), h);
        assert!(parse_handle("abc").is_err());
        // PyTorch's form: version 2, type 'c', the handle.
        let torch = format!("0263{}", handle_hex(&h));
        assert_eq!(parse_handle(&torch).unwrap(), h);
        let e = parse_handle(&format!("0265{}", handle_hex(&h))).unwrap_err();
        assert!(e.message.contains("expandable"), "{}", e.message);
    }
}
