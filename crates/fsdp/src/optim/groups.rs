//! [`Grouped`]: an [`UpdateRule`] applied per parameter group (PyTorch's `param_groups`), with
//! per-parameter state by name, and the usual "no weight decay on biases and LayerNorm"
//! split.

use std::collections::{BTreeMap, HashMap};

use super::{OptimError, Optimizer, ParamState, UpdateRule};

/// A group: the parameters it holds and their settings.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamGroup<R> {
    /// Parameter names; empty in a catch-all group (every parameter no other group lists).
    pub params: Vec<String>,
    /// The group's settings (its current learning rate included).
    pub rule: R,
    /// The learning rate the group was created with.
    pub initial_lr: f64,
}

/// An optimizer built from an [`UpdateRule`]: groups of parameters with their own settings,
/// and the state of each parameter by name.
#[derive(Debug, Clone)]
pub struct Grouped<R> {
    groups: Vec<ParamGroup<R>>,
    index: HashMap<String, usize>,
    catch_all: Option<usize>,
    state: BTreeMap<String, ParamState>,
}

impl<R: UpdateRule> Grouped<R> {
    /// One group holding every parameter.
    pub fn new(rule: R) -> Result<Grouped<R>, OptimError> {
        Grouped::with_groups(vec![(Vec::new(), rule)])
    }

    /// Groups of `(parameter names, settings)`; a group with no names takes every parameter
    /// the others do not list. A name in two groups, or two catch-all groups, is an error.
    pub fn with_groups(groups: Vec<(Vec<String>, R)>) -> Result<Grouped<R>, OptimError> {
        let mut index = HashMap::new();
        let mut catch_all = None;
        let mut out = Vec::with_capacity(groups.len());
        for (g, (params, rule)) in groups.into_iter().enumerate() {
            rule.validate()
                .map_err(|reason| OptimError::InvalidSetting {
                    optimizer: R::NAME,
                    group: g,
                    reason,
                })?;
            if params.is_empty() {
                if let Some(first) = catch_all {
                    return Err(OptimError::InvalidSetting {
                        optimizer: R::NAME,
                        group: g,
                        reason: format!(
                            "lists no parameter, like group {first}: only one group may take every remaining parameter"
                        ),
                    });
                }
                catch_all = Some(g);
            }
            for p in &params {
                if let Some(first) = index.insert(p.clone(), g) {
                    return Err(OptimError::InTwoGroups {
                        optimizer: R::NAME,
                        param: p.clone(),
                        first,
                        second: g,
                    });
                }
            }
            out.push(ParamGroup {
                params,
                initial_lr: rule.lr(),
                rule,
            });
        }
        Ok(Grouped {
            groups: out,
            index,
            catch_all,
            state: BTreeMap::new(),
        })
    }

    /// The groups.
    pub fn groups(&self) -> &[ParamGroup<R>] {
        &self.groups
    }

    /// The group of parameter `name`.
    pub fn group_of(&self, name: &str) -> Result<usize, OptimError> {
        self.index
            .get(name)
            .copied()
            .or(self.catch_all)
            .ok_or_else(|| OptimError::NotInAnyGroup {
                optimizer: R::NAME,
                param: name.to_string(),
            })
    }

    fn group(&self, group: usize) -> Result<&ParamGroup<R>, OptimError> {
        self.groups.get(group).ok_or(OptimError::NoSuchGroup {
            optimizer: R::NAME,
            groups: self.groups.len(),
            group,
        })
    }
}

