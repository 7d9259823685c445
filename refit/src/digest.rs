//! Synthetic weight content and the digests that check refit end to end.
//!
//! The synthetic trainer's weights are a pure function of (step seed, tensor, byte offset in the
//! full tensor), so every shard can be produced independently and a receiver's bytes can be
//! checked without any rank holding the whole model.
//!
//! Digests are computed per refit-plan segment over the segment's bytes in their logical order
//! (row after row), so a sender (reading its contiguous shard) and a receiver (reading the full
//! tensor, possibly strided) get the same value for the same bytes. A segment's digest is a sum
//! over its 8-byte words of a mix of word and word index — order-sensitive, cheap on a CPU, and
//! just as easy as a parallel reduction on a GPU. Segment digests are combined by wrapping
//! addition after mixing in the segment's index, so the total does not depend on the order in
//! which segments arrive.

/// splitmix64's finalizer: a strong, cheap 64-bit mix.
#[inline]
pub const fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

/// Seed of a tensor's content at a step: mixes the step seed and the tensor index.
pub fn tensor_seed(step_seed: u64, tensor: u32) -> u64 {
    mix64(step_seed ^ mix64(tensor as u64 ^ 0x7465_6e73_6f72_0000))
}

/// The word at full-tensor word index `j` (covering bytes `8j..8j+8`).
#[inline]
fn content_word(seed: u64, j: u64) -> u64 {
    mix64(seed.wrapping_add(j.wrapping_mul(GOLDEN)))
}

/// Fills `dst` with the synthetic content of the full tensor's bytes starting at `full_offset`.
pub fn fill(dst: &mut [u8], seed: u64, full_offset: u64) {
    let mut pos = full_offset;
    let mut out = dst;
    // Head: up to the next 8-byte boundary of the full tensor.
    let head = ((8 - (pos % 8)) % 8).min(out.len() as u64) as usize;
    if head > 0 {
        let w = content_word(seed, pos / 8).to_le_bytes();
        let start = (pos % 8) as usize;
        out[..head].copy_from_slice(&w[start..start + head]);
        pos += head as u64;
        out = &mut out[head..];
    }
    let mut chunks = out.chunks_exact_mut(8);
    let mut j = pos / 8;
    for c in &mut chunks {
        c.copy_from_slice(&content_word(seed, j).to_le_bytes());
        j += 1;
    }
    let tail = chunks.into_remainder();
    if !tail.is_empty() {
        let w = content_word(seed, j).to_le_bytes();
        let n = tail.len();
        tail.copy_from_slice(&w[..n]);
    }
}

/// Incremental digest of a logical byte sequence fed in pieces (e.g. the rows of a strided
/// segment). Feeding the same bytes in any split gives the same value.
#[derive(Clone, Debug, Default)]
pub struct Digest {
    sum: u64,
    word_index: u64,
    pending: [u8; 8],
    pending_len: usize,
}

impl Digest {
    /// An empty digest.
    pub fn new() -> Self {
        Self::default()
    }

    #[inline]
    fn word(&mut self, w: u64) {
        self.sum = self.sum.wrapping_add(mix64(w ^ self.word_index.wrapping_mul(GOLDEN)));
        self.word_index += 1;
    }

    /// Feeds the next bytes of the sequence.
    pub fn update(&mut self, mut bytes: &[u8]) {
        if self.pending_len > 0 {
            let take = (8 - self.pending_len).min(bytes.len());
            self.pending[self.pending_len..self.pending_len + take].copy_from_slice(&bytes[..take]);
            self.pending_len += take;
            bytes = &bytes[take..];
            if self.pending_len < 8 {
                return;
            }
            let w = u64::from_le_bytes(self.pending);
            self.word(w);
            self.pending_len = 0;
        }
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            self.word(u64::from_le_bytes(c.try_into().expect("8 bytes")));
        }
        let rest = chunks.remainder();
        self.pending[..rest.len()].copy_from_slice(rest);
        self.pending_len = rest.len();
    }

    /// The digest, with a final partial word zero-padded and the length mixed in.
    pub fn finish(self) -> u64 {
        let len = self.word_index * 8 + self.pending_len as u64;
        mix64(self.padded_sum() ^ len.wrapping_mul(GOLDEN))
    }

    /// The word sum, a final partial word zero-padded (before the length is mixed in).
    fn padded_sum(mut self) -> u64 {
        if self.pending_len > 0 {
            self.pending[self.pending_len..].fill(0);
            let w = u64::from_le_bytes(self.pending);
            self.word(w);
        }
        self.sum
    }
}

