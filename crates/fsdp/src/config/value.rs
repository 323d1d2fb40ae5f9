//! Typed configuration values, where each came from, and parsing them per the schema.

use std::fmt;
use std::path::PathBuf;

use super::choices::{Choice, ShardingStrategy, describe_choices, parse_choice_index};
use super::schema::{DefaultValue, KeySpec, Kind};
use super::yaml::{Node, NodeKind, text_node};

/// A configuration value after parsing against its key's [`Kind`].
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// A boolean.
    Bool(bool),
    /// A whole number.
    UInt(u64),
    /// Text; for choices, the canonical spelling.
    Text(String),
    /// A list of strings.
    List(Vec<String>),
    /// An opaque section kept verbatim.
    Yaml(Node),
}

impl Value {
    /// The schema default, if the key has one.
    pub fn from_default(default: DefaultValue) -> Option<Value> {
        match default {
            DefaultValue::Unset => None,
            DefaultValue::Bool(b) => Some(Value::Bool(b)),
            DefaultValue::UInt(n) => Some(Value::UInt(n)),
            DefaultValue::Text(t) => Some(Value::Text(t.to_string())),
            DefaultValue::EmptyList => Some(Value::List(Vec::new())),
        }
    }

    /// The value as a YAML node for writing config files.
    pub fn to_node(&self) -> Node {
        match self {
            Value::Bool(b) => Node::plain(b.to_string()),
            Value::UInt(n) => Node::plain(n.to_string()),
            Value::Text(t) => text_node(t),
            Value::List(items) => Node {
                line: 0,
                kind: NodeKind::Seq(items.iter().map(|i| text_node(i)).collect()),
            },
            Value::Yaml(node) => node.clone(),
        }
    }

    /// The value as an environment variable's text (lists comma-separated).
    pub fn to_env_text(&self) -> String {
        match self {
            Value::List(items) => items.join(","),
            other => other.to_string(),
        }
    }
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::Bool(b) => write!(f, "{b}"),
            Value::UInt(n) => write!(f, "{n}"),
            Value::Text(t) => f.write_str(t),
            Value::List(items) => write!(f, "[{}]", items.join(", ")),
            Value::Yaml(_) => f.write_str("{...}"),
        }
    }
}

/// Where a setting came from, strongest last: default, file, environment, command line, code.
#[derive(Debug, Clone, PartialEq)]
pub enum Source {
    /// The schema default.
    Default,
    /// A YAML config file, at a 1-based line.
    File {
        /// The file.
        path: PathBuf,
        /// The line of the key.
        line: usize,
    },
    /// An environment variable.
    Env {
        /// The variable's name.
        var: String,
    },
    /// A command-line flag.
    Cli {
        /// The flag as typed, e.g. `--num_processes`.
        flag: String,
    },
    /// The plugin builder in the training program.
    Code,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Default => f.write_str("default"),
            Source::File { path, line } => write!(f, "{}:{line}", path.display()),
            Source::Env { var } => write!(f, "environment variable {var}"),
            Source::Cli { flag } => write!(f, "command-line flag {flag}"),
            Source::Code => f.write_str("plugin builder in code"),
        }
    }
}

/// A value together with where it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct Setting {
    /// The value.
    pub value: Value,
    /// Its origin.
    pub source: Source,
}

/// Parses a scalar's text for a key. `quoted` scalars are never read as booleans or numbers
/// by YAML readers, but a schema-typed key knows what it wants, so both are accepted.
pub fn parse_text(spec: &KeySpec, text: &str) -> Result<Value, String> {
    let text = text.trim();
    match spec.kind {
        Kind::Bool => parse_bool(text).map(Value::Bool),
        Kind::UInt { min, max } => match text.replace('_', "").parse::<u64>() {
            Ok(n) if (min..=max).contains(&n) => Ok(Value::UInt(n)),
            _ => Err(format!("expected a whole number from {min} to {max}")),
        },
        Kind::ParamCount => parse_param_count(text)
            .map(Value::UInt)
            .ok_or_else(|| "expected a whole number of parameters (like 100000000 or 1e8)".into()),
        Kind::Text => Ok(Value::Text(text.to_string())),
        Kind::Choice(names) => parse_choice_index(names, text)
            .map(|i| Value::Text(names[i].to_string()))
            .ok_or_else(|| describe_choices(names)),
        Kind::BoolOrStrategy => parse_bool(text).map(Value::Bool).or_else(|_| {
            ShardingStrategy::parse_choice(text)
                .map(|s| Value::Text(s.name().to_string()))
                .ok_or_else(|| {
                    format!(
                        "expected true or false (FSDP2), or a sharding strategy: {}",
                        describe_choices(ShardingStrategy::NAMES)
                    )
                })
        }),
        Kind::TextList => Ok(Value::List(
            text.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(String::from)
                .collect(),
        )),
        Kind::Opaque => Err("expected a mapping".into()),
    }
}

