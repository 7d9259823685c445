//! GPU tests. Without a CUDA driver (or with too few GPUs) each prints that it skipped and passes;
//! on a GPU machine they run for real. Peers are real processes of the `rlplane` binary
//! (`RLPLANE_BIN` overrides its path, for running the test executable on another machine).
//!
//! Run on a GPU machine: `cargo test --release -p rlplane --test gpu -- --test-threads 1`.

use std::path::PathBuf;
use std::time::Duration;

use rand::{Rng, SeedableRng};
use rlplane::bench::gpu::{GpuBenchArgs, GpuTransport, kill_sender_mid_refit, launch};
use rlplane_api::model::{DType, ModelPreset, TensorSpec, TpSplit};
use rlplane_api::spec::ModelSpec;

fn bin() -> PathBuf {
    std::env::var_os("RLPLANE_BIN").map(PathBuf::from).unwrap_or_else(|| env!("CARGO_BIN_EXE_rlplane").into())
}

/// GPUs present, or None after saying why the test skips. Written to the stderr handle, not
/// with `eprintln!`: the test harness captures the macros' output of passing tests, and a
/// skipped GPU test must show in CI's output.
fn gpus(needed: usize, test: &str) -> Option<usize> {
    use std::io::Write as _;
    let why = match rlplane::gpu::probe() {
        Ok(info) if info.devices >= needed => return Some(info.devices),
        Ok(info) => format!("needs {needed} GPU(s), found {}", info.devices),
        Err(e) => format!("no GPU ({e})"),
    };
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
    None
}

/// A random manifest with odd sizes, vectors, and one tensor several buckets long.
fn random_manifest(seed: u64, big: u64) -> ModelSpec {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut t = Vec::new();
    for i in 0..40 {
        let rows = 2 * rng.random_range(1..300u64);
        let cols = 2 * rng.random_range(1..700u64);
        let dtype = [DType::Bf16, DType::F32, DType::F16][i % 3];
        let split = [TpSplit::Rows, TpSplit::Columns, TpSplit::Replicated][rng.random_range(0..3)];
        t.push(TensorSpec::with_split(format!("t{i}"), dtype, vec![rows, cols], split));
        if i % 7 == 0 {
            t.push(TensorSpec::new(format!("v{i}"), DType::Bf16, vec![rng.random_range(1..5000)]));
        }
    }
    t.push(TensorSpec::with_split("big", DType::Bf16, vec![1024, big / 2048], TpSplit::Columns));
    ModelSpec::tensors(t)
}

fn args(model: ModelSpec) -> GpuBenchArgs {
    let mut a = GpuBenchArgs::new(model);
    a.bin = Some(bin());
    a.iters = 2;
    a.warmup = 1;
    a.timeout_seconds = 30;
    a
}

fn show(rows: &[rlplane::bench::gpu::Row]) {
    for r in rows {
        eprintln!("{}", r.line());
    }
}

fn block_on<T>(f: impl Future<Output = T>) -> T {
    tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap().block_on(f)
}

