//! No function on a product path is longer than [`MAX_LINES`] (issue 23): the crates a job runs
//! (api, operator, wire, tq, refit, the worker without its benchmarks) are read function by
//! function, and a function past a screenful is where decisions hide inside plumbing. Tests,
//! benchmarks and examples are not product paths.

use std::path::{Path, PathBuf};

/// Longest function allowed, in lines from its `fn` to its closing brace.
const MAX_LINES: usize = 120;

/// The product crates' source directories, and what under them is not a product path.
const ROOTS: [&str; 6] = ["api/src", "operator/src", "wire/src", "tq/src", "refit/src", "worker/src"];
const EXCLUDED: [&str; 1] = ["worker/src/bench"];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The source with comments and string and character literals blanked (lines kept), so that
/// braces and `fn` are only ever code.
fn code_only(text: &str) -> String {
    let b: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    let blank = |c: char| if c == '\n' { '\n' } else { ' ' };
    while i < b.len() {
        let c = b[i];
        if c == '/' && b.get(i + 1) == Some(&'/') {
            while i < b.len() && b[i] != '\n' {
                out.push(' ');
                i += 1;
            }
        } else if c == '/' && b.get(i + 1) == Some(&'*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == '/' && b.get(i + 1) == Some(&'*') {
                    depth += 1;
                    out.push_str("  ");
                    i += 2;
                } else if b[i] == '*' && b.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    out.push_str("  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    out.push(blank(b[i]));
                    i += 1;
                }
            }
        } else if c == 'r' && (b.get(i + 1) == Some(&'"') || b.get(i + 1) == Some(&'#')) && !ident_before(&b, i) {
            // A raw string: r"…" or r#"…"#.
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) != Some(&'"') {
                out.push(c);
                i += 1;
                continue;
            }
            let close: Vec<char> = std::iter::once('"').chain(std::iter::repeat_n('#', hashes)).collect();
            j += 1;
            while j < b.len() && !b[j..].starts_with(&close) {
                j += 1;
            }
            let end = (j + close.len()).min(b.len());
            out.extend(b[i..end].iter().map(|&c| blank(c)));
            i = end;
        } else if c == '"' {
            out.push(' ');
            i += 1;
            while i < b.len() && b[i] != '"' {
                let step = if b[i] == '\\' { 2 } else { 1 };
                out.extend(b[i..(i + step).min(b.len())].iter().map(|&c| blank(c)));
                i += step;
            }
            out.push(' ');
            i += 1;
        } else if c == '\'' && (b.get(i + 2) == Some(&'\'') || b.get(i + 1) == Some(&'\\')) {
            // A character literal ('{', '\n', '\u{7b}'); a lifetime ('a) has no closing quote.
            let mut j = i + 1;
            while j < b.len() && b[j] != '\'' {
                j += if b[j] == '\\' { 2 } else { 1 };
            }
            out.extend(b[i..=j.min(b.len() - 1)].iter().map(|&c| blank(c)));
            i = j + 1;
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

fn ident_before(b: &[char], i: usize) -> bool {
    i > 0 && (b[i - 1].is_alphanumeric() || b[i - 1] == '_')
}

/// `(name, first line, lines)` of every function with a body.
fn functions(code: &str) -> Vec<(String, usize, usize)> {
    let lines: Vec<&str> = code.lines().collect();
    let mut found = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let Some(name) = fn_name(lines[i]) else {
            i += 1;
            continue;
        };
        let (mut depth, mut opened, mut j) = (0i32, false, i);
        // The first line from its `fn` on: what comes before (`trait T {`) is not the body.
        let start = lines[i].find("fn ").unwrap_or(0);
        'body: while j < lines.len() {
            let line = if j == i { &lines[j][start..] } else { lines[j] };
            for ch in line.chars() {
                match ch {
                    '{' => (depth, opened) = (depth + 1, true),
                    '}' => depth -= 1,
                    ';' if !opened => break 'body,
                    _ => {}
                }
                if opened && depth == 0 {
                    break 'body;
                }
            }
            j += 1;
        }
        if opened {
            found.push((name, i + 1, j - i + 1));
        }
        i = j.max(i) + 1;
    }
    found
}

fn fn_name(line: &str) -> Option<String> {
    let words: Vec<&str> = line.split_whitespace().collect();
    let at = words.iter().position(|w| *w == "fn")?;
    let name: String = words.get(at + 1)?.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
    (!name.is_empty()).then_some(name)
}

#[test]
fn no_function_on_a_product_path_is_longer_than_120_lines() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = Vec::new();
    for dir in ROOTS {
        rust_files(&root.join(dir), &mut files);
    }
    let mut long = Vec::new();
    for file in files {
        let shown = file.strip_prefix(&root).unwrap().display().to_string();
        if EXCLUDED.iter().any(|e| shown.starts_with(e)) {
            continue;
        }
        let code = code_only(&std::fs::read_to_string(&file).unwrap());
        for (name, line, lines) in functions(&code) {
            if lines > MAX_LINES {
                long.push(format!("{shown}:{line} {name}(): {lines} lines"));
            }
        }
    }
    assert!(long.is_empty(), "functions over {MAX_LINES} lines (split them into named steps):\n{}", long.join("\n"));
}

#[test]
fn the_scanner_sees_through_strings_comments_and_characters() {
    let src = "fn a() {\n    let s = \"{ not a brace\";\n    // { nor this\n    let c = '{';\n    let r = r#\"}\"#;\n}\nfn b<'x>(v: &'x str) -> &'x str {\n    v\n}\ntrait T { fn c(&self); }\n";
    let got = functions(&code_only(src));
    assert_eq!(got, [("a".to_string(), 1, 6), ("b".to_string(), 7, 3)]);
}
