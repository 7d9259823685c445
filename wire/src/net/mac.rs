//! Per-frame authentication: every frame after a connection's handshake carries a tag that only
//! the two ends of that connection can make.
//!
//! The handshake ([`super::handshake`]) derives two 32-byte keys per connection, one per
//! direction, from the job epoch's key, the whole hello and both sides' fresh nonces
//! ([`Session`]); a recorded connection's keys never recur. Each direction numbers its frames
//! from 0, and frame `n`'s tag is its AES-256-GMAC ([`super::gmac`]) under the direction's key
//! with the 96-bit nonce `n` (u64, little-endian) followed by four zero bytes: AES-GCM's tag with
//! the frame's bytes as associated data and nothing encrypted. So an on-path attacker who relays a
//! genuine handshake can neither alter nor inject a frame, and cannot drop, replay or reorder one
//! either: the next frame's number would not match. A frame is acted on only after its tag checks
//! out; bulk frames are cut into records of at most [`RECORD_BYTES`] ([`record_lens`]), each with
//! its own tag, so that a receiver checks bytes while the next record arrives ([`MacPool`] runs
//! the checks beside the I/O) and a sender tags one record while writing the one before.
//!
//! Why GMAC: a standard MAC any GCM library computes, and with AVX-512's carry-less
//! multiplication the cheapest per byte measured (docs/benchmarks.md): 4–5× keyed BLAKE3 on one
//! core, which the tags used before. A tag's CPU time is what it costs where the cores are busy.

use std::io;
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};

use super::gmac::Gmac;

/// Bytes of a frame's tag.
pub const TAG_LEN: usize = 16;
/// Largest record of a bulk frame that one tag covers.
pub const RECORD_BYTES: usize = 256 << 10;
/// The first and the last record of a bulk frame of more than twice this ([`record_lens`]).
pub const FIRST_RECORD: usize = 16 << 10;

/// The lengths of the records a bulk frame of `len` bytes travels in, in order. They grow from
/// [`FIRST_RECORD`] by doubling up to [`RECORD_BYTES`] and shrink back the same way at the end,
/// each end's sizes used only while more than twice as many bytes are left; the middle is
/// [`RECORD_BYTES`] records, the last of them holding the rest. Small ends keep short what cannot
/// overlap the transfer: the writer's first tag, made before its record goes out, and the
/// reader's last check, made after everything arrived (a 256 KiB record takes ~55 µs to tag).
/// E.g. 40 KiB → 16, 8, 16 KiB; 1 MiB → 16, 32, 64, 128, 256, 256, 32, 128, 64, 32, 16 KiB.
pub fn record_lens(len: usize) -> impl Iterator<Item = usize> {
    let mut ramp = Vec::new();
    let (mut left, mut size) = (len, FIRST_RECORD);
    while size < RECORD_BYTES && left > 2 * size {
        ramp.push(size);
        left -= 2 * size;
        size *= 2;
    }
    let middle = (0..left.div_ceil(RECORD_BYTES)).map(move |i| RECORD_BYTES.min(left - i * RECORD_BYTES));
    ramp.clone().into_iter().chain(middle).chain(ramp.into_iter().rev())
}
/// Bytes of a direction's key.
pub const FRAME_KEY_LEN: usize = 32;

/// A frame's tag.
pub type Tag = [u8; TAG_LEN];

/// A frame whose tag did not check out: altered, injected, dropped, replayed or reordered between
/// the two ends, or sent by a process that did not run this connection's handshake.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "frame {frame} of this connection failed its authentication tag: it was altered, injected, replayed or \
     reordered on the way (an on-path attacker or a corrupting link); the connection is closed and nothing \
     in the frame was used"
)]
pub struct BadTag {
    /// The frame's number in its direction (from 0).
    pub frame: u64,
}

impl From<BadTag> for io::Error {
    fn from(e: BadTag) -> io::Error {
        io::Error::new(io::ErrorKind::InvalidData, e)
    }
}

/// The key and number of one frame: enough to tag or check it anywhere (on a helper thread too).
#[derive(Clone)]
pub struct FrameKey {
    gmac: Arc<Gmac>,
    frame: u64,
}

impl std::fmt::Debug for FrameKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FrameKey").field("frame", &self.frame).field("key", &"<secret>").finish()
    }
}

