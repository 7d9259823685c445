//! Bulk bytes as tagged records ([`super::mac`]): a body of known length travels as records of at
//! most [`RECORD_BYTES`], each followed by its [`TAG_LEN`]-byte tag. Records of at least
//! [`OFF_THREAD_BYTES`] are tagged and checked on a [`MacPool`] beside the socket I/O: a writer
//! has the next records tagged while it writes one, a reader checks records while the next ones
//! arrive. Neither copies the bytes.
//!
//! Soundness: helper threads never read memory that a caller could free while they run. A
//! writer's parts are [`Bytes`] (shared and immutable: each job holds its own references), and a
//! reader's destination is memory the caller promises to keep until the checks are finished or
//! dropped, even if the future reading it is leaked ([`RecordChecks::read`] is `unsafe` for that
//! reason; memory owned by the same future that owns the checks keeps the promise by itself).

use std::collections::VecDeque;
use std::io::{self, IoSlice};

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::mac::{BadTag, FrameKey, FrameMac, MacPool, Pending, RECORD_BYTES, Span, TAG_LEN, Tag};

/// Records smaller than this are tagged and checked on the caller's thread: handing them over
/// costs more.
pub const OFF_THREAD_BYTES: usize = 64 << 10;
/// Records a reader may have read and not yet checked.
const IN_FLIGHT: usize = 8;
/// Large records a writer has tagged, or has being tagged, ahead of the one it writes.
const AHEAD: usize = 4;
/// Slices per vectored write (the kernel's IOV_MAX is 1024).
const MAX_IOV: usize = 512;

/// One piece of an outgoing message, in order.
#[derive(Clone, Debug)]
pub enum Outbound {
    /// Bytes sent as they are: a length, or a frame already tagged.
    Plain(Bytes),
    /// A body (its parts concatenated) sent as tagged records.
    Records(Vec<Bytes>),
}

/// The records of `parts` (concatenated): each record's slices.
fn cut(parts: &[Bytes]) -> Vec<Vec<Bytes>> {
    let mut records = Vec::new();
    let mut current: Vec<Bytes> = Vec::new();
    let mut room = RECORD_BYTES;
    for part in parts {
        let mut at = 0;
        while at < part.len() {
            let take = (part.len() - at).min(room);
            current.push(part.slice(at..at + take));
            at += take;
            room -= take;
            if room == 0 {
                records.push(std::mem::take(&mut current));
                room = RECORD_BYTES;
            }
        }
    }
    if !current.is_empty() {
        records.push(current);
    }
    records
}

