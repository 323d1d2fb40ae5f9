//! The accelerator's checkpoints: `save_state` / `load_state` of every prepared model,
//! optimizer and scheduler with the step, the seed and the data position (the checkpoint
//! module's format), `save_model` for sharing, `skip_first_batches` to resume mid-epoch, and
//! `latest_checkpoint`, what a restarted job resumes from.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use candle_core::Tensor;
use fsdp_comm::CommunicatorExt;

use super::{Accelerator, AcceleratorError, ModelHandle, PreparedModel, PreparedOptimizer};
use crate::checkpoint::{self, CheckpointOptions, RunState};
use crate::data::{DataLoader, Dataset, LoaderPosition};
use crate::engine::Fsdp;
use crate::optim::{LrScheduler, Optimizer};

/// Checks that `models` and `optimizers` are listed in their preparation order, so that
/// checkpoint folder i holds model i and optimizer i.
fn check_order(models: &[usize], optimizers: &[usize]) -> Result<(), AcceleratorError> {
    for (what, indices) in [("model", models), ("optimizer", optimizers)] {
        if let Some((pos, index)) = indices.iter().enumerate().find(|(p, i)| p != *i) {
            return Err(AcceleratorError::OutOfOrder {
                what,
                index: *index,
                position: pos,
            });
        }
    }
    if optimizers.len() > models.len() {
        return Err(AcceleratorError::OptimizersWithoutModels {
            optimizers: optimizers.len(),
            models: models.len(),
        });
    }
    Ok(())
}

