//! TCP plumbing shared by every rlplane protocol (refit, transfer queue, control, fan-out), one
//! concern per module: sockets (deadlines, connecting with backoff, listeners) in [`socket`],
//! length-prefixed frames in [`frame`], the job's key files in [`key`] and the authenticated
//! handshake in [`handshake`]. Everything is re-exported here (`net::JobAuth`, `net::bind`, …).
//!
//! Every connection starts with a handshake that proves both sides hold the job epoch's key
//! ([`JobAuth`]) without sending it:
//!
//! 1. connecting side → one frame: [`Hello`] (4-byte protocol magic, protocol version, the job
//!    token, the peer's name, protocol bytes) and a fresh [`NONCE_LEN`]-byte nonce;
//! 2. accepting side: if magic, version or token differ, [`HELLO_REFUSED`] and the reason (a rank
//!    of another epoch or job is told so); else [`HELLO_CHALLENGE`], its own fresh nonce and its
//!    proof `HMAC-SHA256(key, label_s ‖ len ‖ hello ‖ nonce_s)`;
//! 3. connecting side: checks that proof (else refuses the listener, [`HELLO_REFUSED`] + reason),
//!    then [`HELLO_OK`] and its proof `HMAC-SHA256(key, label_c ‖ len ‖ hello ‖ nonce_s)`;
//! 4. accepting side: checks it, then the protocol's own checks, and answers [`HELLO_OK`] or
//!    [`HELLO_REFUSED`] + reason.
//!
//! Both proofs cover both nonces (the client's is inside the hello), so a recorded handshake
//! replayed to either side fails; the labels differ, so one side's proof never passes as the
//! other's. The handshake also leaves each side a [`Session`]: per-connection keys, derived the
//! same way, with which every later frame is tagged and checked ([`mac`]), so that a relayed
//! handshake gives an on-path attacker nothing to inject, alter, replay or reorder. Nothing a peer sends is acted on before its proof checks out, and every refusal is
//! counted ([`Refusals`]). The same steps run on the CUDA IPC control channel's Unix socket
//! ([`accept_hello_on`], [`send_hello`]).

pub mod frame;
pub mod gmac;
pub mod handshake;
pub mod key;
pub mod mac;
pub mod records;
pub mod socket;
#[cfg(test)]
mod tests;

pub use frame::{MAX_FRAME, read_frame, read_tagged, read_tagged_frame, write_frame, write_tagged, write_tagged_frame};
pub use handshake::{
    CHALLENGE_LEN, ClientHello, HELLO_CHALLENGE, HELLO_OK, HELLO_REFUSED, Hello, JobAuth, NONCE_LEN, PROOF_LEN,
    Refusals, ServerChallenge, accept_hello, accept_hello_on, send_hello,
};
pub use key::{KeyError, issue_key_file, write_key_file};
pub use mac::{
    BadTag, FIRST_RECORD, FrameKey, FrameMac, MacPool, Pending, RECORD_BYTES, Session, Span, TAG_LEN, Tag, record_lens,
};
pub use records::{
    Outbound, ReadVectored, RecordChecks, read_records, skip_records, wire_len, write_all_slices, write_message,
    write_records,
};
pub use socket::{
    NetError, bind, connect_retry, is_transient_accept_error, reserve_loopback_port, serve_connections, tune, until,
};

/// A TCP connection after its handshake: the socket and the keys that tag and check its frames.
#[derive(Debug)]
pub struct Connection {
    /// The socket.
    pub stream: tokio::net::TcpStream,
    /// Its frame keys.
    pub session: Session,
}
