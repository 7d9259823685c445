//! Property tests of the refit packing plan: coverage, alignment, chunking, determinism, hashing,
//! and sharded plans whose union over every sender rebuilds every full tensor exactly.

use proptest::prelude::*;
use rlplane::bench::refit::{fill_tensor, shard_of};
use rlplane::refit::plan::{RefitPlan, SenderLayout, ShardCoords, shard_shape};
use rlplane_api::model::{DType, ModelPreset, TensorSpec, TpSplit, pipeline_stages};

fn dtype() -> impl Strategy<Value = DType> {
    prop_oneof![Just(DType::U8), Just(DType::Bf16), Just(DType::F32), Just(DType::I64)]
}

fn split() -> impl Strategy<Value = Option<TpSplit>> {
    prop_oneof![Just(None), Just(Some(TpSplit::Replicated)), Just(Some(TpSplit::Rows)), Just(Some(TpSplit::Columns))]
}

fn manifest() -> impl Strategy<Value = Vec<TensorSpec>> {
    prop::collection::vec((dtype(), prop::collection::vec(1u64..=12, 1..=3), split()), 1..=8).prop_map(|ts| {
        ts.into_iter()
            .enumerate()
            .map(|(i, (dtype, shape, tp_split))| TensorSpec { name: format!("t{i}"), dtype, shape, tp_split })
            .collect()
    })
}

/// Bucket sizes small enough that tensors get chunked, and an alignment that fits.
fn settings() -> impl Strategy<Value = (u64, u64)> {
    (1u64..=700, 0u32..=7).prop_map(|(bucket, k)| {
        let mut align = 1u64 << k;
        while align > bucket {
            align /= 2;
        }
        (bucket, align)
    })
}

/// Checks the bucket layout of a plan; returns per-tensor source and destination coverage counts.
fn check_layout(plan: &RefitPlan, manifest: &[TensorSpec]) -> Result<(), TestCaseError> {
    let bucket = plan.bucket_bytes();
    let align = plan.align_bytes();
    let mut seen = 0usize;
    for (k, b) in plan.buckets().iter().enumerate() {
        prop_assert_eq!(b.index as usize, k);
        prop_assert_eq!(b.segments.start, seen, "buckets hold consecutive segments");
        prop_assert!(!b.segments.is_empty(), "no empty bucket");
        seen = b.segments.end;
        prop_assert!(b.used_bytes <= bucket);
        let mut end = 0;
        let mut payload = 0;
        for s in &plan.segments()[b.segments.clone()] {
            prop_assert_eq!(s.bucket as usize, k);
            prop_assert_eq!(s.bucket_offset % align, 0, "segment offsets are aligned");
            prop_assert!(s.bucket_offset >= end, "segments do not overlap in the bucket");
            prop_assert!(s.rows >= 1 && s.width >= 1);
            end = s.bucket_offset + s.bytes();
            payload += s.bytes();
            prop_assert!(end <= bucket, "segment inside the bucket");
        }
        prop_assert_eq!(end, b.used_bytes);
        prop_assert_eq!(payload, b.payload_bytes);
    }
    prop_assert_eq!(seen, plan.segments().len());
    // Source side: every byte of each sent shard exactly once.
    for (i, t) in plan.tensors().iter().enumerate() {
        prop_assert_eq!(t.dest_bytes, manifest[i].size_bytes());
        let Some(src_len) = t.source_bytes else {
            prop_assert!(plan.segments().iter().all(|s| s.tensor as usize != i));
            continue;
        };
        let mut count = vec![0u8; src_len as usize];
        for s in plan.segments().iter().filter(|s| s.tensor as usize == i) {
            for r in 0..s.rows {
                for b in 0..s.width {
                    count[(s.src_offset + r * s.src_pitch + b) as usize] += 1;
                }
            }
        }
        prop_assert!(count.iter().all(|&c| c == 1), "tensor {i}: every source byte exactly once");
        // Never split what fits in a bucket; split what does not.
        let pieces = plan.segments().iter().filter(|s| s.tensor as usize == i).count();
        if src_len > 0 && src_len <= bucket {
            prop_assert_eq!(pieces, 1, "tensor {} of {} bytes fits a bucket of {}", i, src_len, bucket);
        }
        if src_len > bucket {
            prop_assert!(pieces >= 2, "tensor {} of {} bytes is chunked over buckets of {}", i, src_len, bucket);
        }
    }
    Ok(())
}

