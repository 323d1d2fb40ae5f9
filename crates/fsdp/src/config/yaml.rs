//! A small YAML document model that keeps line numbers, so configuration errors can point at
//! the line a user wrote, plus an emitter that writes files PyYAML (and so Accelerate) reads
//! back to the same values.

use std::fmt::Write as _;

use yaml_rust2::parser::{Event, MarkedEventReceiver, Parser};
use yaml_rust2::scanner::{Marker, TScalarStyle};

/// A YAML node with the 1-based line it starts on.
#[derive(Debug, Clone, PartialEq)]
pub struct Node {
    /// Where the node starts (1-based line; 0 when it was not read from a file).
    pub line: usize,
    /// The node itself.
    pub kind: NodeKind,
}

/// The three YAML node shapes.
#[derive(Debug, Clone, PartialEq)]
pub enum NodeKind {
    /// A scalar's text and whether it was quoted (a quoted `'no'` is a string, never a bool).
    Scalar {
        /// The scalar's text with quotes removed.
        text: String,
        /// True for single- or double-quoted and block scalars.
        quoted: bool,
    },
    /// A sequence.
    Seq(Vec<Node>),
    /// A mapping in file order; keys are scalars.
    Map(Vec<(Node, Node)>),
}

impl Node {
    /// A plain (unquoted) scalar not tied to a file line.
    pub fn plain(text: impl Into<String>) -> Node {
        Node {
            line: 0,
            kind: NodeKind::Scalar {
                text: text.into(),
                quoted: false,
            },
        }
    }

    /// True for `null`, `~` and the empty plain scalar.
    pub fn is_null(&self) -> bool {
        matches!(&self.kind, NodeKind::Scalar { text, quoted: false }
            if text.is_empty() || text == "~" || text.eq_ignore_ascii_case("null"))
    }

    /// The scalar text, if this is a scalar.
    pub fn as_scalar(&self) -> Option<&str> {
        match &self.kind {
            NodeKind::Scalar { text, .. } => Some(text),
            _ => None,
        }
    }
}

/// Why a document could not be read as YAML.
#[derive(Debug, Clone, PartialEq)]
pub struct SyntaxError {
    /// 1-based line of the problem.
    pub line: usize,
    /// 1-based column of the problem.
    pub col: usize,
    /// What the parser found.
    pub message: String,
}

/// Parses one YAML document. An empty document is an empty mapping; a second document is an
/// error (PyYAML's `safe_load` refuses it too, rather than reading only the first).
pub fn parse(text: &str) -> Result<Node, SyntaxError> {
    // A byte-order mark may start a YAML stream (PyYAML skips it); a NUL may stand nowhere
    // (YAML's character set excludes it; the parser would silently stop reading there).
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    if let Some(at) = text.find('\0') {
        let before = &text[..at];
        let line_start = before.rfind('\n').map_or(0, |i| i + 1);
        return Err(SyntaxError {
            line: before.matches('\n').count() + 1,
            col: before[line_start..].chars().count() + 1,
            message: "a NUL byte, which YAML does not allow".into(),
        });
    }
    let mut builder = TreeBuilder::default();
    let mut parser = Parser::new_from_str(text);
    parser.load(&mut builder, true).map_err(|e| SyntaxError {
        line: e.marker().line(),
        col: e.marker().col() + 1,
        message: e.info().to_string(),
    })?;
    if let Some(err) = builder.error {
        return Err(err);
    }
    if let Some(line) = builder.second_document {
        return Err(SyntaxError {
            line,
            col: 1,
            message: "a second YAML document starts here; a config file holds one".into(),
        });
    }
    Ok(builder.root.unwrap_or(Node {
        line: 1,
        kind: NodeKind::Map(Vec::new()),
    }))
}

/// Builds [`Node`]s from parser events.
#[derive(Default)]
struct TreeBuilder {
    /// Open collections: the node under construction and, for maps, a pending key.
    stack: Vec<(Node, Option<Node>)>,
    root: Option<Node>,
    error: Option<SyntaxError>,
    documents: usize,
    /// Where a second document starts.
    second_document: Option<usize>,
}

