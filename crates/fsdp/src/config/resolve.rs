//! Merging layers (code, command line, environment, file, defaults) into one
//! [`ResolvedConfig`], checked as a whole.

use std::collections::BTreeMap;

use super::error::ConfigError;
use super::layer::Layer;
use super::schema::{Applicability, Key};
use super::settings::{FsdpPlugin, LaunchSettings};
use super::value::{Setting, Source, Value};
use super::view::View;

/// A configuration after merging every source and checking it as a whole.
#[derive(Debug, Clone)]
pub struct ResolvedConfig {
    settings: BTreeMap<Key, Setting>,
    /// Launch settings.
    pub launch: LaunchSettings,
    /// FSDP settings.
    pub fsdp: FsdpPlugin,
}

impl ResolvedConfig {
    /// Merges layers, strongest first, over the schema defaults, then validates.
    pub fn resolve(layers: &[&Layer]) -> Result<ResolvedConfig, ConfigError> {
        let mut settings = BTreeMap::new();
        for key in Key::all() {
            let chosen = layers.iter().find_map(|l| l.get(key)).cloned().or_else(|| {
                Value::from_default(key.spec().default).map(|value| Setting {
                    value,
                    source: Source::Default,
                })
            });
            if let Some(setting) = chosen {
                settings.insert(key, setting);
            }
        }
        let mut errors = super::checks::cluster_layout_conflicts(layers, &settings);
        let view = View(&settings);
        let launch = view.launch();
        let (fsdp, fsdp_errors) = view.fsdp();
        errors.extend(fsdp_errors);
        errors.extend(view.check(&launch, &fsdp));
        ConfigError::collect(errors)?;
        Ok(ResolvedConfig {
            settings,
            launch,
            fsdp,
        })
    }

    /// The winning setting for a key (`None` when unset with no default).
    pub fn get(&self, key: Key) -> Option<&Setting> {
        self.settings.get(&key)
    }

    /// Every key with a value, in table order.
    pub fn iter(&self) -> impl Iterator<Item = (Key, &Setting)> {
        self.settings.iter().map(|(k, s)| (*k, s))
    }

    /// Keys set to a non-default value that fsdp-rs does not act on, each with the reason:
    /// reported to the user rather than silently dropped.
    pub fn not_applicable(&self) -> Vec<(Key, &Setting, &'static str)> {
        self.iter()
            .filter_map(|(key, setting)| match key.spec().applies {
                Applicability::NotApplicable(reason)
                    if Some(&setting.value) != Value::from_default(key.spec().default).as_ref() =>
                {
                    Some((key, setting, reason))
                }
                _ => None,
            })
            .collect()
    }
}