impl FrameKey {
    /// The frame's number in its direction.
    pub fn frame(&self) -> u64 {
        self.frame
    }

    /// The tag of a frame made of `parts`, in order.
    pub fn tag(&self, parts: &[&[u8]]) -> Tag {
        self.gmac.tag(&frame_nonce(self.frame), parts)
    }

    /// Whether `tag` is the tag of the frame made of `parts` (compared in constant time).
    pub fn check(&self, parts: &[&[u8]], tag: &[u8]) -> Result<(), BadTag> {
        let ours = self.tag(parts);
        let differ = tag.len() != TAG_LEN || ours.iter().zip(tag).fold(0u8, |acc, (a, b)| acc | (a ^ b)) != 0;
        if differ { Err(BadTag { frame: self.frame }) } else { Ok(()) }
    }
}

/// GMAC's nonce for frame `n`: `n` as u64 little-endian, then four zero bytes.
fn frame_nonce(n: u64) -> [u8; 12] {
    let mut nonce = [0u8; 12];
    nonce[..8].copy_from_slice(&n.to_le_bytes());
    nonce
}

/// One direction of a connection's frame authentication: its key and the next frame's number.
pub struct FrameMac {
    gmac: Arc<Gmac>,
    next: u64,
}

impl std::fmt::Debug for FrameMac {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FrameMac").field("next", &self.next).field("key", &"<secret>").finish()
    }
}

impl FrameMac {
    /// A direction keyed with `key`, at frame 0.
    pub fn new(key: [u8; FRAME_KEY_LEN]) -> FrameMac {
        FrameMac { gmac: Arc::new(Gmac::new(&key)), next: 0 }
    }

    /// The next frame's key, moving past it: frames are tagged and checked in the order this is
    /// called, wherever the work is done.
    pub fn next_key(&mut self) -> FrameKey {
        let k = FrameKey { gmac: self.gmac.clone(), frame: self.next };
        self.next += 1;
        k
    }

    /// Tags the next frame, made of `parts`.
    pub fn tag(&mut self, parts: &[&[u8]]) -> Tag {
        self.next_key().tag(parts)
    }

    /// Checks the next frame, made of `parts`, against `tag`.
    pub fn check(&mut self, parts: &[&[u8]], tag: &[u8]) -> Result<(), BadTag> {
        self.next_key().check(parts, tag)
    }

    /// Frames tagged or checked so far.
    pub fn frames(&self) -> u64 {
        self.next
    }
}

/// Both directions of one connection, as the handshake left them.
#[derive(Debug)]
pub struct Session {
    /// Tags what this side sends.
    pub send: FrameMac,
    /// Checks what this side receives.
    pub recv: FrameMac,
}

impl Session {
    /// The session of the side whose outgoing key is `send` and incoming key `recv`.
    pub fn new(send: [u8; FRAME_KEY_LEN], recv: [u8; FRAME_KEY_LEN]) -> Session {
        Session { send: FrameMac::new(send), recv: FrameMac::new(recv) }
    }

    /// The two ends of one connection, keyed from `seed`: for tests, and for measuring the cost
    /// of tags on a connection without a handshake. Never for a real connection: anyone can
    /// compute these keys.
    pub fn fixed_pair(seed: u8) -> (Session, Session) {
        let a = [seed; FRAME_KEY_LEN];
        let mut b = a;
        b[0] ^= 0xff;
        (Session::new(a, b), Session::new(b, a))
    }
}

// ---------------------------------------------------------------------------------------------
// Helper threads.

enum State<R> {
    Queued,
    Running,
    Done(R),
    Taken,
    Cancelled,
}

struct Slot<R> {
    state: Mutex<State<R>>,
    ran: Condvar,
    notify: tokio::sync::Notify,
}

type Job = Box<dyn FnOnce() + Send>;

/// Helper threads that tag and check records beside a connection's I/O: jobs run in the order
/// submitted, and each one's result is awaited through its [`Pending`]. Plain data owned by
/// whatever owns the connections (a transport, a client, a server); cheap to clone (the clones
/// share the threads, which start at the first job and end when the last clone is dropped). If
/// the threads cannot be started, jobs run on the caller's thread: slower, never wrong.
#[derive(Clone)]
pub struct MacPool {
    inner: Arc<PoolInner>,
}

struct PoolInner {
    name: String,
    threads: usize,
    jobs: std::sync::OnceLock<Option<mpsc::Sender<Job>>>,
}

