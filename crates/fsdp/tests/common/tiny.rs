//! A tiny BERT classifier, its synthetic batches, and a trainer around the FSDP engine, for
//! tests that train a few steps on threads or processes.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use fsdp::config::{
    AutoWrapPolicy, FsdpPlugin, FsdpPluginBuilder, Layer, ShardingStrategy, StateDictType,
};
use fsdp::engine::Fsdp;
use fsdp::models::{BertConfig, BertForSequenceClassification};
use fsdp::nn::ops::{CrossEntropy, cross_entropy};
use fsdp::nn::{LocalParams, Module};
use fsdp::optim::{AdamW, AdamWConfig, Optimizer, Sgd, SgdConfig};
use fsdp_comm::{Communicator, LocalGroup};

/// Samples per step over all ranks (divisible by 1 to 4).
pub const GLOBAL_BATCH: usize = 12;
const SEQ: usize = 5;
const VOCAB: usize = 37;

/// The model, with hidden and attention dropout `dropout`.
pub fn model(dropout: f64) -> BertForSequenceClassification {
    BertForSequenceClassification::new(BertConfig {
        vocab_size: VOCAB,
        hidden_size: 12,
        num_hidden_layers: 2,
        num_attention_heads: 2,
        intermediate_size: 20,
        max_position_embeddings: 8,
        num_labels: 3,
        hidden_dropout_prob: dropout,
        attention_probs_dropout_prob: dropout,
        ..BertConfig::default()
    })
    .unwrap()
}

/// The global batch of `step`: ids [GLOBAL_BATCH, SEQ] and labels.
pub fn batch(step: usize) -> (Tensor, Tensor) {
    let mut s = fsdp::rng::XorShift64::new(
        0x2545_F491_4F6C_DD1Du64 ^ (step as u64 + 1).wrapping_mul(0x9E37_79B9),
    );
    let mut next = || s.next_u64();
    let ids: Vec<u32> = (0..GLOBAL_BATCH * SEQ)
        .map(|_| (next() % VOCAB as u64) as u32)
        .collect();
    let labels: Vec<u32> = (0..GLOBAL_BATCH).map(|_| (next() % 3) as u32).collect();
    (
        Tensor::from_vec(ids, (GLOBAL_BATCH, SEQ), &Device::Cpu).unwrap(),
        Tensor::from_vec(labels, GLOBAL_BATCH, &Device::Cpu).unwrap(),
    )
}

/// Which optimizer a trainer runs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OptimizerKind {
    /// AdamW, lr 3e-3.
    AdamW,
    /// SGD with Nesterov momentum.
    Sgd,
}

impl OptimizerKind {
    /// A fresh optimizer.
    pub fn build(self) -> Box<dyn Optimizer> {
        match self {
            OptimizerKind::AdamW => Box::new(
                AdamW::new(AdamWConfig {
                    lr: 3e-3,
                    ..Default::default()
                })
                .unwrap(),
            ),
            OptimizerKind::Sgd => Box::new(
                Sgd::new(SgdConfig {
                    lr: 0.05,
                    momentum: 0.9,
                    nesterov: true,
                    ..Default::default()
                })
                .unwrap(),
            ),
        }
    }
}

/// The optimizer of the PyTorch fixture scripts' runs: AdamW (lr 1e-3), weight decay 0.01
/// except on biases and LayerNorm weights (0.0), for `engine`'s parameters.
pub fn pytorch_fixture_adamw(engine: &Fsdp) -> Box<dyn Optimizer> {
    let names = engine.parameters().into_iter().map(|(n, _)| n.to_string());
    Box::new(
        AdamW::with_groups(fsdp::optim::split_no_decay(
            names.collect::<Vec<_>>(),
            AdamWConfig::default(),
            fsdp::optim::is_bias_or_norm,
        ))
        .unwrap(),
    )
}

/// How a trainer is set up.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Setup {
    /// Sharding strategy.
    pub strategy: ShardingStrategy,
    /// How checkpoints are cut.
    pub state_dict_type: StateDictType,
    /// Optimizer.
    pub optimizer: OptimizerKind,
    /// Dropout probability (0 for none).
    pub dropout: f64,
}

/// The tiny model under the engine, with its optimizer.
pub struct Trainer {
    /// The model.
    pub model: BertForSequenceClassification,
    /// The engine.
    pub engine: Fsdp,
    /// The optimizer.
    pub optimizer: Box<dyn Optimizer>,
    rank: usize,
    world: usize,
}

impl Trainer {
    /// [`fsdp::checkpoint::save_state`] of this engine and optimizer, default options.
    pub fn save_state(
        &self,
        dir: &std::path::Path,
        run: &fsdp::checkpoint::RunState,
    ) -> Result<std::path::PathBuf, fsdp::checkpoint::CheckpointError> {
        let options = Default::default();
        fsdp::checkpoint::save_state(
            dir,
            &[&self.engine],
            &[self.optimizer.as_ref()],
            run,
            &options,
        )
    }

    /// [`fsdp::checkpoint::save_state_async`] of this engine and optimizer, default options.
    pub fn save_state_async(
        &self,
        dir: &std::path::Path,
        run: &fsdp::checkpoint::RunState,
    ) -> Result<fsdp::checkpoint::PendingSave, fsdp::checkpoint::CheckpointError> {
        let (models, options) = ([&self.engine], Default::default());
        fsdp::checkpoint::save_state_async(dir, &models, &[self.optimizer.as_ref()], run, &options)
    }

