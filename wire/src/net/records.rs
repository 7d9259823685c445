//! Bulk bytes as tagged records ([`super::mac`]): a body of known length travels as records of at
//! most [`RECORD_BYTES`], each followed by its [`TAG_LEN`]-byte tag. Records of at least
//! [`OFF_THREAD_BYTES`] are tagged and checked on a [`MacPool`] beside the socket I/O: a writer
//! has the next records tagged while it writes one, a reader checks records while the next ones
//! arrive. Neither copies the bytes. The two ends of a message stay on the caller's thread,
//! where they cost microseconds and no hand-over: a writer tags its first record before anything
//! can go out, a reader checks each body's last record once everything else is in.
//!
//! Soundness: helper threads never read memory that a caller could free while they run. A
//! writer's parts are [`Bytes`] (shared and immutable: each job holds its own references), and a
//! reader's destination is memory the caller promises to keep until the checks are finished or
//! dropped, even if the future reading it is leaked ([`RecordChecks::read`] is `unsafe` for that
//! reason; memory owned by the same future that owns the checks keeps the promise by itself).

use std::collections::VecDeque;
use std::io::{self, IoSlice, IoSliceMut};

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::mac::{BadTag, FrameKey, FrameMac, MacPool, Pending, RECORD_BYTES, Span, TAG_LEN, Tag, record_lens};

/// Records smaller than this are tagged and checked on the caller's thread: handing them over
/// costs more.
pub const OFF_THREAD_BYTES: usize = 8 << 10;
/// Records a reader may have read and not yet checked.
const IN_FLIGHT: usize = 8;
/// Large records a writer has tagged, or has being tagged, ahead of the one it writes.
const AHEAD: usize = 4;
/// Slices per vectored write (the kernel's IOV_MAX is 1024).
const MAX_IOV: usize = 512;
/// Bytes gathered into one vectored write at most.
const WRITE_BYTES: usize = 4 * RECORD_BYTES;

/// One piece of an outgoing message, in order.
#[derive(Clone, Debug)]
pub enum Outbound {
    /// Bytes sent as they are: a length, or a frame already tagged.
    Plain(Bytes),
    /// A body (its parts concatenated) sent as tagged records.
    Records(Vec<Bytes>),
}

/// The records of `parts` (concatenated, cut as [`record_lens`] says): each record's slices.
fn cut(parts: &[Bytes]) -> Vec<Vec<Bytes>> {
    let total = parts.iter().map(Bytes::len).sum();
    let mut lens = record_lens(total);
    let mut records = Vec::new();
    let mut current: Vec<Bytes> = Vec::new();
    let mut room = lens.next().unwrap_or(0);
    for part in parts {
        let mut at = 0;
        while at < part.len() {
            let take = (part.len() - at).min(room);
            current.push(part.slice(at..at + take));
            at += take;
            room -= take;
            if room == 0 {
                records.push(std::mem::take(&mut current));
                room = lens.next().unwrap_or(0);
            }
        }
    }
    records
}