/// The receivers' tensors after a simulated refit, and how often each byte was written.
type Simulated = (Vec<Vec<u8>>, Vec<Vec<u8>>);

/// Moves `full` through the plans of `senders` the way the engine does (shard → bucket at its
/// offset → destination) and returns the receivers' tensors and per-byte write counts.
fn simulate(
    manifest: &[TensorSpec],
    plans: &[(RefitPlan, u32, u32)],
    full: &[Vec<u8>],
) -> Result<Simulated, TestCaseError> {
    let mut dest: Vec<Vec<u8>> = manifest.iter().map(|t| vec![0u8; t.size_bytes() as usize]).collect();
    let mut writes: Vec<Vec<u8>> = manifest.iter().map(|t| vec![0u8; t.size_bytes() as usize]).collect();
    for (plan, tp, tp_size) in plans {
        // The sender's source shards, from the independent definition in the bench.
        let shards: Vec<Vec<u8>> = manifest
            .iter()
            .enumerate()
            .map(|(i, t)| match (plan.tensors()[i].source_bytes, plan.layout()) {
                (Some(_), SenderLayout::Sharded(c)) if c.fsdp_size > 1 => {
                    let shard = shard_of(t, &full[i], *tp, *tp_size);
                    let rows = tp_shard_rows(t, *tp, *tp_size);
                    torch_chunk(&shard, rows, c.fsdp, c.fsdp_size)
                }
                (Some(_), _) => shard_of(t, &full[i], *tp, *tp_size),
                (None, _) => Vec::new(),
            })
            .collect();
        for (i, t) in plan.tensors().iter().enumerate() {
            if let Some(n) = t.source_bytes {
                prop_assert_eq!(n as usize, shards[i].len(), "tensor {}: shard size", i);
            }
        }
        for b in plan.buckets() {
            let mut staging = vec![0u8; plan.bucket_bytes() as usize];
            let segs = &plan.segments()[b.segments.clone()];
            for s in segs {
                for r in 0..s.rows {
                    let src = (s.src_offset + r * s.src_pitch) as usize;
                    let at = (s.bucket_offset + r * s.width) as usize;
                    staging[at..at + s.width as usize]
                        .copy_from_slice(&shards[s.tensor as usize][src..src + s.width as usize]);
                }
            }
            for s in segs {
                for r in 0..s.rows {
                    let dst = (s.dst_offset + r * s.dst_pitch) as usize;
                    let at = (s.bucket_offset + r * s.width) as usize;
                    let t = s.tensor as usize;
                    dest[t][dst..dst + s.width as usize].copy_from_slice(&staging[at..at + s.width as usize]);
                    writes[t][dst..dst + s.width as usize].iter_mut().for_each(|c| *c += 1);
                }
            }
        }
    }
    Ok((dest, writes))
}

/// Dimension 0 of tensor-parallel rank `tp`'s shard of `t` (Megatron's balanced split).
fn tp_shard_rows(t: &TensorSpec, tp: u32, tp_size: u32) -> u64 {
    let n = t.shape[0];
    match t.effective_split() {
        TpSplit::Replicated => n,
        TpSplit::Columns if t.shape.len() >= 2 => n,
        _ => n * (tp as u64 + 1) / tp_size as u64 - n * tp as u64 / tp_size as u64,
    }
}

/// `torch.chunk(shard, parts, dim=0)[i]` of a contiguous shard of `rows` rows (empty past the end).
fn torch_chunk(shard: &[u8], rows: u64, i: u32, parts: u32) -> Vec<u8> {
    let row = shard.len() / rows as usize;
    let size = rows.div_ceil(parts as u64) as usize;
    let start = (size * i as usize).min(rows as usize);
    let end = (start + size).min(rows as usize);
    shard[start * row..end * row].to_vec()
}

