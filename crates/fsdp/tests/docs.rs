//! The README and the guides in docs/ link to each other and to files in the repository:
//! every relative link must lead to a file that exists, and every `#anchor` to a heading of
//! that file (GitHub's anchors: the heading in lower case, punctuation dropped, spaces as
//! hyphens), so a moved or renamed section cannot leave a dead link. And the examples, which
//! users copy, import only the library's user-facing modules.

use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// GitHub's anchor of a heading's text.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// `text`'s lines outside fenced code blocks.
fn prose_lines(text: &str) -> impl Iterator<Item = &str> {
    let mut fenced = false;
    text.lines().filter(move |line| {
        if line.starts_with("```") {
            fenced = !fenced;
            return false;
        }
        !fenced
    })
}

/// The anchors of `text`'s headings (outside code blocks).
fn anchors(text: &str) -> Vec<String> {
    prose_lines(text)
        .filter(|line| line.starts_with('#'))
        .map(|line| anchor(line.trim_start_matches('#')))
        .collect()
}

/// The targets of `text`'s inline links `[..](target)`, outside code blocks and code spans.
fn links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in prose_lines(text) {
        // Code spans can hold `](` (Rust, shell); drop them first.
        let plain: String = line.split('`').step_by(2).collect();
        let mut rest = plain.as_str();
        while let Some(i) = rest.find("](") {
            let after = &rest[i + 2..];
            let Some(end) = after.find(')') else { break };
            out.push(after[..end].to_string());
            rest = &after[end..];
        }
    }
    out
}

#[test]
fn the_readme_and_the_guides_link_only_to_what_exists() {
    let root = repo();
    let mut files = vec![
        root.join("README.md"),
        root.join("crates/fsdp/src/guide.md"),
    ];
    for entry in std::fs::read_dir(root.join("docs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "md") {
            files.push(path);
        }
    }
    let mut dead = Vec::new();
    let mut checked = 0;
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        for link in links(&text) {
            if link.contains("://") || link.starts_with("mailto:") {
                continue;
            }
            checked += 1;
            let (path, fragment) = link.split_once('#').unwrap_or((&link, ""));
            let target = if path.is_empty() {
                file.clone()
            } else {
                file.parent().unwrap().join(path)
            };
            if !target.exists() {
                dead.push(format!("{}: {link} (no such file)", file.display()));
                continue;
            }
            if !fragment.is_empty() {
                let target_text = std::fs::read_to_string(&target).unwrap_or_default();
                if !anchors(&target_text).iter().any(|a| a == fragment) {
                    dead.push(format!("{}: {link} (no such heading)", file.display()));
                }
            }
        }
    }
    assert!(dead.is_empty(), "dead links:\n{}", dead.join("\n"));
    assert!(
        checked >= 15,
        "only {checked} relative links found: is the parser broken?"
    );
}

#[test]
fn the_link_checker_sees_a_dead_link_and_a_dead_anchor() {
    let text = "see [a](docs/NOPE.md) and `[b](code)` and [c](#the-main-jobs-options)\n```\n[d](x)\n```\n## The main job's options\n";
    assert_eq!(links(text), ["docs/NOPE.md", "#the-main-jobs-options"]);
    assert_eq!(anchors(text), ["the-main-jobs-options"]);
    assert_eq!(
        anchor(" Llama-family models, LoRA"),
        "llama-family-models-lora"
    );
}

/// Every `fsdp::NAME` path in a file's text outside comments.
fn fsdp_modules(text: &str) -> Vec<String> {
    let code: String = text
        .lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n");
    code.match_indices("fsdp::")
        .filter(|(at, _)| {
            !code[..*at].ends_with(|c: char| c.is_alphanumeric() || c == '_' || c == ':')
        })
        .flat_map(|(at, m)| {
            let rest = &code[at + m.len()..];
            let ident = |s: &str| -> String {
                s.trim_start()
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect()
            };
            match rest.strip_prefix('{') {
                // `use fsdp::{a::X, b};`: each item's first segment (nested groups sit
                // inside an item, after its first segment).
                Some(group) => {
                    let (mut depth, mut items, mut start) = (0, Vec::new(), 0);
                    for (i, c) in group.char_indices() {
                        match c {
                            '{' => depth += 1,
                            '}' if depth == 0 => {
                                items.push(ident(&group[start..i]));
                                break;
                            }
                            '}' => depth -= 1,
                            ',' if depth == 0 => {
                                items.push(ident(&group[start..i]));
                                start = i + 1;
                            }
                            _ => {}
                        }
                    }
                    items.retain(|m| !m.is_empty());
                    items
                }
                None => vec![ident(rest)],
            }
        })
        .collect()
}

/// The examples are what users copy: they reach the library only through its user-facing
/// modules (and the crate's `composite_module!`), never the engine, the memory counters or
/// the tracing internals.
#[test]
fn the_examples_import_only_the_user_facing_modules() {
    const USER_FACING: [&str; 8] = [
        "accelerator",
        "nn",
        "models",
        "optim",
        "data",
        "config",
        "peft",
        "composite_module",
    ];
    let mut files = Vec::new();
    let mut dirs = vec![repo().join("crates/fsdp/examples")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    let mut seen = 0;
    let mut outside = Vec::new();
    for file in &files {
        for module in fsdp_modules(&std::fs::read_to_string(file).unwrap()) {
            seen += 1;
            if !USER_FACING.contains(&module.as_str()) {
                outside.push(format!("{}: fsdp::{module}", file.display()));
            }
        }
    }
    assert!(outside.is_empty(), "{}", outside.join("\n"));
    assert!(
        seen >= 50,
        "only {seen} paths in {} files: is the scan broken?",
        files.len()
    );
}

#[test]
fn the_import_scan_sees_paths_in_code_and_not_in_comments() {
    let text = "use fsdp::memory;\nlet a = fsdp::engine::Fsdp::x(); // fsdp::trace\nmy_fsdp::x; use fsdp::{nn::{A, B}, data};";
    assert_eq!(fsdp_modules(text), ["memory", "engine", "nn", "data"]);
}