    /// [`fsdp::checkpoint::load_state`] into this engine and optimizer, default options.
    pub fn load_state(
        &mut self,
        dir: &std::path::Path,
    ) -> Result<fsdp::checkpoint::RunState, fsdp::checkpoint::CheckpointError> {
        fsdp::checkpoint::load_state(
            dir,
            &mut [&mut self.engine],
            &mut [self.optimizer.as_mut()],
            &Default::default(),
        )
    }
    /// Initial weights from a fixed seed, sharded over `group`.
    pub fn new(group: Arc<dyn Communicator>, setup: Setup) -> Trainer {
        let plugin = FsdpPlugin::builder()
            .sharding_strategy(setup.strategy)
            .state_dict_type(setup.state_dict_type)
            .resolve(&Layer::new(), None)
            .unwrap()
            .fsdp;
        Trainer::with_plugin(group, setup, &plugin)
    }

    /// [`Trainer::new`] under `plugin` (the setup's strategy and cut not applied).
    pub fn with_plugin(group: Arc<dyn Communicator>, setup: Setup, plugin: &FsdpPlugin) -> Trainer {
        let model = model(setup.dropout);
        let init = LocalParams::init(&model.info(), 7, DType::F32, &Device::Cpu).unwrap();
        let (rank, world) = (group.rank(), group.size());
        let engine = Fsdp::wrap(&model, &init.tensors(), plugin, group).unwrap();
        Trainer {
            model,
            engine,
            optimizer: setup.optimizer.build(),
            rank,
            world,
        }
    }

    /// Trains `steps` (dropout masks drawn from the step and rank); returns this rank's loss
    /// per step.
    pub fn train(&mut self, steps: Range<usize>) -> Vec<f32> {
        let per_rank = GLOBAL_BATCH / self.world;
        let mut losses = Vec::new();
        for step in steps {
            self.model.bert.dropout_seed = Some(step as u64 * 1000 + self.rank as u64);
            let (ids, labels) = batch(step);
            let ids = ids.narrow(0, self.rank * per_rank, per_rank).unwrap();
            let labels = labels.narrow(0, self.rank * per_rank, per_rank).unwrap();
            let params = self.engine.begin_step().unwrap();
            let logits = self.model.forward(&params, &ids, None, None).unwrap();
            let loss = cross_entropy(&logits, &labels, CrossEntropy::default()).unwrap();
            losses.push(loss.to_scalar::<f32>().unwrap());
            self.engine.backward(params, loss, true).unwrap();
            self.engine.clip_grad_norm(Some(1.0)).unwrap();
            self.engine.step(self.optimizer.as_mut()).unwrap();
        }
        losses
    }

    /// Prints, on rank 0, `RESULT` with `losses` averaged over the ranks (collective) and the
    /// weights: what `common::result_of` reads from a worker's output.
    pub fn print_result(&self, group: &dyn Communicator, losses: Vec<f32>) {
        use fsdp_comm::{CommunicatorExt, ReduceOp};
        let mean: Vec<f32> = losses
            .into_iter()
            .map(|l| group.all_reduce_vec(vec![l], ReduceOp::Avg).wait().unwrap()[0])
            .collect();
        if let Some(w) = self.weights() {
            println!(
                "RESULT {}",
                serde_json::json!({"losses": mean, "weights": w})
            );
        }
    }

    /// Every parameter's values on rank 0 (`None` elsewhere).
    pub fn weights(&self) -> Option<BTreeMap<String, Vec<f32>>> {
        self.engine.full_state_dict().unwrap().map(|w| {
            w.into_iter()
                .map(|(k, t)| (k, t.flatten_all().unwrap().to_vec1().unwrap()))
                .collect()
        })
    }
}

/// Runs `f` on `world` threads, each a rank of an in-process group; results in rank order.
pub fn on_threads<T: Send + 'static>(
    world: usize,
    f: impl Fn(Arc<dyn Communicator>) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let f = Arc::new(f);
    let handles: Vec<_> = LocalGroup::create(world)
        .into_iter()
        .map(|g| {
            let f = f.clone();
            std::thread::spawn(move || f(Arc::new(g)))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// The tiny model (no dropout, seed 1) and SGD prepared on `acc`.
pub fn prepare_with_sgd(
    acc: &mut fsdp::accelerator::Accelerator,
) -> (
    fsdp::accelerator::PreparedModel<BertForSequenceClassification>,
    fsdp::accelerator::PreparedOptimizer,
) {
    let m = model(0.0);
    let w = LocalParams::init(&m.info(), 1, DType::F32, &Device::Cpu)
        .unwrap()
        .tensors();
    let model = acc.prepare_model(m, &w).unwrap();
    let opt = acc
        .prepare_optimizer(Sgd::new(SgdConfig::default()).unwrap())
        .unwrap();
    (model, opt)
}

/// One optimizer step of the tiny model on batch `step` through the accelerator.
pub fn accelerator_step(
    acc: &mut fsdp::accelerator::Accelerator,
    model: &mut fsdp::accelerator::PreparedModel<BertForSequenceClassification>,
    opt: &mut fsdp::accelerator::PreparedOptimizer,
    step: usize,
) {
    let (ids, labels) = batch(step);
    let logits = model
        .forward(|m, p| m.forward(p, &ids, None, None))
        .unwrap();
    let loss = cross_entropy(&logits, &labels, CrossEntropy::default()).unwrap();
    acc.backward(model, loss).unwrap();
    acc.optimizer_step(model, opt).unwrap();
}

/// FULL_SHARD with one unit per `Block` module (the toy models' layers), for the caller to
/// add its own settings to.
pub fn block_units() -> FsdpPluginBuilder {
    FsdpPlugin::builder()
        .sharding_strategy(ShardingStrategy::FullShard)
        .auto_wrap_policy(AutoWrapPolicy::TransformerBasedWrap)
        .transformer_layer_cls_to_wrap("Block")
}