fn random_tensors(manifest: &[TensorSpec], seed: u64) -> Vec<Vec<u8>> {
    manifest
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let mut v = vec![0u8; t.size_bytes() as usize];
            fill_tensor(seed, 0, i, &mut v);
            v
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn full_plan_covers_every_byte_once(m in manifest(), (bucket, align) in settings(), seed in any::<u64>()) {
        let plan = RefitPlan::new(&m, bucket, align).unwrap();
        check_layout(&plan, &m)?;
        prop_assert_eq!(plan.stream_bytes(), m.iter().map(TensorSpec::size_bytes).sum::<u64>());
        let full = random_tensors(&m, seed);
        let (dest, writes) = simulate(&m, &[(plan, 0, 1)], &full)?;
        prop_assert!(writes.iter().flatten().all(|&c| c == 1), "every destination byte written exactly once");
        prop_assert_eq!(dest, full);
    }

    #[test]
    fn sharded_plans_together_rebuild_every_tensor(
        m in manifest(),
        (bucket, align) in settings(),
        tp_size in 1u32..=4,
        pp_size in 1u32..=3,
        seed in any::<u64>(),
    ) {
        let mut plans = Vec::new();
        for pp in 0..pp_size {
            for tp in 0..tp_size {
                let c = ShardCoords::tensor_parallel(tp, tp_size, pp, pp_size);
                let plan = RefitPlan::sharded(&m, bucket, align, c).unwrap();
                check_layout(&plan, &m)?;
                prop_assert_eq!(plan.layout(), SenderLayout::Sharded(c));
                plans.push((plan, tp, tp_size));
            }
        }
        // Each tensor is sent by senders of its own stage only.
        let stages = pipeline_stages(&m, pp_size);
        for (plan, _, _) in &plans {
            let SenderLayout::Sharded(c) = plan.layout() else { unreachable!() };
            for (i, t) in plan.tensors().iter().enumerate() {
                if t.source_bytes.is_some() {
                    prop_assert_eq!(stages[i], c.pp);
                }
            }
        }
        let full = random_tensors(&m, seed);
        let (dest, writes) = simulate(&m, &plans, &full)?;
        prop_assert!(writes.iter().flatten().all(|&c| c == 1), "the union covers every byte exactly once");
        prop_assert_eq!(dest, full);
    }

    #[test]
    fn fully_sharded_plans_together_rebuild_every_tensor(
        m in manifest(),
        (bucket, align) in settings(),
        tp_size in 1u32..=3,
        pp_size in 1u32..=2,
        fsdp_size in 2u32..=5,
        seed in any::<u64>(),
    ) {
        let mut plans = Vec::new();
        for pp in 0..pp_size {
            for fsdp in 0..fsdp_size {
                for tp in 0..tp_size {
                    let c = ShardCoords::tensor_parallel(tp, tp_size, pp, pp_size).fully_sharded(fsdp, fsdp_size);
                    let plan = RefitPlan::sharded(&m, bucket, align, c).unwrap();
                    check_layout(&plan, &m)?;
                    // What the sidecar asks a rank to register is what its plan sends.
                    let stages = pipeline_stages(&m, pp_size);
                    for ((t, e), &stage) in m.iter().zip(plan.tensors()).zip(&stages) {
                        let shape = shard_shape(t, c).filter(|_| stage == pp);
                        let elem = t.dtype.size_bytes();
                        prop_assert_eq!(shape.map(|s| s.iter().product::<u64>() * elem), e.source_bytes);
                    }
                    plans.push((plan, tp, tp_size));
                }
            }
        }
        let full = random_tensors(&m, seed);
        let (dest, writes) = simulate(&m, &plans, &full)?;
        prop_assert!(writes.iter().flatten().all(|&c| c == 1), "the union covers every byte exactly once");
        prop_assert_eq!(dest, full);
    }

    #[test]
    fn identical_inputs_give_identical_plans(m in manifest(), (bucket, align) in settings(), tp in 0u32..3) {
        let c = ShardCoords::tensor_parallel(tp, 3, 0, 1);
        let a = RefitPlan::sharded(&m, bucket, align, c).unwrap();
        let b = RefitPlan::sharded(&m.clone(), bucket, align, c).unwrap();
        prop_assert_eq!(a.hash(), b.hash());
        prop_assert_eq!(&a, &b);
        prop_assert_eq!(a.identity(), b.identity());
    }

    #[test]
    fn the_hash_changes_when_any_input_changes(
        m in manifest(),
        (bucket, align) in settings(),
        which in 0usize..9,
        pick in any::<prop::sample::Index>(),
    ) {
        let base = RefitPlan::new(&m, bucket, align).unwrap().hash();
        let mut m2 = m.clone();
        let i = pick.index(m.len());
        let (mut bucket2, mut align2) = (bucket, align);
        let mut layout = SenderLayout::Full;
        match which {
            0 => bucket2 += 1,
            1 => { if align2 > 1 { align2 /= 2 } else { bucket2 = bucket2.max(2); align2 = 2 } }
            2 => m2[i].name.push('x'),
            3 => m2[i].dtype = if m2[i].dtype == DType::U8 { DType::I64 } else { DType::U8 },
            4 => m2[i].shape[0] += 1,
            5 => m2[i].tp_split = match m2[i].tp_split {
                None => Some(TpSplit::Replicated),
                Some(TpSplit::Replicated) => Some(TpSplit::Rows),
                Some(TpSplit::Rows) => Some(TpSplit::Columns),
                Some(TpSplit::Columns) => None,
            },
            6 => { m2.push(TensorSpec::new("extra", DType::U8, vec![1])); }
            7 => m2[i].shape.push(1),
            _ => layout = SenderLayout::Sharded(ShardCoords::tensor_parallel(0, 1, 0, 1)),
        }
        let changed = RefitPlan::build(&m2, bucket2, align2, layout).unwrap().hash();
        prop_assert_ne!(base, changed, "change {} did not change the hash", which);
    }
}