impl TreeBuilder {
    fn push_value(&mut self, node: Node) {
        let Some((parent, pending_key)) = self.stack.last_mut() else {
            self.root = Some(node);
            return;
        };
        match &mut parent.kind {
            NodeKind::Seq(items) => items.push(node),
            NodeKind::Map(entries) => match pending_key.take() {
                Some(key) => entries.push((key, node)),
                None => {
                    if !matches!(node.kind, NodeKind::Scalar { .. }) && self.error.is_none() {
                        self.error = Some(SyntaxError {
                            line: node.line,
                            col: 1,
                            message: "mapping keys must be plain strings".into(),
                        });
                    }
                    *pending_key = Some(node);
                }
            },
            NodeKind::Scalar { .. } => unreachable!("scalars are never pushed on the stack"),
        }
    }
}

impl MarkedEventReceiver for TreeBuilder {
    fn on_event(&mut self, ev: Event, mark: Marker) {
        let line = mark.line();
        if self.second_document.is_some() {
            return;
        }
        match ev {
            Event::DocumentStart => {
                self.documents += 1;
                if self.documents > 1 {
                    self.second_document = Some(line);
                }
            }
            Event::Scalar(text, style, _, _) => {
                let quoted = !matches!(style, TScalarStyle::Plain);
                self.push_value(Node {
                    line,
                    kind: NodeKind::Scalar { text, quoted },
                });
            }
            Event::SequenceStart(..) => self.stack.push((
                Node {
                    line,
                    kind: NodeKind::Seq(Vec::new()),
                },
                None,
            )),
            Event::MappingStart(..) => self.stack.push((
                Node {
                    line,
                    kind: NodeKind::Map(Vec::new()),
                },
                None,
            )),
            Event::SequenceEnd | Event::MappingEnd => {
                if let Some((node, _)) = self.stack.pop() {
                    self.push_value(node);
                }
            }
            Event::Alias(_) if self.error.is_none() => {
                self.error = Some(SyntaxError {
                    line,
                    col: mark.col() + 1,
                    message: "YAML aliases are not supported in configuration files".into(),
                });
            }
            _ => {}
        }
    }
}

/// Writes a mapping as block YAML with keys in the given order, nested mappings indented by two
/// spaces, as PyYAML's `safe_dump` lays them out.
pub fn emit(root: &[(String, Node)]) -> String {
    let mut out = String::new();
    let entries: Vec<(&str, &Node)> = root.iter().map(|(k, v)| (k.as_str(), v)).collect();
    emit_map(&mut out, &entries, 0);
    out
}

fn emit_map(out: &mut String, entries: &[(&str, &Node)], indent: usize) {
    for &(key, value) in entries {
        let pad = " ".repeat(indent);
        match &value.kind {
            NodeKind::Scalar { text, quoted } => {
                let _ = writeln!(
                    out,
                    "{pad}{}: {}",
                    scalar_text(key, false),
                    scalar_text(text, *quoted)
                );
            }
            NodeKind::Seq(items) if items.is_empty() => {
                let _ = writeln!(out, "{pad}{}: []", scalar_text(key, false));
            }
            NodeKind::Map(entries) if entries.is_empty() => {
                let _ = writeln!(out, "{pad}{}: {{}}", scalar_text(key, false));
            }
            NodeKind::Seq(items) => {
                let _ = writeln!(out, "{pad}{}:", scalar_text(key, false));
                emit_seq(out, items, indent);
            }
            NodeKind::Map(entries) => {
                let _ = writeln!(out, "{pad}{}:", scalar_text(key, false));
                emit_map(out, &map_entries(entries), indent + 2);
            }
        }
    }
}

fn map_entries(entries: &[(Node, Node)]) -> Vec<(&str, &Node)> {
    entries
        .iter()
        .map(|(k, v)| (k.as_scalar().unwrap_or_default(), v))
        .collect()
}

