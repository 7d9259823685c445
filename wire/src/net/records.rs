//! Bulk bytes as tagged records ([`super::mac`]): a body of known length travels as records of at
//! most [`RECORD_BYTES`], each followed by its [`TAG_LEN`]-byte tag. Records of at least
//! [`OFF_THREAD_BYTES`] are tagged and checked on a [`MacPool`] beside the socket I/O: a writer
//! tags the next records while it writes one, a reader checks a record while the next one
//! arrives. Neither copies the bytes: the writer writes the caller's slices, the reader reads
//! straight into the caller's buffer, and returns only once every record checked out.

use std::collections::VecDeque;
use std::io::{self, IoSlice};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::mac::{BadTag, FrameMac, MacPool, Pending, RECORD_BYTES, Span, TAG_LEN, Tag};

/// Records smaller than this are tagged on the caller's thread: handing them over costs more.
pub const OFF_THREAD_BYTES: usize = 64 << 10;
/// Records a writer tags ahead of the one it writes.
const AHEAD: usize = 4;
/// Records a reader may have read and not yet checked.
const IN_FLIGHT: usize = 8;

/// A record's tag: made already, or being made on a helper thread.
enum Tagging {
    Ready(Tag),
    Running(Pending<Tag>),
}

impl Tagging {
    async fn tag(self) -> io::Result<Tag> {
        match self {
            Tagging::Ready(t) => Ok(t),
            Tagging::Running(p) => p.wait().await.ok_or_else(|| io::Error::other("the tag threads are gone")),
        }
    }
}

