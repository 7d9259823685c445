//! Length-prefixed frames: a little-endian `u32` length, then that many bytes; after a
//! handshake, then the frame's tag ([`super::mac`]).

use std::io;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::mac::{FrameMac, TAG_LEN};

/// Largest control frame accepted; bulk payloads are streamed, never framed whole.
pub const MAX_FRAME: u32 = 64 << 20;

/// Frames up to this size go out in one write (one segment with TCP_NODELAY, so one wake-up of
/// the reader) rather than length and bytes separately.
const SMALL_FRAME: usize = 64 << 10;

/// Writes one frame: a little-endian u32 length, then the bytes.
pub async fn write_frame<W: AsyncWriteExt + Unpin>(w: &mut W, payload: &[u8]) -> io::Result<()> {
    let len =
        u32::try_from(payload.len()).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "frame too large"))?;
    if payload.len() <= SMALL_FRAME {
        let mut buf = Vec::with_capacity(4 + payload.len());
        buf.extend_from_slice(&len.to_le_bytes());
        buf.extend_from_slice(payload);
        return w.write_all(&buf).await;
    }
    w.write_all(&len.to_le_bytes()).await?;
    w.write_all(payload).await
}

/// Reads one frame into `buf` (reusing its allocation), refusing frames over `max` bytes.
pub async fn read_frame<R: AsyncReadExt + Unpin>(r: &mut R, buf: &mut Vec<u8>, max: u32) -> io::Result<()> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len).await?;
    let len = u32::from_le_bytes(len);
    if len > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame of {len} bytes exceeds the limit of {max}"),
        ));
    }
    buf.clear();
    buf.resize(len as usize, 0);
    r.read_exact(buf).await?;
    Ok(())
}

/// Writes one frame and its tag: a little-endian u32 length, the bytes, then [`TAG_LEN`] bytes of
/// tag from `mac` (the length counts the bytes only).
pub async fn write_tagged_frame<W: AsyncWriteExt + Unpin>(
    w: &mut W,
    mac: &mut FrameMac,
    payload: &[u8],
) -> io::Result<()> {
    let len =
        u32::try_from(payload.len()).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "frame too large"))?;
    let tag = mac.tag(&[payload]);
    let mut buf = Vec::with_capacity(4 + payload.len() + TAG_LEN);
    buf.extend_from_slice(&len.to_le_bytes());
    buf.extend_from_slice(payload);
    buf.extend_from_slice(&tag);
    w.write_all(&buf).await
}

/// Writes `msg`, of a length both sides know, and its tag with `mac`, in one write.
pub async fn write_tagged<W: AsyncWriteExt + Unpin>(w: &mut W, mac: &mut FrameMac, msg: &[u8]) -> io::Result<()> {
    let mut buf = Vec::with_capacity(msg.len() + TAG_LEN);
    buf.extend_from_slice(msg);
    buf.extend_from_slice(&mac.tag(&[msg]));
    w.write_all(&buf).await
}

/// Reads a message written by [`write_tagged`] into `msg` (its whole length) and checks its tag
/// with `mac` ([`super::BadTag`], as `InvalidData`).
pub async fn read_tagged<R: AsyncReadExt + Unpin>(r: &mut R, mac: &mut FrameMac, msg: &mut [u8]) -> io::Result<()> {
    let mut buf = vec![0u8; msg.len() + TAG_LEN];
    r.read_exact(&mut buf).await?;
    let (body, tag) = buf.split_at(msg.len());
    mac.check(&[body], tag)?;
    msg.copy_from_slice(body);
    Ok(())
}

/// Reads one frame written by [`write_tagged_frame`] into `buf`, refusing frames over `max` bytes
/// and frames whose tag `mac` does not accept ([`super::BadTag`], as `InvalidData`).
pub async fn read_tagged_frame<R: AsyncReadExt + Unpin>(
    r: &mut R,
    mac: &mut FrameMac,
    buf: &mut Vec<u8>,
    max: u32,
) -> io::Result<()> {
    read_frame(r, buf, max).await?;
    let mut tag = [0u8; TAG_LEN];
    r.read_exact(&mut tag).await?;
    mac.check(&[buf], &tag)?;
    Ok(())
}
