//! Length-prefixed frames: a little-endian `u32` length, then that many bytes.

use std::io;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

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