impl Accelerator {
    /// Saves `model`'s full weights for sharing (`model.safetensors` and `config`'s
    /// `config.json`), gathered onto rank 0 one unit at a time (collective).
    ///
    /// ```
    /// # use fsdp::accelerator::Accelerator;
    /// # use fsdp::models::{BertConfig, BertForSequenceClassification};
    /// # use fsdp::nn::SeededWeights;
    /// # use fsdp::nn::candle::{Device, Tensor};
    /// # use fsdp::optim::{AdamW, AdamWConfig};
    /// # fn main() -> anyhow::Result<()> {
    /// # let mut acc = Accelerator::new()?;
    /// # let config = BertConfig { vocab_size: 32, hidden_size: 16, num_hidden_layers: 1, num_attention_heads: 2, intermediate_size: 32, max_position_embeddings: 8, ..BertConfig::default() };
    /// # let mut model = acc.prepare_model(BertForSequenceClassification::new(config.clone())?, &SeededWeights(1))?;
    /// # let mut opt = acc.prepare_optimizer(AdamW::new(AdamWConfig::default())?)?;
    /// # let out = std::env::temp_dir().join(format!("fsdp-doc-save-{}", std::process::id()));
    /// // transformers' save_pretrained: the folder from_pretrained (and SafetensorsWeights) reads.
    /// let dir = acc.save_model(&model, &out.join("model"), &config.to_hf_json("BertForSequenceClassification"))?;
    /// assert!(dir.join("model.safetensors").is_file() && dir.join("config.json").is_file());
    /// // The training state, to resume from at any number of processes.
    /// let data = fsdp::data::LoaderPosition::start_of(1);
    /// let checkpoint = acc.save_state(Some(&out.join("checkpoint")), &[&model], &[&opt], data)?;
    /// let resumed_at = acc.load_state(&checkpoint, &mut [&mut model], &mut [&mut opt])?;
    /// assert_eq!(resumed_at, data);
    /// # std::fs::remove_dir_all(&out)?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn save_model<M>(
        &self,
        model: &PreparedModel<M>,
        dir: &Path,
        config: &serde_json::Value,
    ) -> Result<PathBuf, AcceleratorError> {
        Ok(checkpoint::save_pretrained(
            model.engine(),
            dir,
            config,
            10 << 30,
        )?)
    }

    /// Saves `model`'s LoRA adapters in `dir` as PEFT's `save_pretrained` does
    /// (`adapter_config.json` with `task_type` such as `CAUSAL_LM` and the base model's name
    /// or folder, `adapter_model.safetensors` with PEFT's names), which Python `peft` loads
    /// onto transformers' model. Collective: only the adapters are gathered, one unit at a
    /// time, onto rank 0, which writes; atomic as [`Accelerator::save_model`].
    pub fn save_adapter<M: crate::nn::Module>(
        &self,
        model: &PreparedModel<crate::peft::LoraModel<M>>,
        dir: &Path,
        task_type: &str,
        base_model: Option<&str>,
    ) -> Result<PathBuf, AcceleratorError> {
        let config = model.module().adapter_config(task_type, base_model);
        Ok(checkpoint::save_adapter(
            model.engine(),
            dir,
            &config,
            &crate::peft::is_adapter_param,
            &|name| format!("{}{name}", crate::peft::PEFT_PREFIX),
        )?)
    }

    /// Saves `model`'s base with its LoRA adapters merged in (PEFT's `merge_and_unload`,
    /// then `save_pretrained`): a plain transformers folder in `dir` with `config`'s
    /// `config.json`, streamed as [`Accelerator::save_model`] streams (gathered onto rank 0
    /// one unit at a time, each adapted weight merged as its adapters arrive; the merged
    /// model is never whole in memory) and put in place atomically. A quantized base is
    /// written dequantized. Collective.
    pub fn save_merged<M: crate::nn::Module>(
        &self,
        model: &PreparedModel<crate::peft::LoraModel<M>>,
        dir: &Path,
        config: &serde_json::Value,
    ) -> Result<PathBuf, AcceleratorError> {
        let lora = model.module();
        let fan_in_fan_out = lora
            .info()
            .modules()
            .iter()
            .any(|m| m.type_name == "Conv1D" && lora.adapted().contains(&m.path));
        let mut emit = crate::peft::MergingEmit::new(lora.config(), fan_in_fan_out);
        Ok(checkpoint::save_pretrained_as(
            model.engine(),
            dir,
            config,
            10 << 30,
            &mut emit,
        )?)
    }

    /// Saves the base of `model` without its adapters as a plain transformers folder in
    /// `dir` (`config`'s `config.json`; a quantized base dequantized), streamed and put in
    /// place as [`Accelerator::save_model`] does: the folder an adapter's
    /// `base_model_name_or_path` names when the base came from a file Python's
    /// `from_pretrained` cannot read (a GGUF file). Collective.
    pub fn save_base<M: crate::nn::Module>(
        &self,
        model: &PreparedModel<crate::peft::LoraModel<M>>,
        dir: &Path,
        config: &serde_json::Value,
    ) -> Result<PathBuf, AcceleratorError> {
        Ok(checkpoint::save_pretrained_as(
            model.engine(),
            dir,
            config,
            10 << 30,
            &mut crate::peft::BaseEmit,
        )?)
    }

    /// `model`'s full weights by name on rank 0 (`None` on the others), gathered one unit
    /// at a time (collective).
    pub fn get_state_dict<M>(
        &self,
        model: &PreparedModel<M>,
    ) -> Result<Option<BTreeMap<String, Tensor>>, AcceleratorError> {
        Ok(model.engine().full_state_dict()?)
    }

    /// Saves the prepared `models` and `optimizers` (in preparation order), the optimizers'
    /// schedulers, the step, the seed and `data`'s position (collective). `dir` is the
    /// folder, or with automatic naming `None` for the next
    /// `project_dir/checkpoints/checkpoint_<n>`. Returns the folder written. An asynchronous
    /// save still being written is waited for first.
    pub fn save_state(
        &self,
        dir: Option<&Path>,
        models: &[&dyn ModelHandle],
        optimizers: &[&PreparedOptimizer],
        data: LoaderPosition,
    ) -> Result<PathBuf, AcceleratorError> {
        let (dir, run, options, engines, opts) = self.save_inputs(dir, models, optimizers, data)?;
        let started = std::time::Instant::now();
        let written = checkpoint::save_state(&dir, &engines, &opts, &run, &options)?;
        if self.is_main_process() {
            tracing::info!(
                step = self.steps,
                seconds = started.elapsed().as_secs_f64(),
                "saved the training state to {}",
                written.display()
            );
        }
        Ok(written)
    }

    /// [`Accelerator::save_state`] in the background (PyTorch DCP's `async_save`): returns
    /// the folder the checkpoint will be published at as soon as every rank has copied its
    /// state (see [`checkpoint::save_state_async`]), and training goes on while the files are
    /// written. The next `save_state`, `save_state_async`, `load_state`,
    /// `latest_checkpoint` or [`Accelerator::wait_for_checkpoint`] waits for it and returns
    /// its error on every rank if it failed (the previous checkpoint is then untouched);
    /// call `wait_for_checkpoint` before the program ends (dropping the accelerator waits
    /// too, but can only log a failure). SHARDED_STATE_DICT and LOCAL_STATE_DICT.
    pub fn save_state_async(
        &self,
        dir: Option<&Path>,
        models: &[&dyn ModelHandle],
        optimizers: &[&PreparedOptimizer],
        data: LoaderPosition,
    ) -> Result<PathBuf, AcceleratorError> {
        let (dir, run, options, engines, opts) = self.save_inputs(dir, models, optimizers, data)?;
        let started = std::time::Instant::now();
        let pending = checkpoint::save_state_async(&dir, &engines, &opts, &run, &options)?;
        let dest = pending.dest().to_path_buf();
        if self.is_main_process() {
            tracing::info!(
                step = self.steps,
                blocked_seconds = started.elapsed().as_secs_f64(),
                staged_mib = pending.staged_bytes() as f64 / (1u64 << 20) as f64,
                "saving the training state to {} in the background",
                dest.display()
            );
        }
        *self.pending() = Some(pending);
        Ok(dest)
    }

    /// Waits for the asynchronous save under way, if any (collective): its folder once
    /// published, `None` when there was none, or its error on every rank.
    pub fn wait_for_checkpoint(&self) -> Result<Option<PathBuf>, AcceleratorError> {
        let Some(pending) = self.pending().take() else {
            return Ok(None);
        };
        let started = std::time::Instant::now();
        let written = pending.wait()?;
        if self.is_main_process() {
            tracing::info!(
                waited_seconds = started.elapsed().as_secs_f64(),
                "saved the training state to {}",
                written.display()
            );
        }
        Ok(Some(written))
    }

    fn pending(&self) -> std::sync::MutexGuard<'_, Option<checkpoint::PendingSave>> {
        self.pending_save
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// What a save of `models` and `optimizers` writes and where, once a pending save is
    /// written: the folder, the run state (step, schedulers, seed, data position, loss
    /// scalers), the options, and the engines and optimizers.
    #[allow(clippy::type_complexity)]
    fn save_inputs<'a>(
        &self,
        dir: Option<&Path>,
        models: &[&'a dyn ModelHandle],
        optimizers: &[&'a PreparedOptimizer],
        data: LoaderPosition,
    ) -> Result<
        (
            PathBuf,
            RunState,
            CheckpointOptions,
            Vec<&'a Fsdp>,
            Vec<&'a dyn Optimizer>,
        ),
        AcceleratorError,
    > {
        self.wait_for_checkpoint()?;
        check_order(
            &models.iter().map(|m| m.index()).collect::<Vec<_>>(),
            &optimizers.iter().map(|o| o.index()).collect::<Vec<_>>(),
        )?;
        let automatic = self.project.automatic_checkpoint_naming && dir.is_none();
        let dir = match dir {
            Some(d) => d.to_path_buf(),
            None if automatic => self.project.project_dir.clone(),
            None => {
                return Err(AcceleratorError::NoCheckpointDir);
            }
        };
        let schedulers = optimizers
            .iter()
            .map(|o| serde_json::to_value(o.scheduler()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| AcceleratorError::json("scheduler state", e))?;
        let scalers: Vec<serde_json::Value> = models
            .iter()
            .map(|m| {
                m.scaler().map_or(serde_json::Value::Null, |s| {
                    let (scale, growth_tracker) = s.state();
                    serde_json::json!({ "scale": scale, "growth_tracker": growth_tracker })
                })
            })
            .collect();
        let run = RunState {
            step: self.steps,
            schedulers,
            random: serde_json::json!({ "seed": self.seed }),
            data: serde_json::json!(data),
            grad_scalers: if scalers.iter().all(serde_json::Value::is_null) {
                Vec::new()
            } else {
                scalers
            },
        };
        let options = CheckpointOptions {
            automatic_naming: automatic,
            total_limit: self.project.total_limit,
            join_timeout: Duration::from_secs(60),
            ..Default::default()
        };
        let engines = models.iter().map(|m| m.engine()).collect();
        let opts = optimizers.iter().map(|o| o.optimizer()).collect();
        Ok((dir, run, options, engines, opts))
    }

    /// The newest complete checkpoint in `folder` (the project folder when `None`, with its
    /// `checkpoints/` of automatic naming): the one with the highest saved step, whatever
    /// its name, or `None` when there is none (a job's first attempt). What a job restarted by
    /// `fsdp launch --max_restarts` resumes from with [`Accelerator::load_state`] (see
    /// [`Accelerator::restart_count`]). Collective: rank 0 looks, and every rank gets its
    /// answer, so all load the same checkpoint.
    pub fn latest_checkpoint(
        &self,
        folder: Option<&Path>,
    ) -> Result<Option<PathBuf>, AcceleratorError> {
        self.wait_for_checkpoint()?;
        let folder = folder.unwrap_or(&self.project.project_dir);
        let found = (self.process_index() == 0).then(|| checkpoint::latest_checkpoint(folder));
        let answer = self.answer_of_rank0(found.map(|f| f.map(|l| l.map(|(p, _)| p))))?;
        match answer {
            Ok(path) => Ok(path),
            Err(message) => Err(AcceleratorError::OnRank0 {
                what: "finding the latest checkpoint".into(),
                message,
            }),
        }
    }

    /// Holds the output folder `dir` (made if missing) for the rest of this run, so that a
    /// second run into it is refused, naming this run's process, instead of mixing their
    /// checkpoints, model and records: rank 0 takes an exclusive lock on
    /// `dir/.fsdp_run.lock`, released when the process ends (however it ends). Collective;
    /// calling it again for the same folder does nothing. [`Accelerator::claim_output_dir`]
    /// calls it; a resumed run calls it itself.
    pub fn lock_output_dir(&self, dir: &Path) -> Result<(), AcceleratorError> {
        let taken = (self.process_index() == 0).then(|| {
            let mut held = self.output_lock.lock().unwrap_or_else(|p| p.into_inner());
            if held.as_ref().is_some_and(|l| l.dir() == dir) {
                return Ok(());
            }
            *held = Some(super::output_lock::lock(dir)?);
            Ok::<(), String>(())
        });
        match self.answer_of_rank0(taken)? {
            Ok(()) => Ok(()),
            Err(reason) => Err(AcceleratorError::OutputDirLocked {
                dir: dir.to_path_buf(),
                reason,
            }),
        }
    }

    /// Refuses to train into `dir` while an earlier run's saved model or checkpoints are
    /// there (transformers' `overwrite_output_dir` check): a new run would replace the model
    /// and `latest` could resume an unrelated run's checkpoint. With `overwrite`, rank 0
    /// removes those checkpoints instead (the model is replaced when the run saves its own)
    /// — only when every one holds nothing but what its save wrote; otherwise the error
    /// names the first file that is not, and nothing is removed. Collective: rank 0 looks,
    /// every rank gets its answer. Call it when a run starts anew, not when it resumes.
    pub fn claim_output_dir(&self, dir: &Path, overwrite: bool) -> Result<(), AcceleratorError> {
        self.lock_output_dir(dir)?;
        self.wait_for_checkpoint()?;
        let looked = (self.process_index() == 0).then(|| {
            if !overwrite {
                return checkpoint::earlier_run_outputs(dir).map_err(|e| e.to_string());
            }
            checkpoint::remove_earlier_checkpoints(dir).map_err(|e| e.to_string())?;
            Ok(Vec::new())
        });
        let found: Vec<PathBuf> = match self.answer_of_rank0(looked)? {
            Ok(found) => found,
            Err(message) => {
                return Err(AcceleratorError::OnRank0 {
                    what: dir.display().to_string(),
                    message,
                });
            }
        };
        if found.is_empty() {
            Ok(())
        } else {
            Err(AcceleratorError::OutputDirInUse {
                dir: dir.to_path_buf(),
                found,
            })
        }
    }

    /// Rank 0's `answer` (a result it computed; `None` on the other ranks) on every rank.
    fn answer_of_rank0<T, E>(
        &self,
        answer: Option<Result<T, E>>,
    ) -> Result<Result<T, String>, AcceleratorError>
    where
        T: serde::Serialize + serde::de::DeserializeOwned,
        E: std::fmt::Display,
    {
        let value = match &answer {
            Some(Ok(v)) => serde_json::json!({ "ok": v }),
            Some(Err(e)) => serde_json::json!({ "error": e.to_string() }),
            None => serde_json::Value::Null,
        };
        let mine =
            serde_json::to_vec(&value).map_err(|e| AcceleratorError::json("rank 0's answer", e))?;
        let len = self
            .group
            .broadcast_vec(vec![mine.len() as i64], 0)
            .wait()?;
        let mut bytes = mine;
        bytes.resize(len.first().copied().unwrap_or(0).max(0) as usize, 0);
        let bytes = self.group.broadcast_vec(bytes, 0).wait()?;
        let value: serde_json::Value = serde_json::from_slice(&bytes)
            .map_err(|e| AcceleratorError::json("rank 0's answer", e))?;
        if let Some(e) = value.get("error").and_then(|e| e.as_str()) {
            return Ok(Err(e.to_string()));
        }
        serde_json::from_value(value["ok"].clone())
            .map(Ok)
            .map_err(|e| AcceleratorError::json("rank 0's answer", e))
    }

    /// Loads what [`Accelerator::save_state`] wrote into the same kinds of objects, at any
    /// world size and strategy (collective); returns the data position to continue from
    /// (give it to the loader with `set_position`). Also what Accelerate's `save_state`
    /// writes with SHARDED_STATE_DICT (models, optimizers with their groups; the step is
    /// the optimizers' count): a PyTorch run continues here, from the start of the data
    /// (Accelerate saves no position).
    pub fn load_state(
        &mut self,
        dir: &Path,
        models: &mut [&mut dyn ModelHandle],
        optimizers: &mut [&mut PreparedOptimizer],
    ) -> Result<LoaderPosition, AcceleratorError> {
        self.wait_for_checkpoint()?;
        check_order(
            &models.iter().map(|m| m.index()).collect::<Vec<_>>(),
            &optimizers.iter().map(|o| o.index()).collect::<Vec<_>>(),
        )?;
        let run = {
            let mut engines: Vec<&mut Fsdp> = models.iter_mut().map(|m| m.engine_mut()).collect();
            let mut opts: Vec<&mut dyn Optimizer> =
                optimizers.iter_mut().map(|o| o.optimizer_mut()).collect();
            checkpoint::load_state(dir, &mut engines, &mut opts, &CheckpointOptions::default())?
        };
        let bad = |what: &str, e: serde_json::Error| {
            AcceleratorError::json(format!("{what} in {}", dir.display()), e)
        };
        for (o, v) in optimizers.iter_mut().zip(&run.schedulers) {
            if let Some(pytorch) = v.get(checkpoint::PYTORCH_SCHEDULER) {
                o.restore_pytorch_scheduler(pytorch)?;
                continue;
            }
            let saved: Option<LrScheduler> =
                serde_json::from_value(v.clone()).map_err(|e| bad("scheduler state", e))?;
            match (saved, o.scheduler().cloned()) {
                (Some(s), Some(ours)) => {
                    let s = ours.resume_from(s).map_err(|reason| {
                        AcceleratorError::SchedulerResume {
                            dir: dir.to_path_buf(),
                            reason,
                        }
                    })?;
                    o.restore_scheduler(s)?
                }
                (None, None) => {}
                (saved, _) => {
                    return Err(AcceleratorError::SchedulerPresence {
                        optimizer: o.index(),
                        ours: o.scheduler().is_some(),
                        saved: saved.is_some(),
                    });
                }
            }
        }
        // fp16 loss scales continue where they were (a checkpoint without them, from a run
        // without fp16 or an older one, leaves the scalers as prepared).
        for (m, saved) in models.iter_mut().zip(&run.grad_scalers) {
            let (Some(scaler), Some(scale), Some(tracker)) = (
                m.grad_scaler_mut(),
                saved["scale"].as_f64(),
                saved["growth_tracker"].as_u64(),
            ) else {
                continue;
            };
            scaler.load_state((scale, tracker as u32));
        }
        self.steps = run.step;
        if self.is_main_process() {
            tracing::info!(
                step = run.step,
                "loaded the training state from {}",
                dir.display()
            );
        }
        if run.data.is_null() {
            // Accelerate's checkpoints hold no data position: the start, and the caller
            // skips what its run had consumed (`skip_first_batches`).
            return Ok(LoaderPosition::default());
        }
        serde_json::from_value(run.data).map_err(|e| bad("data position", e))
    }

    /// Continues `loader` after the first `steps` steps of its epoch (resuming mid-epoch).
    pub fn skip_first_batches<D: Dataset, B>(&self, loader: &mut DataLoader<D, B>, steps: usize) {
        let epoch = loader.position().epoch;
        let samples = steps.saturating_mul(loader.global_batch_size());
        loader.set_position(LoaderPosition::at(epoch, samples));
    }
}
