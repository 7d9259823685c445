//! AES-256-GMAC (NIST SP 800-38D): AES-GCM with the frame as additional data and nothing
//! encrypted, so a tag is what any GCM library returns for `encrypt(key, nonce, plaintext = "",
//! associated data = the frame)` — a peer in another language uses its standard library.
//!
//! The cost is GHASH, one carry-less multiplication per 16 bytes. Where the CPU multiplies four
//! blocks per instruction (AVX-512 with VPCLMULQDQ), [`wide`] hashes 32 blocks per reduction,
//! several times BLAKE3's speed per core (docs/benchmarks.md); elsewhere the `ghash` crate does
//! (CLMUL or PMULL where present). Both compute the same function, checked against each other and
//! against ring's AES-GCM in the tests.

use aes::Aes256;
use aes::cipher::{BlockCipherEncrypt, KeyInit};
use ghash::universal_hash::UniversalHash;

/// Bytes of a GMAC tag.
pub const GMAC_TAG_LEN: usize = 16;

/// One key's AES-256-GMAC: the expanded AES key and GHASH's key, made once per key.
#[derive(Clone)]
pub struct Gmac {
    aes: Aes256,
    hash: HashKey,
}

#[derive(Clone)]
enum HashKey {
    #[cfg(target_arch = "x86_64")]
    Wide(std::sync::Arc<wide::Powers>),
    Portable(ghash::GHash),
}

impl Gmac {
    /// GMAC under the AES-256 key `key`.
    pub fn new(key: &[u8; 32]) -> Gmac {
        Gmac::with_hash(key, true)
    }

    /// GMAC under `key`, with the wide GHASH where this CPU has it and `wide_allowed`.
    fn with_hash(key: &[u8; 32], wide_allowed: bool) -> Gmac {
        let aes = Aes256::new(key.into());
        let mut h = [0u8; 16].into();
        aes.encrypt_block(&mut h);
        let h: [u8; 16] = h.into();
        #[cfg(target_arch = "x86_64")]
        if wide_allowed && let Some(p) = wide::Powers::new(h) {
            return Gmac { aes, hash: HashKey::Wide(std::sync::Arc::new(p)) };
        }
        let _ = wide_allowed;
        Gmac { aes, hash: HashKey::Portable(ghash::GHash::new(&h.into())) }
    }

    /// The tag of the message `parts` (concatenated) under the 96-bit nonce `nonce`: GCM's tag
    /// for an empty plaintext with the message as associated data. A nonce must never repeat
    /// under one key.
    pub fn tag(&self, nonce: &[u8; 12], parts: &[&[u8]]) -> [u8; GMAC_TAG_LEN] {
        let mut g = Ghash { acc: self.acc(), pending: [0; 16], filled: 0, len: 0 };
        for p in parts {
            g.update(p);
        }
        let mut tag = g.finish();
        let mut j0 = [0u8; 16];
        j0[..12].copy_from_slice(nonce);
        j0[15] = 1;
        let mut mask = j0.into();
        self.aes.encrypt_block(&mut mask);
        let mask: [u8; 16] = mask.into();
        for (t, m) in tag.iter_mut().zip(mask) {
            *t ^= m;
        }
        tag
    }

    /// Whether this key hashes with the wide (AVX-512) GHASH.
    pub fn wide(&self) -> bool {
        match self.hash {
            #[cfg(target_arch = "x86_64")]
            HashKey::Wide(_) => true,
            HashKey::Portable(_) => false,
        }
    }

    fn acc(&self) -> Acc<'_> {
        match &self.hash {
            #[cfg(target_arch = "x86_64")]
            HashKey::Wide(p) => Acc::Wide(p, wide::State::default()),
            HashKey::Portable(g) => Acc::Portable(g.clone()),
        }
    }
}

/// A GHASH under way over whole blocks.
enum Acc<'a> {
    #[cfg(target_arch = "x86_64")]
    Wide(&'a wide::Powers, wide::State),
    Portable(ghash::GHash),
}