/// Writes a message: its plain pieces as they are and its bodies as tagged records, tagged with
/// `mac` in order. Large records are tagged on `pool` up to [`AHEAD`] records ahead of the one
/// being written (a bounded window, so that the messages of other connections sharing the pool
/// are not queued behind all of this one's). Pieces whose tags are ready are gathered into
/// vectored writes of up to [`WRITE_BYTES`] (so a small message is one system call), and what is
/// gathered goes out before waiting for a tag still being made.
pub async fn write_message<W: AsyncWrite + Unpin>(
    w: &mut W,
    mac: &mut FrameMac,
    pool: &MacPool,
    message: &[Outbound],
) -> io::Result<()> {
    // Every piece in order, with the key of each record (drawn in order, tagged later).
    let mut pieces: Vec<(Vec<Bytes>, Option<FrameKey>)> = Vec::new();
    for piece in message {
        match piece {
            Outbound::Plain(b) => pieces.push((vec![b.clone()], None)),
            Outbound::Records(parts) => pieces.extend(cut(parts).into_iter().map(|r| (r, Some(mac.next_key())))),
        }
    }
    let first = pieces.iter().position(|p| p.1.is_some());
    let large = |i: usize, (slices, key): &(Vec<Bytes>, Option<FrameKey>)| {
        key.is_some() && Some(i) != first && slices.iter().map(Bytes::len).sum::<usize>() >= OFF_THREAD_BYTES
    };
    let mut running: VecDeque<Pending<Tag>> = VecDeque::new();
    let mut started = 0;
    let mut out: Vec<Bytes> = Vec::new();
    let mut pending_bytes = 0;
    for i in 0..pieces.len() {
        // Keep the next AHEAD large records' tags under way.
        while started < pieces.len() && running.len() < AHEAD {
            if large(started, &pieces[started]) {
                let (record, key) = (pieces[started].0.clone(), pieces[started].1.clone().expect("a record"));
                running.push_back(pool.spawn(move || {
                    let parts: Vec<&[u8]> = record.iter().map(|b| b.as_ref()).collect();
                    key.tag(&parts)
                }));
            }
            started += 1;
        }
        let is_large = large(i, &pieces[i]);
        let (slices, key) = std::mem::take(&mut pieces[i]);
        let tag = match key {
            None => None,
            Some(_) if is_large => {
                let p = running.pop_front().expect("a large record's tag was started");
                // Bytes ready to go never wait for a tag still being made.
                if !p.is_done() && !out.is_empty() {
                    write_all_bytes(w, &out).await?;
                    (out, pending_bytes) = (Vec::new(), 0);
                }
                Some(p.wait().await.ok_or_else(|| io::Error::other("the tag threads are gone"))?)
            }
            Some(key) => Some(key.tag(&slices.iter().map(|b| b.as_ref()).collect::<Vec<_>>())),
        };
        pending_bytes += slices.iter().map(Bytes::len).sum::<usize>();
        out.extend(slices);
        if let Some(t) = tag {
            out.push(Bytes::copy_from_slice(&t));
        }
        // Records whose tags are ready go out together, a few at a time.
        if out.len() >= MAX_IOV - 2 || pending_bytes >= WRITE_BYTES {
            write_all_bytes(w, &out).await?;
            (out, pending_bytes) = (Vec::new(), 0);
        }
    }
    write_all_bytes(w, &out).await?;
    w.flush().await
}

/// Writes the concatenation of `parts` as tagged records (its length is the caller's to send).
pub async fn write_records<W: AsyncWrite + Unpin>(
    w: &mut W,
    mac: &mut FrameMac,
    pool: &MacPool,
    parts: &[Bytes],
) -> io::Result<()> {
    write_message(w, mac, pool, &[Outbound::Records(parts.to_vec())]).await
}

async fn write_all_bytes<W: AsyncWrite + Unpin>(w: &mut W, parts: &[Bytes]) -> io::Result<()> {
    let mut slices: Vec<IoSlice<'_>> = parts.iter().filter(|b| !b.is_empty()).map(|b| IoSlice::new(b)).collect();
    write_all_slices(w, &mut slices).await
}