impl std::fmt::Debug for MacPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MacPool").field("name", &self.inner.name).field("threads", &self.inner.threads).finish()
    }
}

impl MacPool {
    /// A pool of `threads` helper threads (at least 1), named `<name>-mac-<i>`, started at the
    /// first job.
    pub fn new(name: &str, threads: usize) -> MacPool {
        MacPool {
            inner: Arc::new(PoolInner {
                name: name.chars().take(8).collect(),
                threads: threads.max(1),
                jobs: std::sync::OnceLock::new(),
            }),
        }
    }

    fn start(&self) -> Option<mpsc::Sender<Job>> {
        let (jobs, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..self.inner.threads {
            let rx = rx.clone();
            let started = std::thread::Builder::new().name(format!("{}-mac-{i}", self.inner.name)).spawn(move || {
                loop {
                    let job = match rx.lock() {
                        Ok(rx) => rx.recv(),
                        Err(_) => return,
                    };
                    match job {
                        Ok(job) => job(),
                        Err(_) => return,
                    }
                }
            });
            if let Err(e) = started {
                tracing::warn!(error = %e, "cannot start a tag thread; tagging on the connection's own thread");
                if i == 0 {
                    return None;
                }
                break;
            }
        }
        Some(jobs)
    }

    /// Runs `job` on a helper thread. Dropping the [`Pending`] before the job ran cancels it; once
    /// it runs, dropping waits for it to end, so a job may read memory that its caller keeps
    /// valid until the `Pending` is gone.
    pub fn spawn<R: Send + 'static>(&self, job: impl FnOnce() -> R + Send + 'static) -> Pending<R> {
        let Some(jobs) = self.inner.jobs.get_or_init(|| self.start()) else {
            let slot = Slot { state: Mutex::new(State::Done(job())), ran: Condvar::new(), notify: Default::default() };
            return Pending { slot: Arc::new(slot) };
        };
        let slot = Arc::new(Slot { state: Mutex::new(State::Queued), ran: Condvar::new(), notify: Default::default() });
        let theirs = slot.clone();
        let run: Job = Box::new(move || {
            {
                let mut s = theirs.state.lock().unwrap_or_else(|e| e.into_inner());
                if !matches!(*s, State::Queued) {
                    return;
                }
                *s = State::Running;
            }
            // A job that panics leaves no result (its wait says so) rather than a waiter forever.
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
            *theirs.state.lock().unwrap_or_else(|e| e.into_inner()) = match r {
                Ok(r) => State::Done(r),
                Err(_) => State::Cancelled,
            };
            theirs.ran.notify_all();
            theirs.notify.notify_one();
        });
        if jobs.send(run).is_err() {
            // No thread is left to run it: the wait says so.
            *slot.state.lock().unwrap_or_else(|e| e.into_inner()) = State::Cancelled;
        }
        Pending { slot }
    }
}

/// A job submitted to a [`MacPool`].
pub struct Pending<R> {
    slot: Arc<Slot<R>>,
}

impl<R> Pending<R> {
    /// Whether the job has ended (so that [`Pending::wait`] returns at once).
    pub fn is_done(&self) -> bool {
        !matches!(*self.slot.state.lock().unwrap_or_else(|e| e.into_inner()), State::Queued | State::Running)
    }

    /// The job's result; `None` if it never ran (its pool's threads are gone).
    pub async fn wait(self) -> Option<R> {
        loop {
            {
                let mut s = self.slot.state.lock().unwrap_or_else(|e| e.into_inner());
                match std::mem::replace(&mut *s, State::Taken) {
                    State::Done(r) => return Some(r),
                    State::Cancelled | State::Taken => return None,
                    other => *s = other,
                }
            }
            self.slot.notify.notified().await;
        }
    }
}