impl Acc<'_> {
    /// Hashes `data`, whole 16-byte blocks.
    fn blocks(&mut self, data: &[u8]) {
        debug_assert_eq!(data.len() % 16, 0);
        match self {
            #[cfg(target_arch = "x86_64")]
            Acc::Wide(p, s) => p.blocks(s, data),
            Acc::Portable(g) => g.update_padded(data),
        }
    }

    fn value(self) -> [u8; 16] {
        match self {
            #[cfg(target_arch = "x86_64")]
            Acc::Wide(_, s) => s.ghash(),
            Acc::Portable(g) => g.finalize().into(),
        }
    }
}

/// GHASH over a message given in pieces of any length, then its length block (GCM's, with no
/// ciphertext).
struct Ghash<'a> {
    acc: Acc<'a>,
    pending: [u8; 16],
    filled: usize,
    len: u64,
}

impl Ghash<'_> {
    fn update(&mut self, mut data: &[u8]) {
        self.len += data.len() as u64;
        if self.filled > 0 {
            let n = data.len().min(16 - self.filled);
            self.pending[self.filled..self.filled + n].copy_from_slice(&data[..n]);
            self.filled += n;
            data = &data[n..];
            if self.filled < 16 {
                return;
            }
            self.acc.blocks(&self.pending);
            self.filled = 0;
        }
        let whole = data.len() & !15;
        self.acc.blocks(&data[..whole]);
        let rest = &data[whole..];
        self.pending[..rest.len()].copy_from_slice(rest);
        self.filled = rest.len();
    }

    fn finish(mut self) -> [u8; 16] {
        if self.filled > 0 {
            self.pending[self.filled..].fill(0);
            self.acc.blocks(&self.pending);
        }
        let mut lengths = [0u8; 16];
        lengths[..8].copy_from_slice(&(self.len * 8).to_be_bytes());
        self.acc.blocks(&lengths);
        self.acc.value()
    }
}

/// GHASH with AVX-512 carry-less multiplication, computed as POLYVAL (RFC 8452, appendix A):
/// GHASH(H, X…) = rev(POLYVAL(mulX(rev(H)), rev(X)…)), `rev` reversing a block's bytes. POLYVAL's
/// little-endian order needs no bit reflection; each block's bytes are reversed in registers.
/// 32 blocks are multiplied by the key's powers H³², …, H¹ and summed before one reduction.
#[cfg(target_arch = "x86_64")]
mod wide {
    use std::arch::x86_64::*;

    /// Blocks hashed per reduction.
    const BLOCKS: usize = 32;

    /// The key's powers H³²…H¹ (POLYVAL's, of mulX(rev(H))), four to a register, and H itself.
    pub struct Powers {
        k: [__m512i; BLOCKS / 4],
        h: __m128i,
    }

    // SAFETY: plain values in SIMD registers' layout, never mutated after they are made.
    unsafe impl Send for Powers {}
    unsafe impl Sync for Powers {}

    /// The POLYVAL accumulator.
    #[derive(Clone, Copy)]
    pub struct State(__m128i);

    impl Default for State {
        fn default() -> State {
            // SAFETY: SSE2 is part of x86_64.
            State(unsafe { _mm_setzero_si128() })
        }
    }

    impl State {
        /// GHASH's value: the accumulator's bytes reversed.
        pub fn ghash(self) -> [u8; 16] {
            let mut out = [0u8; 16];
            // SAFETY: SSE2 is part of x86_64; `out` holds 16 bytes.
            unsafe { _mm_storeu_si128(out.as_mut_ptr().cast(), self.0) };
            out.reverse();
            out
        }
    }

    fn supported() -> bool {
        is_x86_feature_detected!("pclmulqdq")
            && is_x86_feature_detected!("ssse3")
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("vpclmulqdq")
    }

    impl Powers {
        /// The powers of GHASH key `h`, where this CPU has the instructions (else None).
        pub fn new(h: [u8; 16]) -> Option<Powers> {
            // SAFETY: the features `powers` needs were just detected.
            supported().then(|| unsafe { powers(mul_x(h)) })
        }

        /// Hashes `data` (whole blocks) into `s`.
        pub fn blocks(&self, s: &mut State, data: &[u8]) {
            // SAFETY: a `Powers` exists only where `supported()` said yes.
            unsafe { blocks(self, s, data) }
        }
    }

    /// mulX_POLYVAL(rev(h)) (RFC 8452): rev(h) as a little-endian number is h big-endian.
    fn mul_x(h: [u8; 16]) -> u128 {
        let v = u128::from_be_bytes(h);
        (v << 1) ^ if v >> 127 == 1 { 0xC200_0000_0000_0000_0000_0000_0000_0001 } else { 0 }
    }

