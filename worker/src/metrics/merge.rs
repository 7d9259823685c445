//! Merging OpenMetrics expositions into one valid text: each family's metadata once, each
//! series once, `# EOF` once at the end.

use std::collections::{HashMap, HashSet};

/// The metric name and label set of a sample line (everything before the value), or None for a
/// malformed line.
pub(super) fn series_key(line: &str) -> Option<&str> {
    let bytes = line.as_bytes();
    let mut i = 0;
    while i < bytes.len() && bytes[i] != b'{' && bytes[i] != b' ' {
        i += 1;
    }
    if i == 0 || i == bytes.len() {
        return None;
    }
    if bytes[i] == b' ' {
        return Some(&line[..i]);
    }
    // Labels: scan to the closing brace outside quoted values.
    let mut quoted = false;
    let mut escaped = false;
    for (j, &b) in bytes.iter().enumerate().skip(i + 1) {
        match b {
            _ if escaped => escaped = false,
            b'\\' if quoted => escaped = true,
            b'"' => quoted = !quoted,
            b'}' if !quoted => return Some(&line[..=j]),
            _ => {}
        }
    }
    None
}

/// The metric name of a sample's series key.
fn sample_name(key: &str) -> &str {
    key.split('{').next().unwrap_or(key)
}

/// Whether sample `name` belongs to family `family` (the family name or a suffixed sample name).
fn belongs(name: &str, family: &str) -> bool {
    name == family
        || name.strip_prefix(family).is_some_and(|suffix| {
            ["_total", "_created", "_bucket", "_count", "_sum", "_info", "_gcount", "_gsum"].contains(&suffix)
        })
}

#[derive(Default)]
struct MergedFamily {
    kind: Option<String>,
    metadata: Vec<String>,
    samples: Vec<String>,
}

/// Merges OpenMetrics (or Prometheus text) expositions into one valid OpenMetrics text: every
/// family's `# HELP`/`# TYPE`/`# UNIT` once, all its samples together, `# EOF` once at the end.
///
/// Families keep the order in which they are first seen. A series (name and labels) that an
/// earlier exposition already had is dropped, and so is a family whose type disagrees with the
/// type seen first (logged): either would make the whole scrape invalid.
pub fn merge<'a>(expositions: impl IntoIterator<Item = &'a str>) -> String {
    let mut families: Vec<(String, MergedFamily)> = Vec::new();
    let mut index: HashMap<String, usize> = HashMap::new();
    let mut seen: HashSet<String> = HashSet::new();
    let mut family_of = |name: &str, families: &mut Vec<(String, MergedFamily)>| -> usize {
        *index.entry(name.to_string()).or_insert_with(|| {
            families.push((name.to_string(), MergedFamily::default()));
            families.len() - 1
        })
    };
    for text in expositions {
        // The family the following samples belong to, and whether this text's copy is dropped.
        let mut current: Option<(usize, bool)> = None;
        for line in text.lines() {
            let line = line.trim_end();
            if line.is_empty() {
                continue;
            }
            if line == "# EOF" {
                break;
            }
            if let Some(rest) = line.strip_prefix('#') {
                let mut parts = rest.trim_start().splitn(3, ' ');
                let (Some(keyword), Some(name)) = (parts.next(), parts.next()) else { continue };
                if !matches!(keyword, "HELP" | "TYPE" | "UNIT") {
                    continue; // a plain comment: not allowed in OpenMetrics, dropped
                }
                let i = family_of(name, &mut families);
                let dropped = match current {
                    Some((c, dropped)) if c == i => dropped,
                    _ => false,
                };
                let family = &mut families[i].1;
                let dropped = if keyword == "TYPE" {
                    let kind = parts.next().unwrap_or("unknown").trim().to_string();
                    match &family.kind {
                        None => {
                            family.kind = Some(kind);
                            family.metadata.push(line.to_string());
                            false
                        }
                        Some(k) if *k == kind => dropped,
                        Some(k) => {
                            tracing::warn!(family = name, first = %k, other = %kind, "metric family exported with two types; dropping the second");
                            true
                        }
                    }
                } else {
                    if !family
                        .metadata
                        .iter()
                        .any(|m| m.strip_prefix('#').map(str::trim_start).is_some_and(|m| m.starts_with(keyword)))
                    {
                        family.metadata.push(line.to_string());
                    }
                    dropped
                };
                current = Some((i, dropped));
                continue;
            }
            let Some(key) = series_key(line) else { continue };
            let name = sample_name(key);
            let (i, dropped) = match current {
                Some((c, dropped)) if belongs(name, &families[c].0) => (c, dropped),
                _ => {
                    let i = family_of(name, &mut families);
                    current = Some((i, false));
                    (i, false)
                }
            };
            if dropped || !seen.insert(key.to_string()) {
                continue;
            }
            families[i].1.samples.push(line.to_string());
        }
    }
    let mut out = String::new();
    for (_, f) in &families {
        for m in &f.metadata {
            out.push_str(m);
            out.push('\n');
        }
        for s in &f.samples {
            out.push_str(s);
            out.push('\n');
        }
    }
    out.push_str("# EOF\n");
    out
}
