//! rlplane's wire layer, the bottom of the worker's crates: what every connection, process and
//! shared file of a job is built on. It knows nothing of refit, the transfer queue or roles.
//!
//! - [`net`]: sockets with retry, length-prefixed frames, the HMAC handshake, job key files.
//! - [`link`]: a framed connection that waits for replies hot or parked ([`hot_wait`]).
//! - [`patience`]: waiting with periodic reports of what is awaited.
//! - [`shm`]: shared-memory files mapped into this process.
//! - [`proc`]: child processes.

pub mod hot_wait;
pub mod link;
pub mod net;
pub mod patience;
pub mod proc;
pub mod shm;
