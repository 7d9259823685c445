//! The job epoch's key files: issuing, writing (mode 0600 from creation) and why one could not
//! be loaded.

use std::io;
use std::path::Path;

use rlplane_api::plan::JOB_KEY_LEN;

use super::JobAuth;

/// Why a job key could not be loaded. Names the file and the fix; never shows the key.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// The key file could not be read.
    #[error(
        "cannot read the job key {path}: {source}; in a cluster the operator mounts the Secret `{secret}` \
         there (check that it exists and the pod's `job-key` volume); elsewhere write a key there, e.g. \
         `openssl rand -hex {len} > {path}`"
    )]
    Read {
        /// Path of the key file.
        path: String,
        /// The Secret that should hold it.
        secret: String,
        /// Key length in bytes.
        len: usize,
        /// Cause.
        source: io::Error,
    },
    /// The key file holds no usable key.
    #[error("the job key {path} is not a key: {reason}; write one with `openssl rand -hex {len} > {path}`")]
    Malformed {
        /// Path of the key file.
        path: String,
        /// What is wrong.
        reason: String,
        /// Key length in bytes.
        len: usize,
    },
    /// The system's random source failed.
    #[error("the system random source failed ({0})")]
    Random(String),
}

/// A fresh key ([`JobAuth::generate_key`]) written to a new file at `path` as
/// [`write_key_file`] writes it, after removing any file there: how `rlplane local` and the
/// benchmarks give their processes an epoch's key.
pub fn issue_key_file(path: &Path) -> io::Result<[u8; JOB_KEY_LEN]> {
    let key = JobAuth::generate_key().map_err(io::Error::other)?;
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    write_key_file(path, &key)?;
    Ok(key)
}

/// Writes `key` (as [`rlplane_api::plan::encode_job_key`] text) to a new file at `path` that only
/// this user can read: mode 0600 from its creation, so the key is never readable by others, not
/// even briefly. Fails if the file exists.
pub fn write_key_file(path: &Path, key: &[u8; JOB_KEY_LEN]) -> io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path)?;
    f.write_all(rlplane_api::plan::encode_job_key(key).as_bytes())
}
