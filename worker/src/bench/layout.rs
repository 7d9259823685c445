//! `rlplane bench layout MANIFEST`: what a job's refit plan makes every GPU's links carry, and the
//! refit time that predicts, without running anything — so layouts no machine here can hold (eight
//! engines, say) are planned and checked before a GPU is spent on them.
//!
//! The plan is the one `rlplane local` builds for the manifest (pods one after another on one
//! machine's GPUs). The model of each refit group's transport:
//! - CUDA IPC: each receiver copies every byte of every sender of its group once; a sender on the
//!   receiver's GPU is a local device copy, any other is that many bytes out of the sender's GPU
//!   and into the receiver's over NVLink;
//! - NCCL: each sender's bytes go round a ring of the sender and the receivers: every member but
//!   the last sends them once, every receiver takes them in once;
//! - TCP: the same relay chain, over host memory and the network (no GPU link).
//!
//! Every GPU's local copies, link ingress and link egress run at once, so the predicted refit is
//! the slowest of them over all GPUs at the given bandwidths (by default those measured on
//! 4 × H100 NV18 in docs/benchmarks.md).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::Context;
use rlplane_api::plan::{GroupTransport, WorkerPlan};
use rlplane_api::topology::{JobIdentity, build_plan};

/// Arguments of `rlplane bench layout`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The RLJob manifest (YAML) whose refit is planned.
    pub manifest: PathBuf,
    /// GB/s of one device-to-device copy on a GPU (an H100: 16.06 GB in 10.62 ms).
    #[arg(long, default_value_t = 1512.0)]
    pub local_gbps: f64,
    /// GB/s into (and out of) one GPU over NVLink (a raw NCCL broadcast on H100 NV18).
    #[arg(long, default_value_t = 364.0)]
    pub link_gbps: f64,
}

/// Bytes one GPU moves in a refit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GpuLoad {
    /// Copied from a sender on the same GPU.
    pub local: u64,
    /// Taken in over its links.
    pub link_in: u64,
    /// Sent out over its links.
    pub link_out: u64,
}

/// What every GPU (by its index on the machine) moves in one refit of `plan`, given each
/// process's GPU and each sender's bytes. TCP groups move nothing over GPU links.
pub fn gpu_loads(
    plan: &WorkerPlan,
    gpu_of: &dyn Fn(u32) -> Option<u32>,
    sender_bytes: &dyn Fn(u32) -> u64,
) -> BTreeMap<u32, GpuLoad> {
    let mut loads: BTreeMap<u32, GpuLoad> = BTreeMap::new();
    for g in &plan.refit_groups {
        for &s in &g.senders {
            let bytes = sender_bytes(s);
            match g.transport {
                GroupTransport::CudaIpc => {
                    for &r in &g.receivers {
                        let (Some(from), Some(to)) = (gpu_of(s), gpu_of(r)) else { continue };
                        if from == to {
                            loads.entry(to).or_default().local += bytes;
                        } else {
                            loads.entry(from).or_default().link_out += bytes;
                            loads.entry(to).or_default().link_in += bytes;
                        }
                    }
                }
                GroupTransport::Nccl => {
                    let ring: Vec<u32> = std::iter::once(s).chain(g.receivers.iter().copied()).collect();
                    for (i, &m) in ring.iter().enumerate() {
                        let Some(gpu) = gpu_of(m) else { continue };
                        let load = loads.entry(gpu).or_default();
                        if i > 0 {
                            load.link_in += bytes;
                        }
                        if i + 1 < ring.len() {
                            load.link_out += bytes;
                        }
                    }
                }
                GroupTransport::Tcp => {}
            }
        }
    }
    loads
}

/// The predicted refit in seconds: the busiest GPU's slowest part.
pub fn predicted_secs(loads: &BTreeMap<u32, GpuLoad>, local_gbps: f64, link_gbps: f64) -> f64 {
    loads.values().map(|l| gpu_secs(l, local_gbps, link_gbps)).fold(0.0, f64::max)
}

fn gpu_secs(l: &GpuLoad, local_gbps: f64, link_gbps: f64) -> f64 {
    let local = l.local as f64 / (local_gbps * 1e9);
    let link = l.link_in.max(l.link_out) as f64 / (link_gbps * 1e9);
    local.max(link)
}

/// Runs `rlplane bench layout`.
pub fn run(a: Args) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(&a.manifest).with_context(|| format!("reading {}", a.manifest.display()))?;
    let job = rlplane_api::load_rljob(&text).map_err(|e| anyhow::anyhow!("{}: {e}", a.manifest.display()))?;
    let id =
        JobIdentity { name: "layout".into(), namespace: "local".into(), uid: "layout".into(), epoch: 0, resume: None };
    let scratch = std::env::temp_dir().join(format!("rlplane-layout-{}", std::process::id()));
    let plan = build_plan(&job.spec, &id, &crate::local::LocalAddressing::new(&scratch))
        .map_err(|e| anyhow::anyhow!("{}: {e}", a.manifest.display()))?;
    print!("{}", report(&a, &plan)?);
    Ok(())
}