/// Digest of a contiguous byte sequence.
pub fn digest_bytes(bytes: &[u8]) -> u64 {
    let mut d = Digest::new();
    d.update(bytes);
    d.finish()
}

/// Digest of `rows` rows of `width` bytes starting at `offset` in `base`, `pitch` bytes apart.
pub fn digest_strided(base: &[u8], offset: u64, rows: u64, width: u64, pitch: u64) -> u64 {
    digest_region(base, offset, rows, width, pitch, Sampling::FULL)
}

/// Bytes per verification block: the unit a sampled check draws, and the work item of the GPU's
/// digest kernel (`rlp_digest_segments`, which must use the same figure).
pub const VERIFY_BLOCK: u64 = 4096;

/// A sampled check reads one block in `SAMPLE_MASK + 1` (besides each region's first and last).
pub const SAMPLE_MASK: u64 = 15;

/// Which 4 KiB blocks of a region a digest reads: all, or a sample drawn from a salt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sampling {
    mask: u64,
    salt: u64,
}

impl Sampling {
    /// Every block.
    pub const FULL: Sampling = Sampling { mask: 0, salt: 0 };

    /// The sample of region `region` (e.g. a refit segment's identity) for weight version
    /// `version`: its first and last block and about one in `SAMPLE_MASK + 1` of the others,
    /// drawn afresh for every version.
    pub fn sampled(version: u64, region: u64) -> Sampling {
        Sampling { mask: SAMPLE_MASK, salt: mix64(mix64(version ^ 0x7665_7269_6679) ^ region.wrapping_mul(GOLDEN)) }
    }

    /// 0 for every block; otherwise a block is drawn when its hash has these bits clear.
    pub fn mask(&self) -> u64 {
        self.mask
    }

    /// The salt the blocks' hashes start from.
    pub fn salt(&self) -> u64 {
        self.salt
    }

    /// Whether block `block` of a region whose last block is `last` is read.
    #[inline]
    pub fn selected(&self, block: u64, last: u64) -> bool {
        self.mask == 0 || block == 0 || block == last || mix64(self.salt ^ block.wrapping_mul(GOLDEN)) & self.mask == 0
    }
}

/// Digest of the blocks `sampling` selects of the region of `rows` rows of `width` bytes at
/// `offset` in `base`, `pitch` bytes apart, read row after row: the sum over the words `k` of the
/// selected [`VERIFY_BLOCK`]-byte blocks of `mix64(word ^ k·GOLDEN)`, finished with the region's
/// length. With [`Sampling::FULL`] it is [`digest_bytes`] of the gathered rows.
pub fn digest_region(base: &[u8], offset: u64, rows: u64, width: u64, pitch: u64, sampling: Sampling) -> u64 {
    let len = rows * width;
    let blocks = len.div_ceil(VERIFY_BLOCK);
    let mut sum = 0u64;
    for b in 0..blocks {
        if !sampling.selected(b, blocks - 1) {
            continue;
        }
        // The block's logical bytes [lo, hi), as pieces of rows.
        let (lo, hi) = (b * VERIFY_BLOCK, ((b + 1) * VERIFY_BLOCK).min(len));
        let mut d = Digest { word_index: lo / 8, ..Digest::default() };
        let mut at = lo;
        while at < hi {
            let (row, col) = (at / width, at % width);
            let n = (width - col).min(hi - at);
            let start = (offset + row * pitch + col) as usize;
            d.update(&base[start..start + n as usize]);
            at += n;
        }
        sum = sum.wrapping_add(d.padded_sum());
    }
    mix64(sum ^ len.wrapping_mul(GOLDEN))
}