/// Writes a message: its plain pieces as they are and its bodies as tagged records, tagged with
/// `mac` in order. Large records are tagged on `pool` up to [`AHEAD`] records ahead of the one
/// being written (a bounded window, so that the messages of other connections sharing the pool
/// are not queued behind all of this one's); small pieces and records are gathered into the
/// vectored write of the next large record (or the last write), so a small message is one system
/// call.
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
    let large = |(slices, key): &(Vec<Bytes>, Option<FrameKey>)| {
        key.is_some() && slices.iter().map(Bytes::len).sum::<usize>() >= OFF_THREAD_BYTES
    };
    let mut running: VecDeque<Pending<Tag>> = VecDeque::new();
    let mut started = 0;
    let mut out: Vec<Bytes> = Vec::new();
    let mut pending_bytes = 0;
    for i in 0..pieces.len() {
        // Keep the next AHEAD large records' tags under way.
        while started < pieces.len() && running.len() < AHEAD {
            if large(&pieces[started]) {
                let (record, key) = (pieces[started].0.clone(), pieces[started].1.clone().expect("a record"));
                running.push_back(pool.spawn(move || {
                    let parts: Vec<&[u8]> = record.iter().map(|b| b.as_ref()).collect();
                    key.tag(&parts)
                }));
            }
            started += 1;
        }
        let is_large = large(&pieces[i]);
        let (slices, key) = std::mem::take(&mut pieces[i]);
        pending_bytes += slices.iter().map(Bytes::len).sum::<usize>();
        let tag = match key {
            None => None,
            Some(_) if is_large => {
                let p = running.pop_front().expect("a large record's tag was started");
                Some(p.wait().await.ok_or_else(|| io::Error::other("the tag threads are gone"))?)
            }
            Some(key) => Some(key.tag(&slices.iter().map(|b| b.as_ref()).collect::<Vec<_>>())),
        };
        out.extend(slices);
        if let Some(t) = tag {
            out.push(Bytes::copy_from_slice(&t));
        }
        if is_large || out.len() >= MAX_IOV || pending_bytes >= RECORD_BYTES {
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
    /// # Safety
    /// Helper threads read the destinations until these checks are finished or dropped: the
    /// memory must stay allocated and nothing else may write it until then, even if the future
    /// of this call (or of its caller) is leaked. Memory owned by the future that owns these
    /// checks is safe; memory borrowed from outside it is not, unless it outlives any leak.
    pub async unsafe fn read<R: AsyncRead + Unpin>(
        &mut self,
        r: &mut R,
        mac: &mut FrameMac,
        pool: &MacPool,
        dsts: &mut [&mut [u8]],
    ) -> io::Result<()> {
        // Addresses rather than pointers, so that the future stays `Send`.
        let parts: Vec<(usize, usize)> = dsts.iter_mut().map(|d| (d.as_mut_ptr() as usize, d.len())).collect();
        let total: usize = parts.iter().map(|p| p.1).sum();
        let (mut part, mut offset, mut done) = (0, 0, 0);
        while done < total {
            let n = RECORD_BYTES.min(total - done);
            let mut spans = Vec::new();
            let mut left = n;
            while left > 0 {
                let (base, len) = parts[part];
                let take = (len - offset).min(left);
                if take > 0 {
                    // SAFETY: [offset, offset + take) lies inside one of `dsts`, borrowed mutably
                    // for this call; no other reference to it exists (earlier records are only
                    // read, by their checks).
                    let piece = unsafe { std::slice::from_raw_parts_mut((base + offset) as *mut u8, take) };
                    r.read_exact(piece).await?;
                    spans.push(Span::of(piece));
                }
                (offset, left) = (offset + take, left - take);
                if offset == len {
                    (part, offset) = (part + 1, 0);
                }
            }
            let mut tag = [0u8; TAG_LEN];
            r.read_exact(&mut tag).await?;
            let key = mac.next_key();
            self.pending.push_back(if n >= OFF_THREAD_BYTES {
                // SAFETY: the record is not written again; the caller keeps it allocated until
                // these checks are finished or dropped (which waits for running ones).
                Checking::Running(pool.spawn(move || unsafe { key.check_spans(&spans, &tag) }))
            } else {
                // SAFETY: as above, on this thread.
                Checking::Done(unsafe { key.check_spans(&spans, &tag) })
            });
            while self.pending.len() > IN_FLIGHT {
                self.pending.pop_front().expect("in flight").verdict().await?;
            }
            done += n;
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
pub async unsafe fn read_records<R: AsyncRead + Unpin>(
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
    let mut left = len;
    while left > 0 {
        let n = (RECORD_BYTES as u64).min(left) as usize;
        r.read_exact(&mut buf[..n]).await?;
        let mut tag = [0u8; TAG_LEN];
        r.read_exact(&mut tag).await?;
        mac.check(&[&buf[..n]], &tag)?;
        left -= n as u64;
    }
    Ok(())
}

/// Bytes on the wire for a body of `len` bytes: the bytes and one tag per record.
pub fn wire_len(len: u64) -> u64 {
    len + len.div_ceil(RECORD_BYTES as u64) * TAG_LEN as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::mac::Session;

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
        // Records in the wrong order fail too.
        let (mut a, mut b) = Session::fixed_pair(9);
        let mut wire = Vec::new();
        write_records(&mut wire, &mut a.send, &pool, std::slice::from_ref(&all)).await.unwrap();
        let r = RECORD_BYTES + TAG_LEN;
        let (first, second) = wire.split_at_mut(r);
        first.swap_with_slice(&mut second[..r]);
        let mut dst = vec![0u8; data.len()];
        assert!(read_all(&wire, &mut b.recv, &pool, &mut [&mut dst]).await.is_err());
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
