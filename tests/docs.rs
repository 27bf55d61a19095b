//! The README and `docs/` name only what exists: every relative link (`[text](path)`) and every
//! repository path in backticks (`` `model/src/block.rs` ``, `` `benches/gpu/run.sh` ``,
//! `` `checkpoint/src/{files,newest}.rs` ``) resolves to a file or folder of the repository.
//!
//! A backticked word is a repository path when it starts with one of the repository's top-level
//! entries (`src/`, `docs/`, `README.md`, …) and holds no spaces, globs or placeholders; a
//! `:line`, `#anchor` or `::item` after it is dropped; `{a,b}` expands to both. Paths relative to
//! a module (`conformance/c1_read.rs`) are not checked here.

use std::path::{Path, PathBuf};

/// The repository's root (this package's manifest directory).
fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// README.md and every `docs/*.md`.
fn documents() -> Vec<PathBuf> {
    let root = root();
    let mut docs = vec![root.join("README.md")];
    let mut entries: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .expect("docs/ is readable")
        .map(|e| e.expect("a docs/ entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    entries.sort();
    docs.extend(entries);
    docs
}

/// The repository's top-level files and folders that paths in the docs start from.
fn top_level() -> Vec<String> {
    std::fs::read_dir(root())
        .expect("the repository root is readable")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| !matches!(name.as_str(), "target" | ".git"))
        .collect()
}

/// `a/{b,c}.rs` → `a/b.rs`, `a/c.rs` (one brace group).
fn expand(path: &str) -> Vec<String> {
    match (path.find('{'), path.find('}')) {
        (Some(open), Some(close)) if open < close => path[open + 1..close]
            .split(',')
            .map(|part| format!("{}{part}{}", &path[..open], &path[close + 1..]))
            .collect(),
        _ => vec![path.to_string()],
    }
}

/// The repository paths a document names in backticks.
fn backticked_paths(text: &str, top: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    for (i, span) in text.split('`').enumerate() {
        // Odd pieces are inside backticks.
        if i % 2 == 0 || span.is_empty() || span.contains(char::is_whitespace) {
            continue;
        }
        if span.contains(['*', '<', '>', '$', '|', '(', '=']) || span.contains("..") {
            continue;
        }
        let span = span.strip_prefix("./").unwrap_or(span);
        let first = span.split('/').next().unwrap_or_default();
        let first = first.split(['#', ':']).next().unwrap_or_default();
        if !top.iter().any(|t| t == first) {
            continue;
        }
        // A single top-level word is a path only when it names a file (`README.md`), not a
        // crate's folder used as a word (`src`).
        if !span.contains('/') && !first.contains('.') {
            continue;
        }
        let path = span.split(['#', ':']).next().unwrap_or_default();
        out.extend(expand(path));
    }
    out
}

/// The relative targets of a document's markdown links (`](path)`), anchors dropped.
fn link_targets(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("](") {
        rest = &rest[at + 2..];
        let Some(end) = rest.find(')') else { break };
        let target = &rest[..end];
        rest = &rest[end..];
        if target.contains("://") || target.starts_with('#') || target.starts_with("mailto:") {
            continue;
        }
        let path = target.split('#').next().unwrap_or_default();
        if !path.is_empty() && !path.contains(char::is_whitespace) {
            out.push(path.to_string());
        }
    }
    out
}

#[test]
fn every_repository_path_and_link_in_the_docs_exists() {
    let root = root();
    let top = top_level();
    let mut missing = Vec::new();
    let mut checked = 0;
    for doc in documents() {
        let text = std::fs::read_to_string(&doc).expect("a readable document");
        let name = doc
            .strip_prefix(&root)
            .unwrap_or(&doc)
            .display()
            .to_string();
        for path in backticked_paths(&text, &top) {
            checked += 1;
            if !root.join(path.trim_end_matches('/')).exists() {
                missing.push(format!("{name}: `{path}`"));
            }
        }
        let dir = doc.parent().unwrap_or(Path::new("."));
        for target in link_targets(&text) {
            checked += 1;
            if !dir.join(&target).exists() {
                missing.push(format!("{name}: link to {target}"));
            }
        }
    }
    assert!(
        checked > 50,
        "only {checked} paths found in the docs: is the scan broken?"
    );
    assert!(
        missing.is_empty(),
        "the docs name {} paths that do not exist:\n{}",
        missing.len(),
        missing.join("\n")
    );
}

#[test]
fn the_scan_finds_paths_links_and_brace_groups() {
    let top = vec!["src".to_string(), "README.md".to_string(), "docs".into()];
    let text = "See `src/a.rs:12`, `src/{b,c}.rs`, `README.md#x`, `src`, `odc launch`, \
                `src/*.rs`, and [docs](docs/x.md#y) or [web](https://example.com).";
    assert_eq!(
        backticked_paths(text, &top),
        ["src/a.rs", "src/b.rs", "src/c.rs", "README.md"]
    );
    assert_eq!(link_targets(text), ["docs/x.md"]);
}
