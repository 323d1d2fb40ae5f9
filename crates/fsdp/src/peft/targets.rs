//! PEFT's `target_modules`: which linear layers get an adapter, matched as PEFT matches them.

use std::fmt;

use regex::Regex;

use super::PeftError;
use crate::nn::ModuleInfo;

/// The layers to adapt, by module path.
#[derive(Debug, Clone, PartialEq)]
pub enum TargetModules {
    /// Module names: a path equal to one, or ending in `.` and one (`q_proj` matches
    /// `model.layers.0.self_attn.q_proj`).
    Names(Vec<String>),
    /// A regular expression the whole path must match (PEFT's string form).
    Regex(String),
    /// Every linear layer but the output layer `lm_head` (PEFT's `"all-linear"`).
    AllLinear,
}

impl TargetModules {
    /// `all-linear`, or comma-separated module names (`q_proj,v_proj`).
    pub fn parse(text: &str) -> TargetModules {
        match text.trim() {
            "all-linear" => TargetModules::AllLinear,
            t => TargetModules::Names(
                t.split(',')
                    .map(str::trim)
                    .filter(|n| !n.is_empty())
                    .map(String::from)
                    .collect(),
            ),
        }
    }

    pub(super) fn check(&self) -> Result<(), PeftError> {
        match self {
            TargetModules::Names(names) if names.is_empty() => Err(PeftError::Setting {
                key: "target_modules",
                value: "[]".into(),
                why: "name at least one module, or all-linear",
            }),
            _ => self.matcher().map(|_| ()),
        }
    }

    /// The pattern, compiled.
    pub(super) fn matcher(&self) -> Result<Matcher<'_>, PeftError> {
        Ok(match self {
            TargetModules::Names(names) => Matcher::Names(names),
            TargetModules::Regex(pattern) => {
                Matcher::Regex(Regex::new(&format!("^(?:{pattern})$")).map_err(|e| {
                    PeftError::BadRegex {
                        pattern: pattern.clone(),
                        why: e.to_string(),
                    }
                })?)
            }
            TargetModules::AllLinear => Matcher::AllLinear,
        })
    }
}

impl fmt::Display for TargetModules {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TargetModules::Names(names) => write!(f, "{names:?}"),
            TargetModules::Regex(pattern) => write!(f, "regex `{pattern}`"),
            TargetModules::AllLinear => write!(f, "all-linear"),
        }
    }
}

/// A compiled [`TargetModules`].
pub(super) enum Matcher<'a> {
    Names(&'a [String]),
    Regex(Regex),
    AllLinear,
}

impl Matcher<'_> {
    /// Whether the linear layer at `path` gets an adapter.
    pub(super) fn matches(&self, path: &str) -> bool {
        match self {
            Matcher::Names(names) => names
                .iter()
                .any(|n| path == n || path.ends_with(&format!(".{n}"))),
            Matcher::Regex(re) => re.is_match(path),
            Matcher::AllLinear => path.rsplit('.').next() != Some("lm_head"),
        }
    }
}

/// Whether `m` is a linear layer ([`crate::nn::layers::Linear`]: `nn.Linear` or GPT-2's
/// `Conv1D`).
pub(super) fn is_linear(m: &ModuleInfo) -> bool {
    matches!(m.type_name, "Linear" | "Conv1D")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_regex_and_all_linear_match_as_peft_does() {
        let names = TargetModules::parse("q_proj, v_proj");
        let m = names.matcher().unwrap();
        assert!(m.matches("model.layers.0.self_attn.q_proj"));
        assert!(m.matches("q_proj"));
        assert!(!m.matches("model.layers.0.self_attn.qq_proj"));
        assert!(!m.matches("model.layers.0.self_attn.o_proj"));
        let re = TargetModules::Regex(r".*\.1\..*proj".into());
        let m = re.matcher().unwrap();
        assert!(m.matches("model.layers.1.mlp.up_proj"));
        assert!(!m.matches("model.layers.11.mlp.up_proj"));
        let all = TargetModules::parse("all-linear");
        let m = all.matcher().unwrap();
        assert!(m.matches("model.layers.0.mlp.down_proj"));
        assert!(!m.matches("lm_head"));
        assert!(TargetModules::Regex("(".into()).check().is_err());
        assert!(TargetModules::parse(" , ").check().is_err());
    }
}