/// Tiles `[0, size)` exactly with `intervals`.
fn tiles(mut intervals: Vec<(u64, u64)>, size: u64) -> bool {
    intervals.sort_unstable();
    let mut at = 0;
    for (start, len) in intervals {
        if start != at {
            return false;
        }
        at += len;
    }
    at == size
}

#[test]
fn presets_shard_and_chunk_at_scale() {
    for preset in ModelPreset::ALL {
        let m = preset.tensors();
        for (tp_size, pp_size) in [(1, 1), (2, 1), (8, 4)] {
            let mut per_tensor: Vec<Vec<(u64, u64)>> = vec![Vec::new(); m.len()];
            for pp in 0..pp_size {
                for tp in 0..tp_size {
                    let c = ShardCoords::tensor_parallel(tp, tp_size, pp, pp_size);
                    let plan = RefitPlan::sharded(&m, 256 << 20, 256, c).unwrap();
                    for b in plan.buckets() {
                        assert!(b.used_bytes <= 256 << 20);
                    }
                    for s in plan.segments() {
                        assert_eq!(s.bucket_offset % 256, 0);
                        for r in 0..s.rows {
                            per_tensor[s.tensor as usize].push((s.dst_offset + r * s.dst_pitch, s.width));
                        }
                    }
                }
            }
            for (i, iv) in per_tensor.into_iter().enumerate() {
                assert!(tiles(iv, m[i].size_bytes()), "{preset} tp={tp_size} pp={pp_size}: {} not tiled", m[i].name);
            }
        }
    }
    // A 1 GiB-bucket plan of llama3-8b: the 1.05 GB embedding and lm_head are chunked, not refused.
    let m = ModelPreset::Llama3_8b.tensors();
    let plan = RefitPlan::new(&m, 1 << 30, 256).unwrap();
    assert_eq!(plan.stream_bytes(), 16_060_522_496);
    let embed_pieces = plan.segments().iter().filter(|s| s.tensor == 0).count();
    assert_eq!(embed_pieces, 1, "1.05 GB < 1 GiB: one piece");
    let small = RefitPlan::new(&m, 256 << 20, 256).unwrap();
    assert!(small.segments().iter().filter(|s| s.tensor == 0).count() >= 4);
}
