//! The GPU kernels' logic on the CPU: `refit/src/gpu/kernels.cu` compiled as C++ with the host
//! shims of `emulation.h` (every thread of every thread block run one after another), against the
//! CPU definitions in `rlplane::digest`. This covers the region search, the block sampling, the
//! strided, unaligned and partial-word loads and the synthetic fill on machines without a GPU;
//! `worker/tests/gpu.rs` runs the same kernels on a real GPU. Needs clang++ (`.ci/run` installs
//! clang-14 for the PTX freshness check); without it the test says that it skipped.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use rand::{Rng, SeedableRng};
use rlplane::digest::{Sampling, digest_region, fill};

const HARNESS: &str = r#"
#include <stdio.h>
#include <stdlib.h>
#include <vector>
#include "kernels.cu"
// argv: data file. stdin: "digest CTAS N" then N lines "offset rows width pitch mask salt",
// "copy CTAS N" then N lines "dst src len" (offsets in the file), or
// "fill ROWS WIDTH PITCH SEED FULL_OFFSET FULL_PITCH GX GY". Prints the sums / the bytes.
int main(int argc, char **argv) {
  FILE *f = fopen(argv[1], "rb");
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  std::vector<unsigned char> data(n);
  if (fread(data.data(), 1, n, f) != (size_t)n) return 2;
  fclose(f);
  char what[16];
  if (scanf("%15s", what) != 1) return 2;
  if (what[0] == 'd') {
    unsigned ctas; int count;
    if (scanf("%u %d", &ctas, &count) != 2) return 2;
    std::vector<Region> r(count);
    u64 total = 0;
    for (int i = 0; i < count; i++) {
      unsigned long long off, rows, width, pitch, mask, salt;
      if (scanf("%llu %llu %llu %llu %llu %llu", &off, &rows, &width, &pitch, &mask, &salt) != 6) return 2;
      r[i] = Region{(u64)(uintptr_t)(data.data() + off), rows, width, pitch, mask, salt, total};
      total += (rows * width + 4095) / 4096;
    }
    std::vector<u64> out(count, 0);
    rlp_nctaid_x = ctas; rlp_nctaid_y = 1;
    for (rlp_ctaid_x = 0; rlp_ctaid_x < ctas; rlp_ctaid_x++)
      for (rlp_tid = 0; rlp_tid < THREADS; rlp_tid++) rlp_digest_segments(r.data(), count, total, out.data());
    for (int i = 0; i < count; i++) printf("%llu\n", (unsigned long long)out[i]);
  } else if (what[0] == 'c') {
    unsigned ctas; int count;
    if (scanf("%u %d", &ctas, &count) != 2) return 2;
    SpanTable t = {};
    for (int i = 0; i < count; i++) {
      unsigned long long dst, src, len;
      if (scanf("%llu %llu %llu", &dst, &src, &len) != 3) return 2;
      t.spans[t.count] = Span{(u64)(uintptr_t)(data.data() + dst), (u64)(uintptr_t)(data.data() + src), len, t.total_chunks};
      t.count++;
      t.total_chunks += (len + COPY_CHUNK - 1) / COPY_CHUNK;
    }
    rlp_nctaid_x = ctas; rlp_nctaid_y = 1;
    for (rlp_ctaid_x = 0; rlp_ctaid_x < ctas; rlp_ctaid_x++)
      for (rlp_tid = 0; rlp_tid < THREADS; rlp_tid++) rlp_copy_spans(t);
    fwrite(data.data(), 1, n, stdout);
  } else {
    unsigned long long rows, width, pitch, seed, full_offset, full_pitch; unsigned gx, gy;
    if (scanf("%llu %llu %llu %llu %llu %llu %u %u", &rows, &width, &pitch, &seed, &full_offset, &full_pitch, &gx, &gy) != 8) return 2;
    rlp_nctaid_x = gx; rlp_nctaid_y = gy;
    for (rlp_ctaid_y = 0; rlp_ctaid_y < gy; rlp_ctaid_y++)
      for (rlp_ctaid_x = 0; rlp_ctaid_x < gx; rlp_ctaid_x++)
        for (rlp_tid = 0; rlp_tid < THREADS; rlp_tid++)
          rlp_fill2d(data.data(), rows, width, pitch, seed, full_offset, full_pitch);
    fwrite(data.data(), 1, n, stdout);
  }
  return 0;
}
"#;

/// Compiles the harness, or says why the test skips.
fn harness(dir: &Path) -> Option<PathBuf> {
    let gpu_src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../refit/src/gpu");
    let Some(cxx) = ["clang++-14", "clang++"].into_iter().find(|c| Command::new(c).arg("--version").output().is_ok())
    else {
        assert!(
            std::env::var("RLPLANE_TOOLS_REQUIRED").as_deref() != Ok("1"),
            "no clang++ (apt-get install clang-14; RLPLANE_TOOLS_REQUIRED=1: scripts/test installs it)"
        );
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED the GPU kernels' CPU emulation: no clang++ (apt-get install clang-14)"
        );
        return None;
    };
    let main = dir.join("main.cpp");
    std::fs::write(&main, HARNESS).unwrap();
    let exe = dir.join("kernels");
    let out = Command::new(cxx)
        .args(["-O2", "-DRLP_HOST_EMULATION", "-x", "c++"])
        .arg(&main)
        .arg("-I")
        .arg(&gpu_src)
        .arg("-o")
        .arg(&exe)
        .output()
        .unwrap();
    assert!(out.status.success(), "compiling kernels.cu for the host: {}", String::from_utf8_lossy(&out.stderr));
    Some(exe)
}

