// rlplane's device kernels. The build needs no CUDA toolkit: this file is compiled to PTX once
// (`refit/src/gpu/build-ptx`, clang's NVPTX back end, no CUDA headers) and the PTX is committed
// as kernels.ptx; the driver JIT-compiles it for the GPU at hand (cuModuleLoadData). CI checks
// that kernels.ptx is what this file compiles to.
//
// rlp_fill2d:          the synthetic weight content (crate::digest::fill) written into a 2-D region.
// rlp_digest_segments: the refit check (crate::digest::digest_region) of many 2-D regions in one
//                      launch, every 4 KiB block or a sample of them.
// rlp_read_words:      a plain read of a buffer (a sum of its words): the memory-read ceiling the
//                      digest's speed is compared with in `rlplane bench refit`.
// rlp_copy_spans:      many device-to-device copies in one launch (a colocated refit's bucket):
//                      one launch instead of one driver call and one small kernel per tensor.
//
// mix64 is splitmix64's finalizer; GOLDEN = 0x9E3779B97F4A7C15.

#ifdef RLP_HOST_EMULATION
#include "emulation.h"
#endif

typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned char u8;

#define KERNEL extern "C" __attribute__((global))
#define DEVICE static __attribute__((device)) __attribute__((always_inline)) inline

#define GOLDEN 0x9E3779B97F4A7C15ull
// Bytes per verification block, and its words (crate::digest::VERIFY_BLOCK).
#define BLOCK_BYTES 4096ull
#define BLOCK_WORDS 512ull
#define THREADS 256u
// Loads from global memory (ld.global) rather than generic addresses.
#define GLOBAL __attribute__((address_space(1)))