/// The printout: each group, each GPU's load and the prediction.
fn report(a: &Args, plan: &WorkerPlan) -> anyhow::Result<String> {
    let bases = crate::local::gpu_bases(plan, usize::MAX)?;
    let gpu_of = |i: u32| {
        let p = plan.process(i);
        p.gpu.map(|slot| bases[p.pod as usize] + slot)
    };
    let mut bytes = BTreeMap::new();
    for g in &plan.refit_groups {
        for &s in &g.senders {
            bytes.insert(s, crate::refit::sender_plan(plan, s)?.segments().iter().map(|x| x.bytes()).sum::<u64>());
        }
    }
    let loads = gpu_loads(plan, &gpu_of, &|s| bytes[&s]);
    let gb = |b: u64| b as f64 / 1e9;
    let mut out = String::new();
    let gpus: u32 = plan.pods.iter().map(|p| p.gpus).sum();
    writeln!(out, "{}: {gpus} GPUs, {} refit group(s)", a.manifest.display(), plan.refit_groups.len())?;
    for g in &plan.refit_groups {
        let at = |i: u32| gpu_of(i).map_or("host".to_string(), |gpu| format!("GPU {gpu}"));
        let senders: Vec<String> = g
            .senders
            .iter()
            .map(|&s| format!("{} ({}, {:.2} GB)", plan.process(s).name, at(s), gb(bytes[&s])))
            .collect();
        let receivers: Vec<String> =
            g.receivers.iter().map(|&r| format!("{} ({})", plan.process(r).name, at(r))).collect();
        writeln!(out, "  {} [{}]: {} -> {}", g.name, g.transport.name(), senders.join(", "), receivers.join(", "))?;
    }
    writeln!(out, "  GPU   local copy   link in    link out   time at {} / {} GB/s", a.local_gbps, a.link_gbps)?;
    for (gpu, l) in &loads {
        let secs = gpu_secs(l, a.local_gbps, a.link_gbps);
        let (local, link_in, link_out) = (gb(l.local), gb(l.link_in), gb(l.link_out));
        writeln!(out, "  {gpu:<5} {local:>7.2} GB {link_in:>7.2} GB {link_out:>8.2} GB   {:>7.1} ms", secs * 1e3)?;
    }
    let predicted = predicted_secs(&loads, a.local_gbps, a.link_gbps);
    writeln!(out, "  predicted refit: {:.1} ms (the busiest GPU's slowest part)", predicted * 1e3)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan_of(yaml: &str) -> WorkerPlan {
        let job = rlplane_api::load_rljob(yaml).unwrap();
        let id = JobIdentity { name: "t".into(), namespace: "n".into(), uid: "u".into(), epoch: 0, resume: None };
        let dir = tempfile::tempdir().unwrap();
        build_plan(&job.spec, &id, &crate::local::LocalAddressing::new(dir.path())).unwrap()
    }

    fn manifest(path: &str) -> String {
        std::fs::read_to_string(format!("{}/../{path}", env!("CARGO_MANIFEST_DIR"))).unwrap()
    }

    #[test]
    fn colocated_replicas_each_copy_their_shard_locally_and_pull_the_other_once() {
        for (path, gpus) in [("manifests/rljob-gpu-colocated-4.yaml", 4), ("bench/layouts/rljob-colocated-8.yaml", 8)] {
            let plan = plan_of(&manifest(path));
            let gpu_of = |i: u32| plan.process(i).gpu;
            let loads = gpu_loads(&plan, &gpu_of, &|_| 8);
            assert_eq!(loads.len(), gpus, "{path}");
            for (gpu, l) in &loads {
                assert_eq!(*l, GpuLoad { local: 8, link_in: 8, link_out: 8 }, "{path}: GPU {gpu}");
            }
            // 8 GB at 1.6 TB/s locally, 8 GB at 400 GB/s over NVLink: the link bounds it.
            let secs = predicted_secs(&gpu_loads(&plan, &gpu_of, &|_| 8_000_000_000), 1600.0, 400.0);
            assert!((secs - 0.020).abs() < 1e-9, "{path}: {secs}");
        }
    }

    #[test]
    fn an_nccl_ring_sends_from_every_member_but_the_last() {
        let plan = plan_of(&manifest("manifests/rljob-gpu-4.yaml"));
        let bases = crate::local::gpu_bases(&plan, usize::MAX).unwrap();
        let gpu_of = |i: u32| plan.process(i).gpu.map(|s| bases[plan.process(i).pod as usize] + s);
        let loads = gpu_loads(&plan, &gpu_of, &|_| 1);
        let total_in: u64 = loads.values().map(|l| l.link_in).sum();
        let total_out: u64 = loads.values().map(|l| l.link_out).sum();
        let g = &plan.refit_groups[0];
        assert_eq!(g.transport, GroupTransport::Nccl);
        let n = (g.senders.len() * g.receivers.len()) as u64;
        assert_eq!((total_in, total_out), (n, n), "{loads:?}");
    }
}
