//! Where a pod that runs as processes of this machine finds what a kubelet, a CNI and cluster DNS
//! would give it in a cluster: the test harness's one seam into the worker's plan.
//!
//! The plan the operator builds names pods by their headless-Service DNS names, binds `0.0.0.0`
//! and puts sockets and the key at fixed paths inside the pod ([`rlplane_api::topology`]). The
//! node agent runs every pod of a test cluster on one host without namespaces: each pod gets a
//! loopback address of its own and its volumes under a directory of its own. So, as it lays out
//! the plan's ConfigMap, it writes the plan the pod would see through its own network and mount
//! namespaces: peers' addresses instead of their names, its own address to bind, and volume
//! paths rewritten. The worker itself only ever reads the plan.

use std::collections::HashMap;
use std::path::PathBuf;

use rlplane_api::WorkerPlan;

/// One pod's place on this machine.
#[derive(Clone, Debug, Default)]
pub struct Placement {
    /// The pod's name in the plan.
    pub pod: String,
    /// A pod's host as the plan names it (its DNS name) → the address it is reached at.
    pub addresses: HashMap<String, String>,
    /// The address the pod's listeners bind.
    pub bind_host: String,
    /// Mount path inside the pod → the directory (or file) it is on this machine.
    pub mounts: Vec<(String, PathBuf)>,
}

/// Rewrites `plan` for the pod of `at`: every pod's host it knows an address for, this pod's
/// bind address and socket directory, and the key file's path.
pub fn localize_plan(plan: &mut WorkerPlan, at: &Placement) {
    for p in &mut plan.pods {
        if let Some(address) = at.addresses.get(&p.host) {
            p.host = address.clone();
        }
        if p.name == at.pod {
            p.bind_host = at.bind_host.clone();
            p.ipc_dir = rewrite_path(&p.ipc_dir, &at.mounts);
        }
    }
    plan.job.key_file = rewrite_path(&plan.job.key_file, &at.mounts);
}

/// `s` with a leading mount path replaced by the directory it is on this machine (the longest
/// match), as a container's paths are under its volumes.
pub fn rewrite_path(s: &str, mounts: &[(String, PathBuf)]) -> String {
    let best = mounts
        .iter()
        .filter(|(m, _)| s == m || s.starts_with(&format!("{}/", m.trim_end_matches('/'))))
        .max_by_key(|(m, _)| m.len());
    match best {
        Some((m, dir)) => format!("{}{}", dir.display(), &s[m.trim_end_matches('/').len()..]),
        None => s.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_mount_wins_and_other_paths_stay() {
        let mounts = vec![("/etc".to_string(), PathBuf::from("/x/etc")), ("/etc/key/".into(), PathBuf::from("/k"))];
        assert_eq!(rewrite_path("/etc/key/key", &mounts), "/k/key");
        assert_eq!(rewrite_path("/etc/plan.json", &mounts), "/x/etc/plan.json");
        assert_eq!(rewrite_path("/etcetera", &mounts), "/etcetera");
        assert_eq!(rewrite_path("/etc", &mounts), "/x/etc");
    }
}