impl<R> Drop for Pending<R> {
    fn drop(&mut self) {
        let mut s = self.slot.state.lock().unwrap_or_else(|e| e.into_inner());
        if matches!(*s, State::Queued) {
            *s = State::Cancelled;
            return;
        }
        while matches!(*s, State::Running) {
            s = self.slot.ran.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// A span of memory a helper thread reads: the caller keeps it valid and unchanged until the
/// [`Pending`] of the job that reads it is gone.
#[derive(Clone, Copy, Debug)]
pub struct Span {
    addr: usize,
    len: usize,
}

impl Span {
    /// The span of `bytes`.
    pub fn of(bytes: &[u8]) -> Span {
        Span { addr: bytes.as_ptr() as usize, len: bytes.len() }
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The span of `len` bytes at address `addr` (reading it is what is unsafe).
    pub fn new(addr: usize, len: usize) -> Span {
        Span { addr, len }
    }

    /// The bytes.
    ///
    /// # Safety
    /// The memory the span was made from is still valid and not being written.
    pub unsafe fn bytes<'a>(self) -> &'a [u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: forwarded from the caller.
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len) }
    }
}

impl FrameKey {
    /// [`FrameKey::tag`] over spans.
    ///
    /// # Safety
    /// As [`Span::bytes`], for every span.
    pub unsafe fn tag_spans(&self, spans: &[Span]) -> Tag {
        // SAFETY: forwarded from the caller.
        let parts: Vec<&[u8]> = spans.iter().map(|s| unsafe { s.bytes() }).collect();
        self.tag(&parts)
    }

    /// [`FrameKey::check`] over spans.
    ///
    /// # Safety
    /// As [`Span::bytes`], for every span.
    pub unsafe fn check_spans(&self, spans: &[Span], tag: &[u8]) -> Result<(), BadTag> {
        // SAFETY: forwarded from the caller.
        let parts: Vec<&[u8]> = spans.iter().map(|s| unsafe { s.bytes() }).collect();
        self.check(&parts, tag)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_checks_only_with_its_key_number_and_bytes() {
        let (mut a, mut b) = Session::fixed_pair(7);
        let t0 = a.send.tag(&[b"he", b"llo"]);
        let t1 = a.send.tag(&[b"world"]);
        // Reordered: frame 1's tag at frame 0.
        assert_eq!(b.recv.clone_for_test().check(&[b"world"], &t1), Err(BadTag { frame: 0 }));
        b.recv.check(&[b"hello"], &t0).unwrap();
        // Altered.
        assert_eq!(b.recv.clone_for_test().check(&[b"worle"], &t1), Err(BadTag { frame: 1 }));
        b.recv.check(&[b"world"], &t1).unwrap();
        // Replayed.
        assert!(b.recv.check(&[b"world"], &t1).is_err());
        // The other direction's key does not pass.
        let mut back = a.recv.clone_for_test();
        let wrong = a.send.tag(&[b"x"]);
        assert!(back.check(&[b"x"], &wrong).is_err());
        assert!(b.recv.check(&[b"x"], &wrong[..8]).is_err(), "a short tag never passes");
    }

    impl FrameMac {
        fn clone_for_test(&self) -> FrameMac {
            FrameMac { gmac: self.gmac.clone(), next: self.next }
        }
    }

    #[tokio::test]
    async fn pool_jobs_run_off_thread_and_drop_waits_or_cancels() {
        let pool = MacPool::new("test", 2);
        let key = FrameMac::new([1; 32]).next_key();
        let data = vec![5u8; 3 << 20];
        let span = Span::of(&data);
        let k = key.clone();
        // SAFETY: `data` outlives the pending job (awaited below).
        let tag = pool.spawn(move || unsafe { k.tag_spans(&[span]) }).wait().await.unwrap();
        assert_eq!(tag, key.tag(&[&data]));
        // Dropped while queued or running: never reads `data` after the drop.
        for _ in 0..20 {
            let k = key.clone();
            // SAFETY: dropping the pending job waits for it before `data` goes.
            let p = pool.spawn(move || unsafe { k.tag_spans(&[span]) });
            drop(p);
        }
        drop(data);
        let gone = MacPool::new("gone", 1);
        gone.inner.jobs.set(Some(mpsc::channel().0)).unwrap();
        assert_eq!(gone.spawn(|| 1).wait().await, None, "a pool whose threads are gone says so");
        assert_eq!(pool.spawn(|| -> u8 { panic!("a job that panics") }).wait().await, None);
        assert_eq!(pool.spawn(|| 3).wait().await, Some(3), "the pool outlives a job that panicked");
        let inline = MacPool::new("inline", 1);
        inline.inner.jobs.set(None).unwrap();
        assert_eq!(inline.spawn(|| 2).wait().await, Some(2), "a pool without threads runs jobs in place");
    }
}