    #[target_feature(enable = "pclmulqdq,avx512f,vpclmulqdq")]
    unsafe fn powers(h: u128) -> Powers {
        // SAFETY: reads 16 bytes from a u128.
        let h = unsafe { _mm_loadu_si128((&h as *const u128).cast()) };
        let mut pw = [_mm_setzero_si128(); BLOCKS + 1];
        pw[1] = h;
        for i in 2..=BLOCKS {
            pw[i] = dot(pw[i - 1], h);
        }
        let mut k = [_mm512_setzero_si512(); BLOCKS / 4];
        for (j, kj) in k.iter_mut().enumerate() {
            // Lane l of register j multiplies block 4j + l of the 32: H^(32 − 4j − l).
            let p = |l: usize| pw[BLOCKS - 4 * j - l];
            let lo = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(p(0)), p(1));
            let hi = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(p(2)), p(3));
            *kj = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
        }
        Powers { k, h }
    }

    /// Montgomery reduction of the 256-bit product hi:lo by x¹²⁸ modulo POLYVAL's polynomial
    /// x¹²⁸ + x¹²⁷ + x¹²⁶ + x¹²¹ + 1, folding 64 bits at a time.
    #[inline]
    #[target_feature(enable = "pclmulqdq")]
    fn reduce(lo: __m128i, hi: __m128i) -> __m128i {
        let c = _mm_set_epi64x(0, 0xC200_0000_0000_0000_u64 as i64);
        let v = _mm_xor_si128(_mm_shuffle_epi32::<0x4e>(lo), _mm_clmulepi64_si128::<0x00>(lo, c));
        _mm_xor_si128(_mm_xor_si128(_mm_shuffle_epi32::<0x4e>(v), _mm_clmulepi64_si128::<0x00>(v, c)), hi)
    }

    /// POLYVAL's product a·b·x⁻¹²⁸.
    #[inline]
    #[target_feature(enable = "pclmulqdq")]
    fn dot(a: __m128i, b: __m128i) -> __m128i {
        let lo = _mm_clmulepi64_si128::<0x00>(a, b);
        let hi = _mm_clmulepi64_si128::<0x11>(a, b);
        let mid = _mm_xor_si128(_mm_clmulepi64_si128::<0x01>(a, b), _mm_clmulepi64_si128::<0x10>(a, b));
        reduce(_mm_xor_si128(lo, _mm_slli_si128::<8>(mid)), _mm_xor_si128(hi, _mm_srli_si128::<8>(mid)))
    }

    /// The XOR of a register's four 128-bit lanes.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn fold(x: __m512i) -> __m128i {
        let y = _mm256_xor_si256(_mm512_castsi512_si256(x), _mm512_extracti64x4_epi64::<1>(x));
        _mm_xor_si128(_mm256_castsi256_si128(y), _mm256_extracti128_si256::<1>(y))
    }

    #[target_feature(enable = "pclmulqdq,ssse3,avx512f,avx512bw,vpclmulqdq")]
    unsafe fn blocks(p: &Powers, s: &mut State, data: &[u8]) {
        let rev = _mm_set_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        let rev4 = _mm512_broadcast_i32x4(rev);
        let mut acc = s.0;
        let mut chunks = data.chunks_exact(BLOCKS * 16);
        for c in &mut chunks {
            let ptr = c.as_ptr().cast::<__m512i>();
            let (mut lo, mut hi, mut mid) = (_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512());
            for (j, &k) in p.k.iter().enumerate() {
                // SAFETY: the chunk holds BLOCKS * 16 bytes, 64 per register.
                let mut d = _mm512_shuffle_epi8(unsafe { _mm512_loadu_si512(ptr.add(j)) }, rev4);
                if j == 0 {
                    d = _mm512_xor_si512(d, _mm512_zextsi128_si512(acc));
                }
                lo = _mm512_xor_si512(lo, _mm512_clmulepi64_epi128::<0x00>(d, k));
                hi = _mm512_xor_si512(hi, _mm512_clmulepi64_epi128::<0x11>(d, k));
                let m =
                    _mm512_xor_si512(_mm512_clmulepi64_epi128::<0x01>(d, k), _mm512_clmulepi64_epi128::<0x10>(d, k));
                mid = _mm512_xor_si512(mid, m);
            }
            let (lo, hi, mid) = (fold(lo), fold(hi), fold(mid));
            acc = reduce(_mm_xor_si128(lo, _mm_slli_si128::<8>(mid)), _mm_xor_si128(hi, _mm_srli_si128::<8>(mid)));
        }
        for b in chunks.remainder().chunks_exact(16) {
            // SAFETY: the block holds 16 bytes.
            let x = _mm_shuffle_epi8(unsafe { _mm_loadu_si128(b.as_ptr().cast()) }, rev);
            acc = dot(_mm_xor_si128(acc, x), p.h);
        }
        s.0 = acc;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey};

    fn ring_tag(key: &[u8; 32], nonce: [u8; 12], msg: &[u8]) -> [u8; 16] {
        let k = LessSafeKey::new(UnboundKey::new(&ring::aead::AES_256_GCM, key).unwrap());
        let t = k.seal_in_place_separate_tag(Nonce::assume_unique_for_key(nonce), Aad::from(msg), &mut []).unwrap();
        t.as_ref().try_into().unwrap()
    }

    fn bytes(n: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    #[test]
    fn tags_are_aes_gcm_tags_of_the_message_as_associated_data() {
        let key: [u8; 32] = bytes(32, 7).try_into().unwrap();
        let g = Gmac::new(&key);
        let msg = bytes(70_000, 9);
        // Lengths around the wide path's 512-byte chunks and the 16-byte blocks.
        for len in [0, 1, 15, 16, 17, 511, 512, 513, 1024, 1040, 16 << 10, 65_537, 70_000] {
            let nonce: [u8; 12] = bytes(12, len as u64 + 1).try_into().unwrap();
            let want = ring_tag(&key, nonce, &msg[..len]);
            assert_eq!(g.tag(&nonce, &[&msg[..len]]), want, "{len} bytes");
            // In pieces that cut blocks anywhere.
            let (a, rest) = msg[..len].split_at(len / 3);
            let (b, c) = rest.split_at(rest.len() / 2);
            assert_eq!(g.tag(&nonce, &[a, &[], b, c]), want, "{len} bytes in pieces");
        }
    }

    #[test]
    fn a_tag_is_what_pythons_cryptography_computes() {
        // AESGCM(bytes(32)).encrypt(bytes(12), b"", b"abc") with Python's `cryptography`.
        let tag = Gmac::new(&[0; 32]).tag(&[0; 12], &[b"abc"]);
        let hex: String = tag.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, "ddb82eac2f698dc1569bb9d6c92147fa");
    }

    #[test]
    fn the_portable_and_the_wide_hash_agree() {
        let key = [3u8; 32];
        let g = Gmac::new(&key);
        let portable = Gmac::with_hash(&key, false);
        assert!(!portable.wide());
        if !g.wide() {
            println!("SKIPPED the wide GHASH's check: this CPU lacks AVX-512 VPCLMULQDQ (the portable one ran)");
        }
        let msg = bytes(300_000, 5);
        for len in [0, 48, 512, 4096 + 80, 300_000] {
            let nonce = [len as u8; 12];
            assert_eq!(g.tag(&nonce, &[&msg[..len]]), portable.tag(&nonce, &[&msg[..len]]), "{len} bytes");
        }
    }

    #[test]
    fn any_changed_bit_nonce_or_key_changes_the_tag() {
        let key = [1u8; 32];
        let g = Gmac::new(&key);
        let msg = bytes(4096, 3);
        let tag = g.tag(&[0; 12], &[&msg]);
        for bit in [0, 7, 8 * 1000 + 3, 8 * 4095 + 7] {
            let mut m = msg.clone();
            m[bit / 8] ^= 1 << (bit % 8);
            assert_ne!(g.tag(&[0; 12], &[&m]), tag, "bit {bit}");
        }
        assert_ne!(g.tag(&[1; 12], &[&msg]), tag);
        assert_ne!(Gmac::new(&[2u8; 32]).tag(&[0; 12], &[&msg]), tag);
        // A message and the same bytes followed by zeros differ (the length block).
        let mut longer = msg.clone();
        longer.extend_from_slice(&[0; 16]);
        assert_ne!(g.tag(&[0; 12], &[&longer]), tag);
    }
}