/// A segment's contribution to a total: its digest mixed with its identity, so that the same
/// bytes in the wrong place do not cancel out.
pub fn segment_term(segment_id: u64, digest: u64) -> u64 {
    mix64(digest ^ mix64(segment_id.wrapping_mul(GOLDEN) ^ 0x5345_474d))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn full(seed: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        fill(&mut v, seed, 0);
        v
    }

    proptest! {
        #[test]
        fn fill_of_any_window_matches_the_full_tensor(len in 1usize..300, a in 0usize..300, b in 0usize..300, seed: u64) {
            let whole = full(seed, len);
            let (lo, hi) = (a.min(b) % len, (a.max(b) % len).max(a.min(b) % len));
            let mut part = vec![0u8; hi - lo];
            fill(&mut part, seed, lo as u64);
            prop_assert_eq!(&part[..], &whole[lo..hi]);
        }

        #[test]
        fn digest_is_independent_of_how_the_bytes_are_fed(bytes in proptest::collection::vec(any::<u8>(), 0..200), cuts in proptest::collection::vec(0usize..200, 0..6)) {
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(bytes.len())).collect();
            cuts.sort();
            let mut d = Digest::new();
            let mut prev = 0;
            for c in cuts.into_iter().chain([bytes.len()]) {
                d.update(&bytes[prev..c]);
                prev = c;
            }
            prop_assert_eq!(d.finish(), digest_bytes(&bytes));
        }

        #[test]
        fn digest_sees_any_single_byte_change(bytes in proptest::collection::vec(any::<u8>(), 1..200), i in 0usize..200, flip in 1u8..=255) {
            let i = i % bytes.len();
            let mut other = bytes.clone();
            other[i] ^= flip;
            prop_assert_ne!(digest_bytes(&bytes), digest_bytes(&other));
        }
    }

    #[test]
    fn digest_sees_swapped_words_and_length() {
        let a: Vec<u8> = (0..16).collect();
        let mut b = a.clone();
        b[..8].copy_from_slice(&a[8..]);
        b[8..].copy_from_slice(&a[..8]);
        assert_ne!(digest_bytes(&a), digest_bytes(&b));
        assert_ne!(digest_bytes(&[0, 0]), digest_bytes(&[0, 0, 0]));
    }

    #[test]
    fn strided_digest_equals_the_digest_of_the_gathered_rows() {
        let base = full(3, 10 * 12);
        let gathered: Vec<u8> = (0..10).flat_map(|r| base[r * 12 + 4..r * 12 + 9].to_vec()).collect();
        assert_eq!(digest_strided(&base, 4, 10, 5, 12), digest_bytes(&gathered));
    }

    proptest! {
        #[test]
        fn a_full_region_digest_is_the_digest_of_the_gathered_rows(rows in 1u64..40, width in 1u64..700, extra in 0u64..50, offset in 0u64..20, seed: u64) {
            let pitch = width + extra;
            let base = full(seed, (offset + rows * pitch) as usize);
            let gathered: Vec<u8> = (0..rows).flat_map(|r| {
                let s = (offset + r * pitch) as usize;
                base[s..s + width as usize].to_vec()
            }).collect();
            prop_assert_eq!(digest_region(&base, offset, rows, width, pitch, Sampling::FULL), digest_bytes(&gathered));
        }

        #[test]
        fn a_sample_sees_changes_in_drawn_blocks_only(len in 1u64..200_000, at in 0u64..200_000, version: u64, flip in 1u8..=255) {
            let at = at % len;
            let base = full(version, len as usize);
            let mut other = base.clone();
            other[at as usize] ^= flip;
            let s = Sampling::sampled(version, 7);
            let last = len.div_ceil(VERIFY_BLOCK) - 1;
            let drawn = s.selected(at / VERIFY_BLOCK, last);
            let differs = digest_region(&base, 0, 1, len, len, s) != digest_region(&other, 0, 1, len, len, s);
            prop_assert_eq!(differs, drawn);
        }
    }

    #[test]
    fn a_sample_draws_about_one_block_in_sixteen_and_always_the_ends() {
        let blocks = 100_000u64;
        for version in [1u64, 2, 3] {
            let s = Sampling::sampled(version, 42);
            let drawn = (0..blocks).filter(|&b| s.selected(b, blocks - 1)).count() as f64;
            let share = drawn / blocks as f64;
            assert!((share - 1.0 / 16.0).abs() < 0.005, "version {version}: {share}");
            assert!(s.selected(0, blocks - 1) && s.selected(blocks - 1, blocks - 1));
        }
        // Another version draws other blocks.
        let (a, b) = (Sampling::sampled(1, 42), Sampling::sampled(2, 42));
        let same = (0..blocks).filter(|&k| a.selected(k, blocks - 1) && b.selected(k, blocks - 1)).count();
        assert!(same < (blocks / 100) as usize, "{same} blocks drawn by both versions");
    }

    #[test]
    fn segment_terms_differ_by_position() {
        assert_ne!(segment_term(0, 42), segment_term(1, 42));
    }
}