/// Parses a YAML node for a key: scalars as [`parse_text`], lists where the key takes one,
/// opaque sections verbatim.
pub fn parse_node(spec: &KeySpec, node: &Node) -> Result<Value, String> {
    match (&node.kind, spec.kind) {
        (_, Kind::Opaque) => Ok(Value::Yaml(node.clone())),
        (NodeKind::Scalar { text, .. }, _) => parse_text(spec, text),
        (NodeKind::Seq(items), Kind::TextList | Kind::Text) => {
            let texts: Option<Vec<String>> = items
                .iter()
                .map(|i| i.as_scalar().map(String::from))
                .collect();
            let texts = texts.ok_or("expected a list of strings")?;
            // A text key given as a list (class names to wrap) is the comma-joined list.
            Ok(match spec.kind {
                Kind::Text => Value::Text(texts.join(",")),
                _ => Value::List(texts),
            })
        }
        (NodeKind::Seq(_), _) => Err("expected a single value, found a list".into()),
        (NodeKind::Map(_), _) => Err("expected a single value, found a mapping".into()),
    }
}

/// The accepted boolean spellings.
pub fn parse_bool(text: &str) -> Result<bool, String> {
    match text.to_ascii_lowercase().as_str() {
        "true" | "yes" | "y" | "on" | "1" => Ok(true),
        "false" | "no" | "n" | "off" | "0" => Ok(false),
        _ => Err("expected true or false".into()),
    }
}

fn parse_param_count(text: &str) -> Option<u64> {
    let cleaned = text.replace('_', "");
    if let Ok(n) = cleaned.parse::<u64>() {
        return Some(n);
    }
    // `1e8` and `100000000.0` are how people write parameter counts.
    match cleaned.parse::<f64>() {
        Ok(f) if f >= 0.0 && f.fract() == 0.0 && f <= u64::MAX as f64 => Some(f as u64),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::super::schema::Key;
    use super::*;

    #[test]
    fn parses_by_kind() {
        let p = |k: Key, t: &str| parse_text(k.spec(), t);
        assert_eq!(p(Key::Debug, "YES"), Ok(Value::Bool(true)));
        assert_eq!(
            p(Key::FsdpMinNumParams, "1e8"),
            Ok(Value::UInt(100_000_000))
        );
        assert!(p(Key::FsdpMinNumParams, "-3").is_err());
        assert!(p(Key::FsdpMinNumParams, "2.5").is_err());
        // Counts of processes are plain whole numbers.
        assert_eq!(p(Key::NumProcesses, "1_000"), Ok(Value::UInt(1000)));
        assert!(p(Key::NumProcesses, "1e3").is_err());
        assert!(p(Key::NumProcesses, "2.5").is_err());
        assert!(p(Key::MainProcessPort, "70000").is_err());
        assert_eq!(
            p(Key::FsdpShardingStrategy, "2"),
            Ok(Value::Text("SHARD_GRAD_OP".into()))
        );
        assert_eq!(
            p(Key::FsdpReshardAfterForward, "false"),
            Ok(Value::Bool(false))
        );
        assert_eq!(
            p(Key::FsdpReshardAfterForward, "no_shard"),
            Ok(Value::Text("NO_SHARD".into()))
        );
        assert_eq!(
            p(Key::MixedPrecision, "BF16"),
            Ok(Value::Text("bf16".into()))
        );
        assert!(p(Key::MixedPrecision, "fp8").is_err());
    }
}