fn run(exe: &Path, data: &Path, input: &str) -> Vec<u8> {
    let mut child = Command::new(exe)
        .arg(data)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "the emulated kernel failed");
    out.stdout
}

#[test]
fn the_digest_kernel_computes_digest_region_for_every_kind_of_region() {
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = harness(dir.path()) else { return };
    let mut rng = rand::rngs::StdRng::seed_from_u64(14);
    for trial in 0..20 {
        let size = [20_000usize, 300_000][trial % 2];
        let bytes: Vec<u8> = (0..size).map(|_| rng.random()).collect();
        let data = dir.path().join("data.bin");
        std::fs::write(&data, &bytes).unwrap();
        let mut regions = Vec::new();
        for _ in 0..rng.random_range(1..9) {
            let (off, rows, width, pitch) = match rng.random_range(0..5) {
                // Contiguous, aligned or not.
                k @ (0 | 1) => {
                    let width = rng.random_range(1..60_000u64.min(size as u64 - 100));
                    let off = rng.random_range(0..size as u64 - width);
                    (if k == 0 { off & !7 } else { off }, 1, width, width)
                }
                // Strided whole words (the aligned fast path).
                2 => {
                    let width = 8 * rng.random_range(1..300u64);
                    let pitch = width + 8 * rng.random_range(0..6u64);
                    let rows = rng.random_range(1..=((size as u64 - 64) / pitch).min(200));
                    (rng.random_range(0..=(size as u64 - rows * pitch)) & !7, rows, width, pitch)
                }
                // Strided, odd widths.
                3 => {
                    let width = rng.random_range(1..300u64);
                    let pitch = width + rng.random_range(0..40u64);
                    let rows = rng.random_range(1..=((size as u64 - 64) / pitch).min(200));
                    (rng.random_range(0..=(size as u64 - rows * pitch)), rows, width, pitch)
                }
                // Empty.
                _ => (0, 1, 0, 0),
            };
            let sampling = if rng.random() { Sampling::FULL } else { Sampling::sampled(rng.random(), rng.random()) };
            regions.push((off, rows, width, pitch, sampling));
        }
        let ctas = [1u32, 3, 7, 64][trial % 4];
        let mut input = format!("digest {ctas} {}\n", regions.len());
        for (o, r, w, p, s) in &regions {
            input += &format!("{o} {r} {w} {p} {} {}\n", s.mask(), s.salt());
        }
        let sums: Vec<u64> = String::from_utf8(run(&exe, &data, &input))
            .unwrap()
            .split_whitespace()
            .map(|x| x.parse().unwrap())
            .collect();
        for (i, ((o, r, w, p, s), sum)) in regions.iter().zip(sums).enumerate() {
            assert_eq!(
                rlplane::gpu::finish_digest(sum, r * w),
                digest_region(&bytes, *o, *r, *w, *p, *s),
                "trial {trial}, region {i}: offset {o}, {r} rows of {w} bytes, pitch {p}, {s:?}, {ctas} thread blocks"
            );
        }
    }
}

#[test]
fn the_fill_kernel_writes_what_digest_fill_defines() {
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = harness(dir.path()) else { return };
    let (rows, width, pitch) = (37u64, 29u64, 61u64);
    let (seed, full_off, full_pitch) = (0x1234_5678_9abc_def0u64, 1001u64, 997u64);
    let data = dir.path().join("data.bin");
    std::fs::write(&data, vec![0u8; 4096]).unwrap();
    // One thread block across a row, five striding over the rows.
    let got = run(&exe, &data, &format!("fill {rows} {width} {pitch} {seed} {full_off} {full_pitch} 1 5"));
    let mut expected = vec![0u8; 4096];
    for r in 0..rows {
        let at = (r * pitch) as usize;
        fill(&mut expected[at..at + width as usize], seed, full_off + r * full_pitch);
    }
    assert_eq!(got, expected, "rlp_fill2d writes what digest::fill defines");
}

#[test]
fn the_copy_kernel_copies_every_span_and_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = harness(dir.path()) else { return };
    let mut rng = rand::rngs::StdRng::seed_from_u64(15);
    let size = 1usize << 20;
    for trial in 0..8 {
        let bytes: Vec<u8> = (0..size).map(|_| rng.random()).collect();
        let data = dir.path().join("data.bin");
        std::fs::write(&data, &bytes).unwrap();
        // Sources in the first half, destinations in the second: disjoint spans, some aligned to
        // 16 bytes (the vector path), some not, some longer than a 64 KiB chunk, one empty.
        let half = size as u64 / 2;
        let mut spans = Vec::new();
        let mut at = 0u64;
        while spans.len() < 12 && at < half - 1000 {
            let len = match rng.random_range(0..4) {
                0 => rng.random_range(1..100u64),
                1 => 16 * rng.random_range(1..5000u64),
                2 => 0,
                _ => rng.random_range(65_536..150_000u64),
            }
            .min(half - at - 64);
            let (src, dst) = if rng.random() { (at, half + at) } else { (at + 3, half + at + 7) };
            spans.push((dst, src, len));
            at += len + 64;
        }
        let ctas = [1u32, 5, 64][trial % 3];
        let mut input = format!("copy {ctas} {}\n", spans.len());
        for (d, s, l) in &spans {
            input += &format!("{d} {s} {l}\n");
        }
        let got = run(&exe, &data, &input);
        let mut expected = bytes.clone();
        for &(d, s, l) in &spans {
            let (d, s, l) = (d as usize, s as usize, l as usize);
            expected.copy_within(s..s + l, d);
        }
        assert!(got == expected, "trial {trial}: the copies differ from {spans:?} ({ctas} thread blocks)");
    }
}