#[test]
fn gpu_kernels_match_the_cpu_definitions() {
    if gpus(1, "gpu_kernels_match_the_cpu_definitions").is_none() {
        return;
    }
    let gpu = rlplane::gpu::Gpu::open(0).unwrap();
    let stream = gpu.stream().unwrap();
    // A strided region with odd widths: 37 rows of 29 bytes, pitch 61, inside a 4 KiB buffer.
    let (rows, width, pitch, off) = (37u64, 29u64, 61u64, 13u64);
    let buf = gpu.alloc(4096).unwrap();
    buf.memset(0, &stream).unwrap();
    let (seed, full_off, full_pitch) = (0x1234_5678_9abc_def0u64, 1001u64, 997u64);
    unsafe { gpu.fill2d(&stream, buf.ptr() + off, rows, width, pitch, seed, full_off, full_pitch).unwrap() };
    stream.synchronize().unwrap();
    let mut host = vec![0u8; 4096];
    buf.copy_to_host(0, &mut host).unwrap();
    let mut expected = vec![0u8; 4096];
    for r in 0..rows {
        let at = (off + r * pitch) as usize;
        rlplane::digest::fill(&mut expected[at..at + width as usize], seed, full_off + r * full_pitch);
    }
    assert_eq!(host, expected, "rlp_fill2d writes what digest::fill defines");
    // The digest kernel: many regions in one launch — strided with odd widths, strided whole
    // words, contiguous with a partial last word, unaligned, empty — every block and a sample.
    use rlplane::digest::{Sampling, digest_region};
    use rlplane::gpu::DigestRegion;
    let big = gpu.alloc(1 << 20).unwrap();
    let mut host_big = vec![0u8; 1 << 20];
    rlplane::digest::fill(&mut host_big, seed, 0);
    big.copy_from_host(0, &host_big).unwrap();
    let shapes: [(u64, u64, u64, u64); 7] = [
        (off, rows, width, pitch),  // in the small buffer: strided, odd
        (8, 300, 512, 1024),        // strided whole words
        (0, 1, 1003, 1003),         // contiguous, partial last word
        (3, 1, 70_001, 70_001),     // unaligned
        (4096, 1, 0, 0),            // empty
        (0, 1, 1 << 20, 1 << 20),   // contiguous, 256 blocks
        (16, 100, 4096 + 24, 8192), // strided rows longer than a block
    ];
    for sampled in [false, true] {
        let regions: Vec<DigestRegion> = shapes
            .iter()
            .enumerate()
            .map(|(i, &(o, r, w, p))| DigestRegion {
                addr: if i == 0 { buf.ptr() } else { big.ptr() } + o,
                rows: r,
                width: w,
                pitch: p,
                sampling: if sampled { Sampling::sampled(9, i as u64) } else { Sampling::FULL },
            })
            .collect();
        let got = unsafe { gpu.digest_regions(&regions, &stream).unwrap() };
        for (i, (r, &(o, rows, w, p))) in regions.iter().zip(&shapes).enumerate() {
            let mem = if i == 0 { &host } else { &host_big };
            assert_eq!(got[i], digest_region(mem, o, rows, w, p, r.sampling), "region {i} (sampled: {sampled})");
        }
    }
    eprintln!("GPU kernels agree with the CPU on strided, contiguous, unaligned and empty regions, full and sampled");
}

#[test]
fn nccl_refit_of_a_random_manifest_with_checksums_and_an_oversize_tensor() {
    if gpus(2, "nccl_refit_of_a_random_manifest").is_none() {
        return;
    }
    // Buckets of 1 MiB; the big tensor is 5 MiB, so it is chunked over six buckets.
    let mut a = args(random_manifest(7, 5 << 20));
    a.bucket_bytes = 1 << 20;
    a.buffers = 3;
    let rows = block_on(launch(&a)).unwrap();
    show(&rows);
}

#[test]
fn sharded_nccl_refit_from_two_tensor_parallel_senders() {
    if gpus(4, "sharded_nccl_refit_from_two_tensor_parallel_senders").is_none() {
        return;
    }
    let mut a = args(random_manifest(11, 3 << 20));
    a.tp = 2;
    a.receivers = 2;
    a.bucket_bytes = 1 << 20;
    let rows = block_on(launch(&a)).unwrap();
    show(&rows);
}

#[test]
fn colocated_cuda_ipc_refit_across_two_processes_direct_and_staged() {
    if gpus(1, "colocated_cuda_ipc_refit").is_none() {
        return;
    }
    let mut a = args(random_manifest(3, 5 << 20));
    a.colocated = true;
    a.transport = GpuTransport::CudaIpc;
    a.bucket_bytes = 1 << 20;
    let rows = block_on(launch(&a)).unwrap();
    show(&rows);
}

#[test]
fn cuda_ipc_peer_copies_between_two_gpus() {
    if gpus(2, "cuda_ipc_peer_copies_between_two_gpus").is_none() {
        return;
    }
    let mut a = args(random_manifest(5, 2 << 20));
    a.transport = GpuTransport::CudaIpc;
    a.bucket_bytes = 1 << 20;
    let rows = block_on(launch(&a)).unwrap();
    show(&rows);
}

#[test]
fn a_sender_killed_mid_refit_leaves_receivers_incomplete_within_the_timeout() {
    let Some(n) = gpus(1, "a_sender_killed_mid_refit") else { return };
    // Many small buckets make the refit long enough to be killed in the middle.
    let mut cases = vec![(GpuTransport::CudaIpc, true)];
    if n >= 2 {
        cases.push((GpuTransport::Nccl, false));
    }
    for (transport, colocated) in cases {
        let mut a = args(ModelSpec::preset(ModelPreset::Llama3_8b));
        a.transport = transport;
        a.colocated = colocated;
        a.bucket_bytes = 1 << 20;
        a.timeout_seconds = 20;
        let what = block_on(kill_sender_mid_refit(&a, Duration::from_millis(150))).unwrap();
        eprintln!("{transport:?}: {what}");
    }
}
