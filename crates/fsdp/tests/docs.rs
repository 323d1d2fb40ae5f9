//! The README and the guides in docs/ link to each other and to files in the repository:
//! every relative link must lead to a file that exists, and every `#anchor` to a heading of
//! that file (GitHub's anchors: the heading in lower case, punctuation dropped, spaces as
//! hyphens), so a moved or renamed section cannot leave a dead link.

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