/// The records of `parts` (concatenated): each record's spans.
fn cut(parts: &[&[u8]]) -> Vec<Vec<Span>> {
    let mut records = Vec::new();
    let mut current: Vec<Span> = Vec::new();
    let mut room = RECORD_BYTES;
    for part in parts {
        let mut rest: &[u8] = part;
        while !rest.is_empty() {
            let take = rest.len().min(room);
            current.push(Span::of(&rest[..take]));
            rest = &rest[take..];
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

fn span_len(spans: &[Span]) -> usize {
    spans.iter().map(|s| s.len()).sum()
}

/// Writes the concatenation of `parts` as tagged records (its length is the caller's to send).
pub async fn write_records<W: AsyncWrite + Unpin>(
    w: &mut W,
    mac: &mut FrameMac,
    pool: &MacPool,
    parts: &[&[u8]],
) -> io::Result<()> {
    let records = cut(parts);
    let mut tags: VecDeque<Tagging> = VecDeque::new();
    let mut tagged = 0;
    for (r, spans) in records.iter().enumerate() {
        while tagged < records.len().min(r + 1 + AHEAD) {
            let key = mac.next_key();
            let s = records[tagged].clone();
            tags.push_back(if span_len(&s) >= OFF_THREAD_BYTES {
                // SAFETY: the spans lie in `parts`, borrowed for this whole call; every pending job
                // is awaited below or dropped (which waits for it) before the call returns.
                Tagging::Running(pool.spawn(move || unsafe { key.tag_spans(&s) }))
            } else {
                // SAFETY: as above, on this thread.
                Tagging::Ready(unsafe { key.tag_spans(&s) })
            });
            tagged += 1;
        }
        let tag = tags.pop_front().expect("tagged ahead").tag().await?;
        // SAFETY: the spans lie in `parts`, borrowed for this call.
        let mut slices: Vec<IoSlice<'_>> = spans.iter().map(|s| IoSlice::new(unsafe { s.bytes() })).collect();
        slices.push(IoSlice::new(&tag));
        write_all_slices(w, &mut slices).await?;
    }
    Ok(())
}

/// Writes every slice, in order, with vectored writes.
pub async fn write_all_slices<W: AsyncWrite + Unpin>(w: &mut W, mut slices: &mut [IoSlice<'_>]) -> io::Result<()> {
    while !slices.is_empty() {
        let n = w.write_vectored(slices).await?;
        if n == 0 {
            if slices.iter().all(|s| s.is_empty()) {
                return Ok(());
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

/// Reads `dst.len()` bytes written by [`write_records`] straight into `dst`, checking every
/// record's tag; returns once all of them checked out (a failed one is `InvalidData`, naming
/// the frame). On an error `dst` holds bytes that must not be used.
pub async fn read_records<R: AsyncRead + Unpin>(
    r: &mut R,
    mac: &mut FrameMac,
    pool: &MacPool,
    dst: &mut [u8],
) -> io::Result<()> {
    read_records_into(r, mac, pool, &mut [dst]).await
}

/// [`read_records`] into several buffers, filled in order as if they were one.
pub async fn read_records_into<R: AsyncRead + Unpin>(
    r: &mut R,
    mac: &mut FrameMac,
    pool: &MacPool,
    dsts: &mut [&mut [u8]],
) -> io::Result<()> {
    // Addresses rather than pointers, so that the future stays `Send`.
    let parts: Vec<(usize, usize)> = dsts.iter_mut().map(|d| (d.as_mut_ptr() as usize, d.len())).collect();
    let total: usize = parts.iter().map(|p| p.1).sum();
    let mut checks: VecDeque<Checking> = VecDeque::new();
    let (mut part, mut offset, mut done) = (0, 0, 0);
    while done < total {
        let n = RECORD_BYTES.min(total - done);
        let mut spans = Vec::new();
        let mut left = n;
        while left > 0 {
            let (base, len) = parts[part];
            let take = (len - offset).min(left);
            // SAFETY: [offset, offset + take) lies inside one of `dsts`, borrowed mutably for this
            // call, and no other reference to it exists: earlier records are only read, by their
            // checks.
            let piece = unsafe { std::slice::from_raw_parts_mut((base + offset) as *mut u8, take) };
            r.read_exact(piece).await?;
            spans.push(Span::of(piece));
            (offset, left) = (offset + take, left - take);
            if offset == len {
                (part, offset) = (part + 1, 0);
            }
        }
        while part < parts.len() && parts[part].1 == 0 {
            part += 1;
        }
        let mut tag = [0u8; TAG_LEN];
        r.read_exact(&mut tag).await?;
        let key = mac.next_key();
        checks.push_back(if n >= OFF_THREAD_BYTES {
            // SAFETY: the record is not written again during this call, and every pending check is
            // awaited below or dropped (which waits for it) before the call returns.
            Checking::Running(pool.spawn(move || unsafe { key.check_spans(&spans, &tag) }))
        } else {
            // SAFETY: as above, on this thread.
            Checking::Done(unsafe { key.check_spans(&spans, &tag) })
        });
        while checks.len() > IN_FLIGHT {
            checks.pop_front().expect("in flight").verdict().await?;
        }
        done += n;
    }
    while let Some(c) = checks.pop_front() {
        c.verdict().await?;
    }
    Ok(())
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

    #[tokio::test]
    async fn records_round_trip_and_any_altered_byte_fails_its_record() {
        let pool = MacPool::new("t", 2);
        let data: Vec<u8> = (0..(RECORD_BYTES * 3 + 1000)).map(|i| (i * 7) as u8).collect();
        let parts: [&[u8]; 3] = [&data[..10], &data[10..RECORD_BYTES + 5], &data[RECORD_BYTES + 5..]];
        for flip in [None, Some(3), Some(RECORD_BYTES * 2 + 17), Some(data.len() + 3 * TAG_LEN + 5)] {
            let (mut a, mut b) = Session::fixed_pair(9);
            let mut wire = Vec::new();
            write_records(&mut wire, &mut a.send, &pool, &parts).await.unwrap();
            assert_eq!(wire.len() as u64, wire_len(data.len() as u64));
            if let Some(at) = flip {
                wire[at] ^= 0x40;
            }
            let mut dst = vec![0u8; data.len()];
            let got = read_records(&mut &wire[..], &mut b.recv, &pool, &mut dst).await;
            match flip {
                None => {
                    got.unwrap();
                    assert_eq!(dst, data);
                }
                Some(_) => {
                    let e = got.unwrap_err();
                    assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
                }
            }
        }
        // Into several buffers, split anywhere.
        let (mut a, mut b) = Session::fixed_pair(9);
        let mut wire = Vec::new();
        write_records(&mut wire, &mut a.send, &pool, &parts).await.unwrap();
        let mut dst = vec![0u8; data.len()];
        let (x, rest) = dst.split_at_mut(7);
        let (y, z) = rest.split_at_mut(RECORD_BYTES * 2);
        read_records_into(&mut &wire[..], &mut b.recv, &pool, &mut [x, &mut [], y, z]).await.unwrap();
        assert_eq!(dst, data);
        // Records in the wrong order fail too.
        let (mut a, mut b) = Session::fixed_pair(9);
        let mut wire = Vec::new();
        write_records(&mut wire, &mut a.send, &pool, &[&data]).await.unwrap();
        let r = RECORD_BYTES + TAG_LEN;
        let (first, second) = wire.split_at_mut(r);
        first.swap_with_slice(&mut second[..r]);
        let mut dst = vec![0u8; data.len()];
        assert!(read_records(&mut &wire[..], &mut b.recv, &pool, &mut dst).await.is_err());
    }
}
