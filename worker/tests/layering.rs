//! The worker's layering, checked on its sources: the libraries (refit, the transports, the
//! transfer queue, GPU plumbing, the wire helpers) import nothing from the process layer (roles,
//! the sidecar's local API, the pod and local runners, the coordinator, the metrics registry),
//! and the process layer's import graph has no cycle (the libraries counted as one node: refit
//! and its transports share memory types by design).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The library modules: what the sidecar API, the synthetic roles and the benchmarks share.
const LIBRARIES: &[&str] =
    &["digest", "gpu", "hot_wait", "link", "net", "patience", "refit", "shm", "transport", "tq", "workload"];

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).expect("read worker/src") {
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

/// Top-level modules a file names as `crate::<module>`, outside comments.
fn imports(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in text.lines() {
        let code = line.split("//").next().unwrap_or("");
        let mut rest = code;
        while let Some(i) = rest.find("crate::") {
            let tail = &rest[i + "crate::".len()..];
            let name: String = tail.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            if !name.is_empty() {
                out.insert(name);
            }
            rest = tail;
        }
    }
    out
}

/// A library module counts as the one node `libraries` in the cycle check.
fn collapse(m: String) -> String {
    if LIBRARIES.contains(&m.as_str()) { "libraries".into() } else { m }
}

/// Top-level module → the modules it imports.
fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in files {
        let m = collapse(module_of(&src, &f));
        if m == "lib" || m == "main" {
            continue;
        }
        let text = std::fs::read_to_string(&f).expect("read a source file");
        let deps = g.entry(m.clone()).or_default();
        deps.extend(imports(&text).into_iter().map(collapse).filter(|d| *d != m));
    }
    g
}

#[test]
fn libraries_import_no_process_layer_module() {
    let g = graph();
    let wrong: Vec<String> =
        g.get("libraries").into_iter().flatten().map(|dep| format!("a library imports crate::{dep}")).collect();
    assert!(wrong.is_empty(), "a library imports the process layer: {wrong:?}");
}

#[test]
fn module_graph_has_no_cycle() {
    let g = graph();
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
