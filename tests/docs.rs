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

/// Every document, its name from the root, and its text.
fn read_documents() -> Vec<(PathBuf, String, String)> {
    let root = root();
    documents()
        .into_iter()
        .map(|doc| {
            let text = std::fs::read_to_string(&doc).expect("a readable document");
            let name = doc
                .strip_prefix(&root)
                .unwrap_or(&doc)
                .display()
                .to_string();
            (doc, name, text)
        })
        .collect()
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
    for (doc, name, text) in read_documents() {
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

/// The decimal numbers of `text` outside backticks (`1.28x` → `1.28`, `0.996–0.999` → both).
fn decimals(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (i, part) in text.split('`').enumerate() {
        if i % 2 == 1 {
            continue; // inside backticks: a command, not a figure
        }
        let chars: Vec<char> = part.chars().collect();
        let mut k = 0;
        while k < chars.len() {
            // A figure starts after no letter, digit or point (not `v0.19`, not `x1.5`).
            let starts = chars[k].is_ascii_digit()
                && (k == 0 || !(chars[k - 1].is_alphanumeric() || chars[k - 1] == '.'));
            if !starts {
                k += 1;
                continue;
            }
            let mut end = k;
            while end < chars.len() && chars[end].is_ascii_digit() {
                end += 1;
            }
            let decimal =
                end + 1 < chars.len() && chars[end] == '.' && chars[end + 1].is_ascii_digit();
            if decimal {
                end += 1;
                while end < chars.len() && chars[end].is_ascii_digit() {
                    end += 1;
                }
                let version =
                    end + 1 < chars.len() && chars[end] == '.' && chars[end + 1].is_ascii_digit();
                if !version {
                    out.push(chars[k..end].iter().collect());
                }
            }
            k = end;
        }
    }
    out
}

/// Whether `number` stands in `text` as a number of its own (not inside a longer one).
fn shows(text: &str, number: &str) -> bool {
    text.match_indices(number).any(|(at, _)| {
        let before = text[..at].chars().next_back();
        let after = text[at + number.len()..].chars().next();
        !before.is_some_and(|c| c.is_ascii_digit() || c == '.')
            && !after.is_some_and(|c| c.is_ascii_digit())
    })
}

/// The headline table's rows (`## Where the numbers are` in the README): each row's text and the
/// `docs/` pages it links.
fn headline_rows(readme: &str) -> Vec<(String, Vec<String>)> {
    let start = readme
        .find("## Where the numbers are")
        .expect("the README's headline section");
    let section = &readme[start..];
    let end = section[3..].find("\n## ").map_or(section.len(), |e| e + 3);
    section[..end]
        .lines()
        .filter(|l| l.starts_with("| ") && !l.starts_with("| question"))
        .map(|l| (l.to_string(), link_targets(l)))
        .collect()
}

/// The figures of `rows` that none of their pages shows, as "row: figure".
fn figures_missing(rows: &[(String, Vec<String>)], page: impl Fn(&str) -> String) -> Vec<String> {
    let mut missing = Vec::new();
    for (row, pages) in rows {
        let text: String = pages.iter().map(|p| page(p)).collect();
        // The figures are in every cell but the last (the page links).
        let figures = &row[..row.rfind(" | ").unwrap_or(row.len())];
        for number in decimals(figures) {
            if !shows(&text, &number) {
                let what: String = row.chars().take(60).collect();
                missing.push(format!("{what}…: {number} is not on {pages:?}"));
            }
        }
    }
    missing
}

#[test]
fn every_headline_figure_is_on_the_page_it_links() {
    let root = root();
    let readme = std::fs::read_to_string(root.join("README.md")).expect("README.md");
    let rows = headline_rows(&readme);
    assert!(rows.len() >= 10, "only {} headline rows found", rows.len());
    assert!(
        rows.iter().all(|(_, pages)| !pages.is_empty()),
        "a headline row links no page"
    );
    let missing = figures_missing(&rows, |p| {
        std::fs::read_to_string(root.join(p)).unwrap_or_default()
    });
    assert!(
        missing.is_empty(),
        "headline figures without their page:\n{}",
        missing.join("\n")
    );
}

#[test]
fn a_headline_figure_its_page_does_not_show_is_caught() {
    let rows = headline_rows(
        "## Where the numbers are\n| question | x |\n| a | 1.28x, control 1.01x (`ab --quick 2.5`) \
         | [p](docs/p.md) |\n\n## Next\n| b | 9.99 | [q](docs/q.md) |",
    );
    assert_eq!(rows.len(), 1);
    let page = |_: &str| "reads 1.28x; control 1.013".to_string();
    let missing = figures_missing(&rows, page);
    assert_eq!(missing.len(), 1, "{missing:?}"); // 1.01 is not 1.013; 2.5 is a command's
    assert!(missing[0].contains("1.01 is not"), "{missing:?}");
    assert_eq!(
        decimals("0.996–0.999, 3 of 1,024, `x 1.5` v0.19.10"),
        ["0.996", "0.999"]
    );
}

/// The words of odc a page may use only if the glossary explains them (`**word**` there).
const TERMS: &[&str] = &[
    "I1",
    "I2",
    "I3",
    "I4",
    "I5",
    "I6",
    "C1",
    "C2",
    "C3",
    "C4",
    "C5",
    "C6",
    "C7",
    "C8",
    "ABBA",
    "control",
    "LB-Mini",
    "LB-Micro",
    "gang",
    "published copy",
    "served unit",
    "relayed pushes",
    "lease",
    "HPZ",
    "MFU",
    "eval loss",
    "static CP",
    "TE CP",
    "lockstep",
    "straggler",
    "dynamic CP",
    "achievable bound",
    "perfect balance",
    "virtual time",
    "zig-zag",
    "shard server",
    "trainer",
    "supervisor",
    "unit",
    "token budget",
];

/// Whether `text` uses `term` as a word of its own.
fn uses(text: &str, term: &str) -> bool {
    text.match_indices(term).any(|(at, _)| {
        let before = text[..at].chars().next_back();
        let after = text[at + term.len()..].chars().next();
        let word = |c: char| c.is_alphanumeric() || c == '_';
        !before.is_some_and(word) && !after.is_some_and(word)
    })
}

#[test]
fn every_term_the_docs_use_is_in_the_glossary_and_no_page_speaks_of_issue_numbers() {
    let root = root();
    let glossary = std::fs::read_to_string(root.join("docs/glossary.md")).expect("the glossary");
    let mut wrong = Vec::new();
    for (_, name, text) in read_documents() {
        for term in TERMS.iter().filter(|t| uses(&text, t)) {
            let defined = glossary.contains(&format!("**{term}**"))
                || glossary.contains(&format!("**{term} "));
            if !defined {
                wrong.push(format!(
                    "{name} uses {term:?}, which docs/glossary.md does not explain"
                ));
            }
        }
        for (at, _) in text
            .match_indices("issue ")
            .chain(text.match_indices("Issue "))
        {
            if text[at + 6..].starts_with(|c: char| c.is_ascii_digit()) {
                let line = text[..at].lines().count();
                wrong.push(format!("{name}:{line} names an issue number"));
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}