DEVICE u64 mix64(u64 z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

DEVICE u32 tid() { return __nvvm_read_ptx_sreg_tid_x(); }
DEVICE u32 ctaid_x() { return __nvvm_read_ptx_sreg_ctaid_x(); }
DEVICE u32 nctaid_x() { return __nvvm_read_ptx_sreg_nctaid_x(); }
DEVICE u32 ctaid_y() { return __nvvm_read_ptx_sreg_ctaid_y(); }
DEVICE u32 nctaid_y() { return __nvvm_read_ptx_sreg_nctaid_y(); }

// dst[r * dst_pitch + c] = byte (p mod 8) of mix64(seed + (p / 8) * GOLDEN), little-endian,
// where p = full_offset + r * full_pitch + c. Grid: x strides over a row's columns, y over rows.
KERNEL void rlp_fill2d(u8 *dst, u64 rows, u64 width, u64 dst_pitch, u64 seed, u64 full_offset, u64 full_pitch) {
  u64 first_col = (u64)ctaid_x() * THREADS + tid();
  u64 col_stride = (u64)nctaid_x() * THREADS;
  for (u64 r = ctaid_y(); r < rows; r += nctaid_y()) {
    for (u64 c = first_col; c < width; c += col_stride) {
      u64 p = full_offset + r * full_pitch + c;
      u64 w = mix64(seed + (p >> 3) * GOLDEN);
      dst[r * dst_pitch + c] = (u8)(w>> ((p & 7) * 8));
    }
  }
}

// One region to digest: `rows` rows of `width` bytes, `pitch` bytes apart from `base`, read row
// after row as one logical byte sequence. `mask` and `salt` pick the blocks read (mask 0: all);
// `first_block` is the index of its first block among all regions' blocks (regions in order,
// blocks contiguous). The layout of the table crate::gpu::Gpu::digest_regions writes.
struct Region {
  u64 base;
  u64 rows;
  u64 width;
  u64 pitch;
  u64 mask;
  u64 salt;
  u64 first_block;
};

// Whether block `b` of a region (its last block `last`) is checked: every block when mask is 0;
// otherwise the first and the last, and those whose hash has the mask's bits clear (one in
// mask + 1 on average). crate::digest::Sampling::selected.
DEVICE bool selected(u64 salt, u64 b, u64 last, u64 mask) {
  return mask == 0 || b == 0 || b == last || (mix64(salt ^ (b * GOLDEN)) & mask) == 0;
}

// Which of the n (<= 32) blocks first, first + 1, ... of a region are read, as a bit mask: each
// lane of a warp draws one block and a ballot shares the result, so a sampled check hashes each
// block once per warp instead of once per thread (the same mask in every warp of the block).
DEVICE u32 drawn(const Region &g, u64 first, u32 n, u64 last) {
  if (g.mask == 0) return n == 32 ? 0xffffffffu : (1u << n) - 1;
#ifdef RLP_HOST_EMULATION
  u32 bits = 0;
  for (u32 l = 0; l < n; l++) bits |= (u32)selected(g.salt, first + l, last, g.mask) << l;
  return bits;
#else
  u32 lane = tid() & 31;
  bool sel = lane < n && selected(g.salt, first + lane, last, g.mask);
  return __nvvm_vote_ballot_sync(0xffffffffu, sel);
#endif
}

// The little-endian word at logical word index k of a region (zero-padded past its end).
DEVICE u64 load_word(const Region &g, u64 len, u64 k) {
  u64 b = k * 8;
  bool contiguous = g.rows == 1 || g.pitch == g.width;
  if (b + 8 <= len && (g.base & 7) == 0) {
    if (contiguous) return *(const GLOBAL u64 *)(g.base + b);
    if ((g.width & 7) == 0 && (g.pitch & 7) == 0) {
      u64 row = b / g.width;
      return *(const GLOBAL u64 *)(g.base + row * g.pitch + (b - row * g.width));
    }
  }
  // Unaligned, a row boundary inside the word, or the partial last word: byte by byte.
  u64 w = 0;
  for (u32 j = 0; j < 8; j++) {
    u64 x = b + j;
    if (x >= len) break;
    u64 row = contiguous ? 0 : x / g.width;
    u64 at = contiguous ? x : row * g.pitch + (x - row * g.width);
    w |= (u64)(*(const GLOBAL u8 *)(g.base + at)) << (8 * j);
  }
  return w;
}

// Adds a thread's partial sum of region `s` into out[s]: a warp reduction, then one atomic per
// warp (every thread of the block calls it together: the loop's control flow is uniform).
DEVICE void flush(u64 acc, u64 *out, u32 s) {
#ifdef RLP_HOST_EMULATION
  // Threads run one after another on the host (tests of this file's logic): no warps.
  out[s] += acc;
#else
  for (u32 d = 16; d > 0; d >>= 1) {
    u32 lo = __nvvm_shfl_sync_bfly_i32(0xffffffffu, (u32)acc, d, 0x1f);
    u32 hi = __nvvm_shfl_sync_bfly_i32(0xffffffffu, (u32)(acc >> 32), d, 0x1f);
    acc += ((u64)hi << 32) | lo;
  }
  if ((tid() & 31) == 0 && acc != 0) __nvvm_atom_add_gen_ll((long long *)&out[s], (long long)acc);
#endif
}

// For every region s, adds to out[s] the sum over the words k of its checked blocks of
// mix64(word_k ^ k * GOLDEN); the host finishes each digest with the region's length. Each
// thread block takes a contiguous range of all regions' blocks (so it meets few regions and
// flushes rarely); within a block of 512 words, thread t reads words t and t + 256 (coalesced).
KERNEL void rlp_digest_segments(const Region *regions, u32 count, u64 total_blocks, u64 *out) {
  u64 per = (total_blocks + nctaid_x() - 1) / nctaid_x();
  u64 lo = (u64)ctaid_x() * per;
  u64 hi = lo + per < total_blocks ? lo + per : total_blocks;
  if (lo >= hi) return;
  // The region holding block lo: the last whose first_block <= lo.
  u32 a = 0, z = count - 1;
  while (a < z) {
    u32 m = (a + z + 1) / 2;
    if (regions[m].first_block <= lo) a = m; else z = m - 1;
  }
  u32 s = a;
  Region g = regions[s];
  u64 len = g.rows * g.width;
  u64 end = s + 1 < count ? regions[s + 1].first_block : total_blocks;
  u64 words = (len + 7) / 8;
  bool whole_words = (g.rows == 1 || g.pitch == g.width) && (g.base & 7) == 0;
  u64 acc = 0;
  for (u64 c = lo; c < hi;) {
    while (c >= end) {
      flush(acc, out, s);
      acc = 0;
      s++;
      g = regions[s];
      len = g.rows * g.width;
      end = s + 1 < count ? regions[s + 1].first_block : total_blocks;
      words = (len + 7) / 8;
      whole_words = (g.rows == 1 || g.pitch == g.width) && (g.base & 7) == 0;
    }
    // The next (up to) 32 blocks of this region, and which of them are read.
    u64 limit = c + 32 < hi ? c + 32 : hi;
    limit = limit < end ? limit : end;
    u32 bits = drawn(g, c - g.first_block, (u32)(limit - c), end - g.first_block - 1);
    for (; bits != 0; bits &= bits - 1) {
      u64 b = c - g.first_block + (u64)__builtin_ctz(bits);
      u64 k = b * BLOCK_WORDS + tid();
      if (whole_words && (b + 1) * BLOCK_BYTES <= len) {
        // The common case, a whole block of a contiguous aligned region: both loads in flight
        // before either is used.
        const GLOBAL u64 *p = (const GLOBAL u64 *)g.base + k;
        u64 w0 = p[0], w1 = p[THREADS];
        acc += mix64(w0 ^ (k * GOLDEN)) + mix64(w1 ^ ((k + THREADS) * GOLDEN));
        continue;
      }
      for (; k < (b + 1) * BLOCK_WORDS && k < words; k += THREADS) {
        acc += mix64(load_word(g, len, k) ^ (k * GOLDEN));
      }
    }
    c = limit;
  }
  flush(acc, out, s);
}

// Adds the sum of the `len / 8` words at `base` into *out: the same reads as a full digest of a
// contiguous region, without the mixing (the read-bandwidth reference).
KERNEL void rlp_read_words(const u64 *base, u64 len, u64 *out) {
  u64 words = len / 8;
  u64 acc = 0;
  for (u64 k = (u64)ctaid_x() * THREADS + tid(); k < words; k += (u64)nctaid_x() * THREADS) acc += base[k];
  flush(acc, out, 0);
}

// Copies: up to COPY_SPANS spans per launch, passed by value (kernel parameters, no table in
// device memory to manage). `first_chunk` is the span's first COPY_CHUNK-byte chunk among all
// spans' chunks. The layout of crate::gpu::SpanTable.
#define COPY_SPANS 120
#define COPY_CHUNK 65536ull
struct Span {
  u64 dst;
  u64 src;
  u64 len;
  u64 first_chunk;
};
struct SpanTable {
  u64 count;
  u64 total_chunks;
  Span spans[COPY_SPANS];
};
#ifdef RLP_HOST_EMULATION
struct v4 { u32 x, y, z, w; };  // (emulation.h erases attributes)
#else
typedef u32 v4 __attribute__((ext_vector_type(4)));
#endif

// Each thread block takes a contiguous range of all spans' chunks; within a chunk, threads move
// 16-byte vectors (four loads in flight before their stores) when both ends are 16-byte aligned,
// bytes otherwise.
KERNEL void rlp_copy_spans(SpanTable t) {
  u64 per = (t.total_chunks + nctaid_x() - 1) / nctaid_x();
  u64 lo = (u64)ctaid_x() * per;
  u64 hi = lo + per < t.total_chunks ? lo + per : t.total_chunks;
  if (lo >= hi) return;
  u32 s = 0;
  while (s + 1 < t.count && t.spans[s + 1].first_chunk <= lo) s++;
  for (u64 c = lo; c < hi; c++) {
    while (s + 1 < t.count && t.spans[s + 1].first_chunk <= c) s++;
    const Span &p = t.spans[s];
    u64 c0 = (c - p.first_chunk) * COPY_CHUNK;
    u64 c1 = c0 + COPY_CHUNK < p.len ? c0 + COPY_CHUNK : p.len;
    u64 done = c0;
    if (((p.dst | p.src | c0) & 15) == 0) {
      const GLOBAL v4 *src = (const GLOBAL v4 *)(p.src + c0);
      GLOBAL v4 *dst = (GLOBAL v4 *)(p.dst + c0);
      u64 n = (c1 - c0) / 16;
      u64 i = tid();
      for (; i + 3 * THREADS < n; i += 4 * THREADS) {
        v4 a = src[i], b = src[i + THREADS], x = src[i + 2 * THREADS], y = src[i + 3 * THREADS];
        dst[i] = a;
        dst[i + THREADS] = b;
        dst[i + 2 * THREADS] = x;
        dst[i + 3 * THREADS] = y;
      }
      for (; i < n; i += THREADS) dst[i] = src[i];
      done = c0 + n * 16;
    }
    for (u64 j = done + tid(); j < c1; j += THREADS) *(GLOBAL u8 *)(p.dst + j) = *(const GLOBAL u8 *)(p.src + j);
  }
}