impl<R: UpdateRule> Optimizer for Grouped<R> {
    fn name(&self) -> &'static str {
        R::NAME
    }

    fn update(&mut self, name: &str, param: &mut [f32], grad: &[f32]) -> Result<(), OptimError> {
        if grad.len() != param.len() {
            return Err(OptimError::Length {
                optimizer: R::NAME,
                param: name.to_string(),
                what: "the gradient".into(),
                got: grad.len(),
                expected: param.len(),
            });
        }
        let g = self.group_of(name)?;
        let state = self.state.entry(name.to_string()).or_default();
        state.step += 1;
        self.groups[g].rule.update(param, grad, state);
        Ok(())
    }

    fn num_groups(&self) -> usize {
        self.groups.len()
    }

    fn lr(&self, group: usize) -> f64 {
        self.groups.get(group).map_or(f64::NAN, |g| g.rule.lr())
    }

    fn initial_lr(&self, group: usize) -> f64 {
        self.groups.get(group).map_or(f64::NAN, |g| g.initial_lr)
    }

    fn set_lr(&mut self, group: usize, lr: f64) -> Result<(), OptimError> {
        self.group(group)?;
        let rule = &mut self.groups[group].rule;
        let before = rule.lr();
        rule.set_lr(lr);
        if let Err(reason) = rule.validate() {
            rule.set_lr(before);
            return Err(OptimError::InvalidSetting {
                optimizer: R::NAME,
                group,
                reason,
            });
        }
        Ok(())
    }

    fn state(&self, name: &str) -> Option<&ParamState> {
        self.state.get(name)
    }

    fn set_state(&mut self, name: &str, state: ParamState) -> Result<(), OptimError> {
        self.group_of(name)?;
        self.state.insert(name.to_string(), state);
        Ok(())
    }

    fn take_state(&mut self, name: &str) -> Option<ParamState> {
        self.state.remove(name)
    }

    fn state_names(&self) -> Vec<String> {
        self.state.keys().cloned().collect()
    }

    fn param_group(&self, name: &str) -> Option<usize> {
        self.group_of(name).ok()
    }

    fn group_settings(&self, group: usize) -> serde_json::Value {
        let Some(g) = self.groups.get(group) else {
            return serde_json::Value::Null;
        };
        let mut settings = g.rule.settings();
        if let serde_json::Value::Object(m) = &mut settings {
            m.insert("initial_lr".into(), g.initial_lr.into());
        }
        settings
    }

    fn set_group_settings(
        &mut self,
        group: usize,
        settings: &serde_json::Value,
    ) -> Result<(), OptimError> {
        self.group(group)?;
        if settings.is_null() {
            return Ok(());
        }
        let invalid = |reason: String| OptimError::InvalidSetting {
            optimizer: R::NAME,
            group,
            reason,
        };
        let g = &mut self.groups[group];
        let rule = g.rule.with_settings(settings).map_err(invalid)?;
        rule.validate().map_err(invalid)?;
        g.rule = rule;
        if let Some(lr) = settings
            .get("initial_lr")
            .and_then(serde_json::Value::as_f64)
        {
            g.initial_lr = lr;
        }
        Ok(())
    }
}

/// transformers' usual rule for which parameters get no weight decay: biases and
/// normalisation weights (`LayerNorm`, `ln_1`, `layer_norm`, ...).
pub fn is_bias_or_norm(name: &str) -> bool {
    let leaf_module = name.rsplit('.').nth(1).unwrap_or("");
    name.ends_with("bias")
        || leaf_module.contains("LayerNorm")
        || leaf_module.contains("layer_norm")
        || leaf_module.starts_with("ln_")
        || leaf_module.starts_with("norm")
}

/// Normalisation module types ([`crate::nn::layers::LayerNorm`], [`crate::nn::layers::RmsNorm`]):
/// with [`no_decay_by_module`], transformers' rule (biases and norm weights) decided by type.
pub const NORM_MODULES: &[&str] = &["LayerNorm", "RmsNorm"];

/// [`NORM_MODULES`] and `Embedding`: minGPT's rule (no decay on norms and embeddings).
pub const NORM_AND_EMBEDDING_MODULES: &[&str] = &["LayerNorm", "RmsNorm", "Embedding"];

/// Which parameters of `model` get no weight decay, decided by the module tree rather than by
/// name: every parameter owned by a module whose type is in `types` (such as
/// [`NORM_MODULES`]), and every bias (a parameter a module registers as `bias`, whatever the
/// module is called). A norm named `blocks.0.ln` is found by its type, where
/// [`is_bias_or_norm`] (names only, for Hugging Face's names) misses it. Pass the result to
/// [`split_no_decay`]: `split_no_decay(names, rule, no_decay_by_module(&info, NORM_MODULES))`.
pub fn no_decay_by_module(
    model: &crate::nn::ModuleInfo,
    types: &[&str],
) -> impl Fn(&str) -> bool + use<> {
    let picked: std::collections::HashSet<String> = model
        .modules()
        .into_iter()
        .flat_map(|m| {
            let by_type = types.contains(&m.type_name);
            m.params
                .iter()
                .filter(move |p| by_type || p.name == m.join("bias"))
                .map(|p| p.name.clone())
        })
        .collect();
    move |name: &str| picked.contains(name)
}