fn emit_seq(out: &mut String, items: &[Node], indent: usize) {
    let pad = " ".repeat(indent);
    for item in items {
        match &item.kind {
            NodeKind::Scalar { text, quoted } => {
                let _ = writeln!(out, "{pad}- {}", scalar_text(text, *quoted));
            }
            NodeKind::Seq(inner) if inner.is_empty() => {
                let _ = writeln!(out, "{pad}- []");
            }
            NodeKind::Map(inner) if inner.is_empty() => {
                let _ = writeln!(out, "{pad}- {{}}");
            }
            NodeKind::Seq(inner) => {
                let _ = writeln!(out, "{pad}-");
                emit_seq(out, inner, indent + 2);
            }
            NodeKind::Map(inner) => {
                // First entry on the dash line, the rest aligned under it.
                let mut block = String::new();
                emit_map(&mut block, &map_entries(inner), indent + 2);
                let body = block
                    .strip_prefix(&" ".repeat(indent + 2))
                    .unwrap_or(&block);
                let _ = write!(out, "{pad}- {body}");
            }
        }
    }
}

/// Renders a scalar, single-quoted when asked or when plain text would not parse back.
fn scalar_text(text: &str, quoted: bool) -> String {
    if quoted || breaks_plain_syntax(text) {
        format!("'{}'", text.replace('\'', "''"))
    } else {
        text.to_string()
    }
}

fn breaks_plain_syntax(text: &str) -> bool {
    text.is_empty()
        || text.starts_with(|c: char| c.is_whitespace() || "-?:,[]{}#&*!|>'\"%@`".contains(c))
        || text.ends_with(char::is_whitespace)
        || text.contains(": ")
        || text.contains(" #")
        || text.contains('\n')
}

/// A string scalar, quoted when a YAML 1.1 reader (PyYAML, so Accelerate) would otherwise read
/// it as a boolean, null or number (`'no'`, `'1'`).
pub fn text_node(text: &str) -> Node {
    const YAML11_WORDS: &[&str] = &[
        "y", "n", "yes", "no", "on", "off", "true", "false", "null", "~",
    ];
    let misread = YAML11_WORDS.iter().any(|w| text.eq_ignore_ascii_case(w))
        || text.parse::<f64>().is_ok()
        || text.starts_with("0x")
        || text.starts_with("0o");
    Node {
        line: 0,
        kind: NodeKind::Scalar {
            text: text.to_string(),
            quoted: misread,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_lines_and_quoting() {
        let doc = parse("a: 1\nb: 'no'\nc:\n  d: x\ne: []\n").unwrap();
        let NodeKind::Map(entries) = doc.kind else {
            panic!("not a map")
        };
        assert_eq!(entries[0].0.line, 1);
        assert_eq!(
            entries[1].1.kind,
            NodeKind::Scalar {
                text: "no".into(),
                quoted: true
            }
        );
        assert_eq!(entries[2].1.line, 4);
        assert_eq!(entries[3].1.kind, NodeKind::Seq(vec![]));
    }

    #[test]
    fn a_byte_order_mark_is_skipped_and_a_nul_is_an_error_at_its_line() {
        let with_bom = parse("\u{feff}num_processes: 2\n").unwrap();
        let NodeKind::Map(entries) = with_bom.kind else {
            panic!("not a map")
        };
        assert_eq!(entries[0].0.as_scalar(), Some("num_processes"));
        let err = parse("a: 1\nb: x\0y\nnum_processes: 2\n").unwrap_err();
        assert_eq!((err.line, err.col), (2, 5));
        assert!(err.message.contains("NUL"), "{}", err.message);
    }

    #[test]
    fn syntax_error_has_a_line() {
        let err = parse("a: 1\nb: [1, 2\n").unwrap_err();
        assert!(err.line >= 2, "{err:?}");
    }

    #[test]
    fn emit_round_trips() {
        let text = "a: 1\nb: 'no'\nc:\n  d: x\n  e:\n  - 1\n  - k: v\n    w: z\nf: []\n";
        let doc = parse(text).unwrap();
        let NodeKind::Map(entries) = doc.kind else {
            panic!()
        };
        let entries: Vec<(String, Node)> = entries
            .into_iter()
            .map(|(k, v)| (k.as_scalar().unwrap().to_string(), v))
            .collect();
        let emitted = emit(&entries);
        assert_eq!(emitted, text);
    }
}