/// Writes every slice, in order, with vectored writes.
pub async fn write_all_slices<W: AsyncWrite + Unpin>(w: &mut W, mut slices: &mut [IoSlice<'_>]) -> io::Result<()> {
    while !slices.is_empty() {
        let window = slices.len().min(MAX_IOV);
        let n = w.write_vectored(&slices[..window]).await?;
        // A window of empty slices writes nothing without the socket having closed: skip it.
        if n == 0 {
            if slices[..window].iter().all(|s| s.is_empty()) {
                slices = &mut slices[window..];
                continue;
            }
            return Err(io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut slices, n);
    }
    Ok(())
}

/// A socket's read side that fills several slices in one system call, without waiting: what
/// [`RecordChecks::read`] reads records and their tags with.
pub trait ReadVectored {
    /// Waits until a read may make progress (bytes, the end of the stream or an error).
    fn readable(&mut self) -> impl Future<Output = io::Result<()>> + Send;
    /// Reads into `bufs` in order; `WouldBlock` when nothing is there yet, `Ok(0)` at the end of
    /// the stream.
    fn try_read_vectored(&mut self, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize>;
}

impl ReadVectored for tokio::net::TcpStream {
    fn readable(&mut self) -> impl Future<Output = io::Result<()>> + Send {
        tokio::net::TcpStream::readable(self)
    }
    fn try_read_vectored(&mut self, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        tokio::net::TcpStream::try_read_vectored(self, bufs)
    }
}

impl ReadVectored for tokio::net::tcp::ReadHalf<'_> {
    fn readable(&mut self) -> impl Future<Output = io::Result<()>> + Send {
        tokio::net::tcp::ReadHalf::readable(self)
    }
    fn try_read_vectored(&mut self, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        tokio::net::tcp::ReadHalf::try_read_vectored(self, bufs)
    }
}

impl ReadVectored for tokio::net::UnixStream {
    fn readable(&mut self) -> impl Future<Output = io::Result<()>> + Send {
        tokio::net::UnixStream::readable(self)
    }
    fn try_read_vectored(&mut self, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        tokio::net::UnixStream::try_read_vectored(self, bufs)
    }
}

/// Bytes in memory (the tests' wire).
impl ReadVectored for &[u8] {
    fn readable(&mut self) -> impl Future<Output = io::Result<()>> + Send {
        std::future::ready(Ok(()))
    }
    fn try_read_vectored(&mut self, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        io::Read::read_vectored(self, bufs)
    }
}

/// A body being read into its destinations (by address: see [`RecordChecks::read`]), and where
/// its records and their tags lie on the wire.
struct Body {
    /// The destinations, in order: (address, length).
    parts: Vec<(usize, usize)>,
    /// Each destination's offset in the body.
    starts: Vec<usize>,
    /// Each record's offset in the body, its length ([`record_lens`]) and where it starts on the
    /// wire.
    records: Vec<(usize, usize, usize)>,
    total: usize,
}

/// Bytes a vectored read of records asks for at least (more when a record is left over).
const READ_BYTES: usize = RECORD_BYTES;

impl Body {
    fn new(parts: Vec<(usize, usize)>) -> Body {
        let mut starts = Vec::with_capacity(parts.len());
        let mut total = 0;
        for &(_, len) in &parts {
            starts.push(total);
            total += len;
        }
        let mut records = Vec::new();
        let mut at = 0;
        for len in record_lens(total) {
            records.push((at, len, at + records.len() * TAG_LEN));
            at += len;
        }
        Body { parts, starts, records, total }
    }

    /// Where the records and their tags end on the wire.
    fn wire_len(&self) -> usize {
        self.total + self.records.len() * TAG_LEN
    }

    /// Where record `record`'s tag ends on the wire.
    fn record_end(&self, record: usize) -> usize {
        let (_, len, wire) = self.records[record];
        wire + len + TAG_LEN
    }

    /// Calls `f` with the destination pieces (address, length) of the body's bytes `[from, to)`.
    fn pieces(&self, from: usize, to: usize, mut f: impl FnMut(usize, usize)) {
        let mut part = self.starts.partition_point(|&s| s <= from).saturating_sub(1);
        let mut at = from;
        while at < to && part < self.parts.len() {
            let (base, len) = self.parts[part];
            let (lo, hi) = (at - self.starts[part], (to - self.starts[part]).min(len));
            if hi > lo {
                f(base + lo, hi - lo);
                at += hi - lo;
            }
            part += 1;
        }
    }

    /// Record `record`'s bytes, as spans for its check.
    fn spans(&self, record: usize) -> Vec<Span> {
        let (from, len, _) = self.records[record];
        let mut spans = Vec::new();
        // SAFETY: the pieces lie inside the destinations, which the reader's caller keeps
        // allocated while checks read them.
        self.pieces(from, from + len, |a, l| {
            spans.push(Span::of(unsafe { std::slice::from_raw_parts(a as *const u8, l) }))
        });
        spans
    }

    /// The slices that the wire's bytes from `at` on land in (records' bytes in the
    /// destinations, tags in `tags`): whole records up to [`READ_BYTES`] or more, and at most
    /// [`MAX_IOV`] slices. A record's checks start once its tag is in, so reading much more at
    /// once would hold them back.
    ///
    /// # Safety
    /// The destinations' bytes from `at` on are not referenced elsewhere while `iov` is used.
    unsafe fn slices<'a>(&self, at: usize, tags: &'a mut [Tag], iov: &mut Vec<IoSliceMut<'a>>) {
        let first = self.records.partition_point(|r| r.2 <= at) - 1;
        let mut within = at - self.records[first].2;
        let mut asked = 0;
        for (record, tag) in tags.iter_mut().enumerate().skip(first) {
            let (from, len, _) = self.records[record];
            if within < len {
                let mut cut = false;
                self.pieces(from + within, from + len, |a, l| {
                    if iov.len() < MAX_IOV - 1 {
                        // SAFETY: unread bytes of a destination, referenced nowhere else (the
                        // caller's promise).
                        iov.push(IoSliceMut::new(unsafe { std::slice::from_raw_parts_mut(a as *mut u8, l) }));
                    } else {
                        cut = true;
                    }
                });
                if cut {
                    // The tag follows the record's last byte only.
                    return;
                }
                asked += len - within;
            }
            iov.push(IoSliceMut::new(&mut tag[within.saturating_sub(len)..]));
            within = 0;
            if iov.len() >= MAX_IOV - 1 || asked >= READ_BYTES {
                return;
            }
        }
    }
}

/// A record's check: done already, or running on a helper thread.
enum Checking {
    Done(Result<(), BadTag>),
    Running(Pending<Result<(), BadTag>>),
}

impl Checking {
    async fn verdict(self) -> io::Result<()> {
        let v = match self {
            Checking::Done(v) => v,
            Checking::Running(p) => p.wait().await.ok_or_else(|| io::Error::other("the tag threads are gone"))?,
        };
        Ok(v?)
    }
}

/// The checks of the records a reader has read and not yet seen through: a message's buffers
/// are read one after another while the checks of each run beside the reading of the next, and
/// [`RecordChecks::finish`] says whether all of them passed. Dropping it waits for the checks
/// running (they read the destinations).
#[derive(Default)]
pub struct RecordChecks {
    pending: VecDeque<Checking>,
}

impl RecordChecks {
    /// No checks yet.
    pub fn new() -> RecordChecks {
        RecordChecks::default()
    }

    /// Reads the length of `dsts` (together) of records written by [`write_message`] straight
    /// into `dsts`, in order, starting their checks; a record whose tag already failed is an
    /// `InvalidData` error. The bytes may not be used before [`RecordChecks::finish`] returns.
    ///
    /// The records and their tags are read with vectored reads that cross record boundaries, so
    /// a tag costs no system call of its own; each record's check starts as soon as its tag has
    /// arrived.
    ///
    /// # Safety
    /// Helper threads read the destinations until these checks are finished or dropped: the
    /// memory must stay allocated and nothing else may write it until then, even if the future
    /// of this call (or of its caller) is leaked. Memory owned by the future that owns these
    /// checks is safe; memory borrowed from outside it is not, unless it outlives any leak.
    pub async unsafe fn read<R: ReadVectored>(
        &mut self,
        r: &mut R,
        mac: &mut FrameMac,
        pool: &MacPool,
        dsts: &mut [&mut [u8]],
    ) -> io::Result<()> {
        // Addresses rather than pointers, so that the future stays `Send`.
        let body = Body::new(dsts.iter_mut().map(|d| (d.as_mut_ptr() as usize, d.len())).collect());
        let mut tags = vec![[0u8; TAG_LEN]; body.records.len()];
        let (wire, mut at, mut started) = (body.wire_len(), 0, 0);
        while at < wire {
            let n = {
                let mut iov = Vec::with_capacity(MAX_IOV);
                // SAFETY: the slices cover bytes of `dsts` (borrowed mutably for this call) not
                // read yet, which nothing else references: records already read are only read,
                // by their checks, and lie before `at`.
                unsafe { body.slices(at, &mut tags, &mut iov) };
                match r.try_read_vectored(&mut iov) {
                    Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                    Ok(n) => n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => 0,
                    Err(e) => return Err(e),
                }
            };
            if n == 0 {
                r.readable().await?;
                continue;
            }
            at += n;
            // Every record whose tag is now in starts its check.
            while started < tags.len() && body.record_end(started) <= at {
                let spans = body.spans(started);
                let (key, tag) = (mac.next_key(), tags[started]);
                let len: usize = spans.iter().map(Span::len).sum();
                let last = started + 1 == tags.len();
                self.pending.push_back(if len >= OFF_THREAD_BYTES && !last {
                    // SAFETY: the record is not written again; the caller keeps it allocated
                    // until these checks are finished or dropped (which waits for running ones).
                    Checking::Running(pool.spawn(move || unsafe { key.check_spans(&spans, &tag) }))
                } else {
                    // SAFETY: as above, on this thread.
                    Checking::Done(unsafe { key.check_spans(&spans, &tag) })
                });
                started += 1;
            }
            while self.pending.len() > IN_FLIGHT {
                self.pending.pop_front().expect("in flight").verdict().await?;
            }
        }
        Ok(())
    }

    /// Waits for every check started: `InvalidData` naming the first record whose tag failed.
    pub async fn finish(&mut self) -> io::Result<()> {
        while let Some(c) = self.pending.pop_front() {
            c.verdict().await?;
        }
        Ok(())
    }
}

/// Reads `dst.len()` bytes of records into `dst` and checks all of them before returning.
///
/// # Safety
/// As [`RecordChecks::read`]: `dst` outlives the call's future even if it is leaked.
pub async unsafe fn read_records<R: ReadVectored>(
    r: &mut R,
    mac: &mut FrameMac,
    pool: &MacPool,
    dst: &mut [u8],
) -> io::Result<()> {
    let mut checks = RecordChecks::new();
    let mut dsts = [dst];
    // SAFETY: forwarded from the caller.
    unsafe { checks.read(r, mac, pool, &mut dsts) }.await?;
    checks.finish().await
}

/// Reads and discards `len` bytes of tagged records, checking them (a refused request's buffers,
/// kept in step).
pub async fn skip_records<R: AsyncRead + Unpin>(r: &mut R, mac: &mut FrameMac, len: u64) -> io::Result<()> {
    let mut buf = vec![0u8; RECORD_BYTES.min(len as usize)];
    for n in record_lens(len as usize) {
        r.read_exact(&mut buf[..n]).await?;
        let mut tag = [0u8; TAG_LEN];
        r.read_exact(&mut tag).await?;
        mac.check(&[&buf[..n]], &tag)?;
    }
    Ok(())
}

/// Bytes on the wire for a body of `len` bytes: the bytes and one tag per record.
pub fn wire_len(len: u64) -> u64 {
    len + (record_lens(len as usize).count() * TAG_LEN) as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::mac::{FIRST_RECORD, Session};

    fn data() -> Vec<u8> {
        (0..(RECORD_BYTES * 3 + 1000)).map(|i| (i * 7) as u8).collect()
    }

    async fn read_all(wire: &[u8], mac: &mut FrameMac, pool: &MacPool, dsts: &mut [&mut [u8]]) -> io::Result<()> {
        let (mut checks, mut r) = (RecordChecks::new(), wire);
        // SAFETY: the destinations outlive this function, which awaits the checks.
        unsafe { checks.read(&mut r, mac, pool, dsts) }.await?;
        checks.finish().await
    }

    #[tokio::test]
    async fn records_round_trip_and_any_altered_byte_fails_its_record() {
        let pool = MacPool::new("t", 2);
        let data = data();
        let all = Bytes::from(data.clone());
        let parts = [all.slice(..10), all.slice(10..RECORD_BYTES + 5), all.slice(RECORD_BYTES + 5..)];
        for flip in [None, Some(3), Some(RECORD_BYTES * 2 + 17), Some(data.len() + 3 * TAG_LEN + 5)] {
            let (mut a, mut b) = Session::fixed_pair(9);
            let mut wire = Vec::new();
            write_records(&mut wire, &mut a.send, &pool, &parts).await.unwrap();
            assert_eq!(wire.len() as u64, wire_len(data.len() as u64));
            if let Some(at) = flip {
                wire[at] ^= 0x40;
            }
            let mut dst = vec![0u8; data.len()];
            let got = read_all(&wire, &mut b.recv, &pool, &mut [&mut dst]).await;
            match flip {
                None => {
                    got.unwrap();
                    assert_eq!(dst, data);
                }
                Some(_) => assert_eq!(got.unwrap_err().kind(), io::ErrorKind::InvalidData),
            }
        }
        // Into several buffers, split anywhere.
        let (mut a, mut b) = Session::fixed_pair(9);
        let mut wire = Vec::new();
        write_records(&mut wire, &mut a.send, &pool, &parts).await.unwrap();
        let mut dst = vec![0u8; data.len()];
        let (x, rest) = dst.split_at_mut(7);
        let (y, z) = rest.split_at_mut(RECORD_BYTES * 2);
        read_all(&wire, &mut b.recv, &pool, &mut [x, &mut [], y, z]).await.unwrap();
        assert_eq!(dst, data);
        // Records in the wrong order fail too: the first and the last (both FIRST_RECORD bytes)
        // swapped, each with its own genuine tag.
        let (mut a, mut b) = Session::fixed_pair(9);
        let mut wire = Vec::new();
        write_records(&mut wire, &mut a.send, &pool, std::slice::from_ref(&all)).await.unwrap();
        let r = FIRST_RECORD + TAG_LEN;
        let at = wire.len() - r;
        let (first, rest) = wire.split_at_mut(r);
        first.swap_with_slice(&mut rest[at - r..]);
        let mut dst = vec![0u8; data.len()];
        assert!(read_all(&wire, &mut b.recv, &pool, &mut [&mut dst]).await.is_err());
    }

    #[test]
    fn records_grow_from_small_ends_and_cover_the_body() {
        let k = 1 << 10;
        assert_eq!(record_lens(0).count(), 0);
        assert_eq!(record_lens(10).collect::<Vec<_>>(), [10]);
        assert_eq!(record_lens(32 * k).collect::<Vec<_>>(), [32 * k]);
        assert_eq!(record_lens(40 * k).collect::<Vec<_>>(), [16 * k, 8 * k, 16 * k]);
        assert_eq!(
            record_lens(1024 * k).collect::<Vec<_>>(),
            [16, 32, 64, 128, 256, 256, 32, 128, 64, 32, 16].map(|x| x * k)
        );
        for len in [1, 33 * k, 100 * k, 481 * k, 3 << 20, (7 << 20) + 5] {
            let lens: Vec<usize> = record_lens(len).collect();
            assert_eq!(lens.iter().sum::<usize>(), len);
            assert!(lens.iter().all(|&l| l > 0 && l <= RECORD_BYTES));
            if len > 2 * FIRST_RECORD {
                assert_eq!((lens[0], lens[lens.len() - 1]), (FIRST_RECORD, FIRST_RECORD));
            }
            assert_eq!(wire_len(len as u64), (len + lens.len() * TAG_LEN) as u64);
        }
    }

    #[tokio::test]
    async fn records_arriving_in_odd_pieces_over_a_socket_land_in_many_small_destinations() {
        let pool = MacPool::new("t", 2);
        let data = data();
        let (mut a, mut b) = Session::fixed_pair(5);
        let mut wire = Vec::new();
        write_records(&mut wire, &mut a.send, &pool, &[Bytes::from(data.clone())]).await.unwrap();
        let (mut tx, mut rx) = tokio::net::UnixStream::pair().unwrap();
        let writer = tokio::spawn(async move {
            for piece in wire.chunks(7777) {
                tx.write_all(piece).await.unwrap();
                tokio::task::yield_now().await;
            }
            tx.write_all(b"next").await.unwrap();
        });
        // Parts of 100 bytes: one record spans more slices than one vectored read takes.
        let mut dst = vec![0u8; data.len()];
        let mut dsts: Vec<&mut [u8]> = dst.chunks_mut(100).collect();
        dsts.insert(3, &mut []);
        let mut checks = RecordChecks::new();
        // SAFETY: `dst` outlives the checks, finished below.
        unsafe { checks.read(&mut rx, &mut b.recv, &pool, &mut dsts) }.await.unwrap();
        checks.finish().await.unwrap();
        assert_eq!(dst, data);
        // Nothing past the body was taken from the socket.
        let mut next = [0u8; 4];
        rx.read_exact(&mut next).await.unwrap();
        assert_eq!(&next, b"next");
        writer.await.unwrap();
    }

    #[tokio::test]
    async fn a_message_mixes_plain_pieces_and_bodies_in_order() {
        let pool = MacPool::new("t", 2);
        let big = Bytes::from(data());
        let (mut a, mut b) = Session::fixed_pair(4);
        let message = [
            Outbound::Plain(Bytes::from_static(b"head")),
            Outbound::Records(vec![Bytes::from_static(b"small body")]),
            Outbound::Plain(Bytes::from_static(b"len")),
            Outbound::Records(vec![big.clone()]),
            Outbound::Records(vec![]),
        ];
        let mut wire = Vec::new();
        write_message(&mut wire, &mut a.send, &pool, &message).await.unwrap();
        assert_eq!(wire.len() as u64, 4 + wire_len(10) + 3 + wire_len(big.len() as u64));
        let mut r = &wire[..];
        let mut head = [0u8; 4];
        r.read_exact(&mut head).await.unwrap();
        let mut small = [0u8; 10];
        let mut checks = RecordChecks::new();
        let mut dsts = [&mut small[..]];
        // SAFETY: the destinations outlive the checks, finished below.
        unsafe { checks.read(&mut r, &mut b.recv, &pool, &mut dsts) }.await.unwrap();
        let mut len = [0u8; 3];
        r.read_exact(&mut len).await.unwrap();
        let mut rest = vec![0u8; big.len()];
        let mut dsts = [&mut rest[..]];
        // SAFETY: as above.
        unsafe { checks.read(&mut r, &mut b.recv, &pool, &mut dsts) }.await.unwrap();
        checks.finish().await.unwrap();
        assert_eq!((&head, &small[..], &len, &rest[..]), (b"head", &b"small body"[..], b"len", big.as_ref()));
    }
}
