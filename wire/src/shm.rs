//! Shared-memory files mapped into this process, so that another process's bytes (a user's
//! weights, rollouts) are read and written in place, and so that this process can hand bytes out
//! (batches, staging buffers) without sending them through a socket.

use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// A mapping error: the file and what went wrong.
#[derive(Debug, thiserror::Error)]
#[error("shared-memory file {path}: {message}")]
pub struct ShmError {
    /// The file.
    pub path: String,
    /// What went wrong, and what to do.
    pub message: String,
}

fn err(path: &Path, message: impl Into<String>) -> ShmError {
    ShmError { path: path.display().to_string(), message: message.into() }
}

/// A whole file mapped shared (`MAP_SHARED`): writes through the mapping reach every process that
/// maps the file. Unmapped on drop.
pub struct SharedFile {
    addr: usize,
    len: usize,
    path: PathBuf,
}

// SAFETY: the mapping is plain memory owned by this object; concurrent access is governed by the
// protocols that hand its regions out (the refit engine's borrow contract, the local API's
// ownership rules).
unsafe impl Send for SharedFile {}
// SAFETY: as above; the object itself is never mutated after creation.
unsafe impl Sync for SharedFile {}

impl std::fmt::Debug for SharedFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedFile").field("path", &self.path).field("len", &self.len).finish()
    }
}

impl SharedFile {
    /// Maps an existing file, read-write or read-only.
    pub fn open(path: &Path, writable: bool) -> Result<SharedFile, ShmError> {
        let file = OpenOptions::new()
            .read(true)
            .write(writable)
            .open(path)
            .map_err(|e| err(path, format!("cannot open it ({e}); is it on this pod's shared /dev/shm?")))?;
        let len = file.metadata().map_err(|e| err(path, e.to_string()))?.len() as usize;
        Self::map(path, &file, len, writable)
    }

    /// Creates (or replaces) a file of `len` bytes, readable and writable by this user only, and
    /// maps it read-write.
    pub fn create(path: &Path, len: usize) -> Result<SharedFile, ShmError> {
        let _ = std::fs::remove_file(path);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .map_err(|e| err(path, format!("cannot create it: {e}")))?;
        file.set_len(len as u64).map_err(|e| err(path, format!("cannot size it to {len} bytes: {e}")))?;
        Self::map(path, &file, len, true)
    }

    fn map(path: &Path, file: &std::fs::File, len: usize, writable: bool) -> Result<SharedFile, ShmError> {
        use std::os::fd::AsRawFd;
        if len == 0 {
            return Err(err(path, "the file is empty; write the bytes before describing them"));
        }
        let prot = if writable { libc::PROT_READ | libc::PROT_WRITE } else { libc::PROT_READ };
        // SAFETY: a fresh shared mapping of an open file; the result is checked.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, file.as_raw_fd(), 0) };
        if p == libc::MAP_FAILED {
            return Err(err(path, format!("mmap of {len} bytes failed: {}", std::io::Error::last_os_error())));
        }
        Ok(SharedFile { addr: p.expose_provenance(), len, path: path.to_path_buf() })
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is mapped (never: empty files are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The address of byte `offset` of the mapping, where `[offset, offset + len)` lies inside
    /// it, or an error naming the bounds.
    pub fn address(&self, offset: u64, len: u64) -> Result<u64, ShmError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len as u64 => Ok(self.addr as u64 + offset),
            _ => Err(err(
                &self.path,
                format!("bytes {offset}..{} lie outside the file's {} bytes", offset.saturating_add(len), self.len),
            )),
        }
    }

    /// A copy of `[offset, offset + len)`.
    pub fn read(&self, offset: u64, len: u64) -> Result<Vec<u8>, ShmError> {
        let addr = self.address(offset, len)?;
        // SAFETY: in bounds of the live mapping; the bytes are copied out at once (another
        // process writing them meanwhile gives torn values, not unsoundness in this process).
        Ok(unsafe { std::slice::from_raw_parts(addr as *const u8, len as usize) }.to_vec())
    }

    /// Writes `bytes` at `offset` (the mapping must be writable).
    pub fn write(&self, offset: u64, bytes: &[u8]) -> Result<(), ShmError> {
        let addr = self.address(offset, bytes.len() as u64)?;
        // SAFETY: in bounds of the live mapping, which this process created writable.
        unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, bytes.len()) }.copy_from_slice(bytes);
        Ok(())
    }
}

impl Drop for SharedFile {
    fn drop(&mut self) {
        // SAFETY: the mapping this object created, unmapped once.
        unsafe { libc::munmap(std::ptr::with_exposed_provenance_mut(self.addr), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_through_one_mapping_are_seen_through_another() {
        let dir = std::env::temp_dir().join(format!("rlplane-shm-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("a");
        let a = SharedFile::create(&path, 4096).unwrap();
        let b = SharedFile::open(&path, false).unwrap();
        a.write(100, b"hello").unwrap();
        assert_eq!(b.read(100, 5).unwrap(), b"hello");
        let e = b.address(4000, 200).unwrap_err().to_string();
        assert!(e.contains("4000..4200") && e.contains("4096"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_empty_or_missing_file_is_refused_with_the_path() {
        let path = std::env::temp_dir().join(format!("rlplane-shm-missing-{}", std::process::id()));
        let e = SharedFile::open(&path, false).unwrap_err().to_string();
        assert!(e.contains("cannot open"), "{e}");
    }
}