/// Two groups over `names`: those `no_decay` picks with weight decay 0, the others with
/// `rule`'s — the grouping fine-tuning recipes use (`AdamW::with_groups(split_no_decay(...))`).
pub fn split_no_decay<R: UpdateRule>(
    names: impl IntoIterator<Item = String>,
    rule: R,
    no_decay: impl Fn(&str) -> bool,
) -> Vec<(Vec<String>, R)> {
    let (plain, decayed): (Vec<String>, Vec<String>) = names.into_iter().partition(|n| no_decay(n));
    // An empty list would make a catch-all group: leave empty groups out.
    [
        (decayed, rule.clone()),
        (plain, rule.with_weight_decay(0.0)),
    ]
    .into_iter()
    .filter(|(params, _)| !params.is_empty())
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::Init;
    use crate::optim::{AdamW, AdamWConfig, Sgd, SgdConfig};

    fn names() -> Vec<String> {
        [
            "enc.dense.weight",
            "enc.dense.bias",
            "enc.LayerNorm.weight",
            "head.weight",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    }

    #[test]
    fn groups_apply_their_own_settings() {
        let base = AdamWConfig {
            lr: 1e-2,
            weight_decay: 0.5,
            ..Default::default()
        };
        let groups = split_no_decay(names(), base, is_bias_or_norm);
        assert_eq!(groups.len(), 2);
        assert_eq!(groups[1].0, ["enc.dense.bias", "enc.LayerNorm.weight"]);
        let mut opt = AdamW::with_groups(groups).unwrap();
        // The same update on a decayed and a non-decayed parameter: only the first shrinks.
        let (mut a, mut b) = (vec![1.0f32; 3], vec![1.0f32; 3]);
        opt.update("enc.dense.weight", &mut a, &[0.0; 3]).unwrap();
        opt.update("enc.dense.bias", &mut b, &[0.0; 3]).unwrap();
        assert_eq!(a[0], (1.0 - 1e-2 * 0.5) as f32);
        assert_eq!(b[0], 1.0);
        // Learning rates per group; a schedule scales each group's initial rate.
        opt.set_lr(1, 5e-3).unwrap();
        assert_eq!((opt.lr(0), opt.lr(1)), (1e-2, 5e-3));
        crate::optim::LrSchedule::Linear {
            warmup: 0,
            total: 4,
        }
        .apply(&mut opt, 3)
        .unwrap();
        assert_eq!((opt.lr(0), opt.lr(1)), (5e-3, 5e-3));
        assert!(opt.set_lr(2, 1.0).is_err());
        assert!(opt.set_lr(0, -1.0).is_err());
        assert_eq!(opt.lr(0), 5e-3, "a refused rate leaves the group as it was");
        // State by name, with PyTorch's names and the step count.
        let s = opt.state("enc.dense.weight").unwrap();
        assert_eq!(s.step, 1);
        assert_eq!(
            s.buffers.keys().collect::<Vec<_>>(),
            ["exp_avg", "exp_avg_sq"]
        );
        assert_eq!(opt.state_names(), ["enc.dense.bias", "enc.dense.weight"]);
    }

    #[test]
    fn no_decay_by_module_type_finds_norms_whatever_their_names() {
        use crate::nn::layers::{Embedding, LayerNorm, Linear, RmsNorm};
        use crate::nn::{Module, ModuleInfo};
        // A model of one's own: norms called `ln` and `norm_out`, a projection with a bias.
        let info = ModuleInfo::new("", "Net")
            .child(Embedding::new("tok".into(), 10, 4, 0.02).info())
            .child(
                ModuleInfo::new("blocks.0", "Block")
                    .child(LayerNorm::new("blocks.0.ln".into(), 4, 1e-5).info())
                    .child(Linear::new("blocks.0.fc".into(), 4, 4, 0.02).info()),
            )
            .child(RmsNorm::new("norm_out".into(), 4, 1e-6).info())
            .child(ModuleInfo::new("head", "Head").param("bias", &[4], Init::Zeros));
        let names: Vec<String> = info.all_params().iter().map(|p| p.name.clone()).collect();
        let groups = |types: &[&str]| {
            split_no_decay(
                names.clone(),
                AdamWConfig::default(),
                no_decay_by_module(&info, types),
            )
        };
        let g = groups(NORM_MODULES);
        assert_eq!(g[0].0, ["tok.weight", "blocks.0.fc.weight"]);
        assert_eq!(
            g[1].0,
            [
                "blocks.0.ln.weight",
                "blocks.0.ln.bias",
                "blocks.0.fc.bias",
                "norm_out.weight",
                "head.bias"
            ]
        );
        assert_eq!((g[0].1.weight_decay, g[1].1.weight_decay), (0.01, 0.0));
        // By name, the norm called `ln` would have been decayed.
        assert!(!is_bias_or_norm("blocks.0.ln.weight"));
        // minGPT's rule also spares the embedding.
        assert_eq!(
            groups(NORM_AND_EMBEDDING_MODULES)[0].0,
            ["blocks.0.fc.weight"]
        );
        // A weight merely named `bias` elsewhere in its path is not a bias.
        let odd = ModuleInfo::new("bias", "Linear").param("weight", &[2], Init::Zeros);
        assert!(!no_decay_by_module(&odd, NORM_MODULES)("bias.weight"));
    }

    #[test]
    fn group_settings_use_pytorchs_names_and_restore_checked() {
        let sgd = SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            nesterov: true,
            ..Default::default()
        };
        let mut opt = Sgd::with_groups(vec![
            (vec!["a".into()], sgd),
            (vec![], sgd.with_weight_decay(0.5)),
        ])
        .unwrap();
        let s = opt.group_settings(1);
        assert_eq!(
            s,
            serde_json::json!({"lr": 0.1, "momentum": 0.9, "dampening": 0.0, "weight_decay": 0.5, "nesterov": true, "initial_lr": 0.1})
        );
        assert_eq!(
            (opt.param_group("a"), opt.param_group("b")),
            (Some(0), Some(1))
        );
        // Restored: the settings and the initial rate schedules scale.
        let mut other = s.clone();
        other["momentum"] = 0.5.into();
        other["initial_lr"] = 0.2.into();
        opt.set_group_settings(0, &other).unwrap();
        assert_eq!(
            (opt.groups()[0].rule.momentum, opt.initial_lr(0)),
            (0.5, 0.2)
        );
        // Refused as the constructor refuses (Nesterov without momentum), or when a field is
        // missing; the group keeps its settings.
        other["momentum"] = 0.0.into();
        let e = opt.set_group_settings(0, &other).unwrap_err().to_string();
        assert!(
            e.contains("SGD parameter group 0: nesterov needs momentum"),
            "{e}"
        );
        let e = opt
            .set_group_settings(0, &serde_json::json!({"lr": 0.1}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing field"), "{e}");
        assert_eq!(opt.groups()[0].rule.momentum, 0.5);
        assert!(opt.set_group_settings(2, &s).is_err());
    }

    #[test]
    fn membership_is_checked() {
        let e = AdamW::with_groups(vec![
            (vec!["a".into()], AdamWConfig::default()),
            (vec!["a".into()], AdamWConfig::default()),
        ])
        .unwrap_err()
        .to_string();
        assert!(e.contains("`a` is in parameter groups 0 and 1"), "{e}");
        let mut only_a = Sgd::with_groups(vec![(vec!["a".into()], SgdConfig::default())]).unwrap();
        let e = only_a
            .update("b", &mut [0.0], &[1.0])
            .unwrap_err()
            .to_string();
        assert!(e.contains("`b` is in no parameter group"), "{e}");
        let e = only_a
            .update("a", &mut [0.0], &[1.0, 2.0])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("the gradient has 2 elements, the parameter has 1"),
            "{e}"
        );
        let e = Sgd::new(SgdConfig {
            nesterov: true,
            ..Default::default()
        })
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("SGD parameter group 0: nesterov needs momentum"),
            "{e}"
        );
        assert!(only_a.set_state("b", ParamState::default()).is_err());
    }
}
