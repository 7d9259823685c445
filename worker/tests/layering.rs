//! The worker's layering, checked on its sources and manifests. Crates by layer, so that a
//! wrong-way import does not compile:
//!
//! ```text
//!   rlplane (the process: roles, sidecar, coordinator, control, pod, local, supervisor, metrics, …)
//!     ├── rlplane-tq     (the transfer queue)
//!     ├── rlplane-refit  (plan and memory → GPU access and transports → streaming engine, verify)
//!     │      both on
//!     └── rlplane-wire   (sockets, framing, handshake, key files, links, shared memory, processes)
//!            on rlplane-api (the RLJob, the plan's types; pure)
//! ```
//!
//! Cargo refuses a cycle between crates; these tests pin the allowed edges (the transfer queue and
//! refit know nothing of each other), the layers inside `rlplane-refit`, which one crate cannot
//! enforce, and that the process layer's own modules import each other without a cycle.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the repository").to_path_buf()
}

/// The `rlplane*` crates a crate's `[dependencies]` name (dev-dependencies aside).
fn rlplane_dependencies(dir: &str) -> BTreeSet<String> {
    let text = std::fs::read_to_string(repo().join(dir).join("Cargo.toml")).expect("read Cargo.toml");
    let mut deps = BTreeSet::new();
    let mut section = String::new();
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            section = line.to_string();
        } else if section == "[dependencies]" && line.starts_with("rlplane") {
            deps.insert(line.split([' ', '=']).next().unwrap_or_default().to_string());
        }
    }
    deps
}

#[test]
fn each_crate_depends_only_on_the_layers_below_it() {
    let allowed: &[(&str, &[&str])] = &[
        ("wire", &["rlplane-api"]),
        ("tq", &["rlplane-api", "rlplane-wire"]),
        ("refit", &["rlplane-api", "rlplane-wire"]),
        ("worker", &["rlplane-api", "rlplane-refit", "rlplane-tq", "rlplane-wire"]),
    ];
    for (dir, want) in allowed {
        let have = rlplane_dependencies(dir);
        let want: BTreeSet<String> = want.iter().map(|s| s.to_string()).collect();
        assert_eq!(have, want, "{dir}/Cargo.toml: its rlplane dependencies are not its layer's");
    }
}

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).expect("read a source directory") {
        let p = e.expect("a directory entry").path();
        if p.is_dir() {
            sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The top-level module a source file belongs to (`refit/stream.rs` → `refit`).
fn module_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).expect("under src");
    let first = rel.components().next().expect("a component").as_os_str().to_string_lossy().to_string();
    first.trim_end_matches(".rs").to_string()
}

/// Top-level modules a file names as `crate::<module>` (and, in a file at the crate's top level,
/// `super::<module>`), outside comments.
fn imports(text: &str, top_level: bool) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let prefixes: &[&str] = if top_level { &["crate::", "super::"] } else { &["crate::"] };
    for line in text.lines() {
        let code = line.split("//").next().unwrap_or("");
        for prefix in prefixes {
            let mut rest = code;
            while let Some(i) = rest.find(prefix) {
                let tail = &rest[i + prefix.len()..];
                let name: String = tail.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
                if !name.is_empty() {
                    out.insert(name);
                }
                rest = tail;
            }
        }
    }
    out
}

/// Top-level module → the top-level modules it imports, for the crate at `dir`.
fn graph(dir: &str) -> BTreeMap<String, BTreeSet<String>> {
    let src = repo().join(dir).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in files {
        let m = module_of(&src, &f);
        if m == "lib" || m == "main" {
            continue;
        }
        let text = std::fs::read_to_string(&f).expect("read a source file");
        let top_level = f.parent() == Some(src.as_path());
        let deps = g.entry(m.clone()).or_default();
        deps.extend(imports(&text, top_level).into_iter().filter(|d| *d != m));
    }
    g
}

#[test]
fn refit_modules_import_only_the_layers_below_them() {
    // Bottom to top; a module may import its own layer and those below (the crate root, which
    // derives streams from the WorkerPlan, sits above them all).
    let layers: &[&[&str]] = &[&["plan", "memory", "digest"], &["gpu"], &["transport"], &["stream", "verify"]];
    let layer_of = |m: &str| layers.iter().position(|l| l.contains(&m));
    let g = graph("refit");
    let mut wrong = Vec::new();
    for (m, deps) in &g {
        let mine = layer_of(m).unwrap_or_else(|| panic!("refit/src/{m}: a module no layer names; add it to this test"));
        for d in deps {
            match layer_of(d) {
                Some(theirs) if theirs <= mine => {}
                Some(_) => wrong.push(format!("{m} imports {d}, a layer above it")),
                None => wrong.push(format!("{m} imports crate::{d}, the crate root above every module")),
            }
        }
    }
    assert!(wrong.is_empty(), "refit's layers are crossed the wrong way: {wrong:?}");
}

#[test]
fn process_modules_import_each_other_without_a_cycle() {
    let g = graph("worker");
    // Depth-first search with colours; a grey node reached again closes a cycle.
    fn visit<'a>(
        n: &'a str,
        g: &'a BTreeMap<String, BTreeSet<String>>,
        colour: &mut BTreeMap<&'a str, u8>,
        path: &mut Vec<&'a str>,
    ) -> Option<Vec<String>> {
        match colour.get(n) {
            Some(1) => {
                let at = path.iter().position(|p| *p == n).unwrap_or(0);
                let mut cycle: Vec<String> = path[at..].iter().map(|s| s.to_string()).collect();
                cycle.push(n.to_string());
                return Some(cycle);
            }
            Some(2) => return None,
            _ => {}
        }
        colour.insert(n, 1);
        path.push(n);
        for d in g.get(n).into_iter().flatten() {
            if let Some(c) = visit(d, g, colour, path) {
                return Some(c);
            }
        }
        path.pop();
        colour.insert(n, 2);
        None
    }
    let mut colour = BTreeMap::new();
    for n in g.keys() {
        if let Some(cycle) = visit(n, &g, &mut colour, &mut Vec::new()) {
            panic!("the worker's modules import each other in a circle: {}", cycle.join(" → "));
        }
    }
}

#[test]
fn the_roles_import_neither_each_other_nor_the_runners() {
    let roles = repo().join("worker/src/roles");
    for (file, forbidden) in [
        ("trainer.rs", &["super::generation", "roles::generation", "crate::local", "crate::pod"][..]),
        ("generation.rs", &["super::trainer", "roles::trainer", "crate::local", "crate::pod"][..]),
    ] {
        let text = std::fs::read_to_string(roles.join(file)).expect("read a role");
        for f in forbidden {
            assert!(
                !text.lines().any(|l| l.split("//").next().unwrap_or("").contains(f)),
                "roles/{file} imports {f}: what both roles share belongs in roles/refit_side.rs or roles/mod.rs"
            );
        }
    }
}
