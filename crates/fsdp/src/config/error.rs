//! Configuration errors. Each names where the offending value came from (file and line,
//! environment variable, flag or code), the key, and what would have been valid.

use std::path::PathBuf;

use super::value::Source;

/// A configuration that cannot be used, and why.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The config file could not be read.
    #[error("cannot read config file {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The config file could not be written.
    #[error("cannot write config file {}: {source}", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not valid YAML.
    #[error("{}:{line}:{col}: invalid YAML: {message}", path.display())]
    Syntax {
        /// The file.
        path: PathBuf,
        /// 1-based line.
        line: usize,
        /// 1-based column.
        col: usize,
        /// The parser's message.
        message: String,
    },
    /// The file's structure is wrong (top level or `fsdp_config` not a mapping).
    #[error("{origin}: {message}")]
    Structure {
        /// Where.
        origin: Source,
        /// What is wrong.
        message: String,
    },
    /// A key the schema does not know.
    #[error(
        "{origin}: unknown key `{key}`{}{}",
        section_note(section),
        suggestion_note(suggestion)
    )]
    UnknownKey {
        /// Where.
        origin: Source,
        /// The key as written.
        key: String,
        /// The section it was found in (`None` at the top level).
        section: Option<&'static str>,
        /// The nearest valid key, if one is close (with its section when that differs).
        suggestion: Option<String>,
    },
    /// A key given twice (directly or through an alias).
    #[error("{origin}: `{key}` is set twice (first at {first})")]
    Duplicate {
        /// The second occurrence.
        origin: Source,
        /// The canonical key name.
        key: &'static str,
        /// The first occurrence.
        first: Source,
    },
    /// A value that does not fit its key.
    #[error("{origin}: invalid value `{value}` for `{key}`: {reason}")]
    InvalidValue {
        /// Where.
        origin: Source,
        /// The key's canonical name.
        key: &'static str,
        /// The value as written.
        value: String,
        /// What is valid.
        reason: String,
    },
    /// Values that are fine alone but not together.
    #[error("{message}")]
    Inconsistent {
        /// The keys involved, canonical names.
        keys: Vec<&'static str>,
        /// What is wrong, with the origin of each value.
        message: String,
    },
    /// Several problems, all reported at once.
    #[error("{} configuration problems:\n{}", .0.len(), list(.0))]
    Many(Vec<ConfigError>),
}

impl ConfigError {
    /// One error, or all of them, or `Ok` when there are none.
    pub fn collect(mut errors: Vec<ConfigError>) -> Result<(), ConfigError> {
        match errors.len() {
            0 => Ok(()),
            1 => Err(errors.remove(0)),
            _ => Err(ConfigError::Many(errors)),
        }
    }
}

fn section_note(section: &Option<&'static str>) -> String {
    section.map(|s| format!(" in `{s}`")).unwrap_or_default()
}

fn suggestion_note(suggestion: &Option<String>) -> String {
    suggestion
        .as_ref()
        .map(|s| format!("; did you mean {s}?"))
        .unwrap_or_else(|| "; see `fsdp config --help` for the valid keys".into())
}

fn list(errors: &[ConfigError]) -> String {
    errors
        .iter()
        .map(|e| format!("  - {e}"))
        .collect::<Vec<_>>()
        .join("\n")
}
