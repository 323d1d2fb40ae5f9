//! Loading pretrained weights with `fsdp_cpu_ram_efficient_loading`, over real processes: only
//! rank 0 reads the safetensors file (the other ranks are given a source that fails if it is
//! ever read), every rank receives its rows unit by unit, and the sharded model equals the
//! file exactly (a fresh head equals its seeded initialisation) for FULL_SHARD on 3 ranks
//! (padded shards), HYBRID_SHARD on 2 x 2 and NO_SHARD on 2. A truncated file fails every
//! rank — rank 0 naming the file, the others the unit — instead of leaving them waiting.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use fsdp::config::{FsdpPlugin, Key, Layer, ShardingStrategy, Source, Value};
use fsdp::engine::Fsdp;
use fsdp::models::{BertConfig, BertForSequenceClassification, BertModel};
use fsdp::nn::{LocalParams, Model, Module, ParamSpec, SafetensorsWeights, WeightSource};
use fsdp_comm::{Communicator, Mesh, ProcessGroup};

use crate::common;

const ROLE: &str = "FSDP_LOADING_WORKER";
const FILE: &str = "TEST_LOADING_FILE";
const STRATEGY: &str = "TEST_LOADING_STRATEGY";
const SEED: u64 = 5;

fn config() -> BertConfig {
    BertConfig {
        vocab_size: 41,
        hidden_size: 12,
        num_hidden_layers: 2,
        num_attention_heads: 2,
        intermediate_size: 20,
        max_position_embeddings: 9,
        num_labels: 3,
        ..BertConfig::default()
    }
}

/// A base model's weights as transformers saves them (`embeddings.…`, no `bert.` prefix).
fn write_file(path: &Path) -> BTreeMap<String, Tensor> {
    let base = BertModel::new(config(), "").unwrap();
    let weights = LocalParams::init(&base.info(), 99, DType::F32, &Device::Cpu)
        .unwrap()
        .tensors();
    let map: std::collections::HashMap<String, Tensor> = weights.clone().into_iter().collect();
    candle_core::safetensors::save(&map, path).unwrap();
    weights
}

/// What ranks other than 0 are given: reading it is the failure under test.
struct NeverRead(usize);

impl WeightSource for NeverRead {
    fn values(&self, spec: &ParamSpec) -> candle_core::Result<Vec<f32>> {
        Err(candle_core::Error::Msg(format!(
            "rank {} read `{}`: only rank 0 may read the weights",
            self.0, spec.name
        )))
    }
}

#[test]
#[ignore = "a worker entry: its parent test runs it as real processes"]
fn loading_worker() {
    if std::env::var(ROLE).is_err() {
        return;
    }
    let file = PathBuf::from(std::env::var(FILE).unwrap());
    let strategy: ShardingStrategy = std::env::var(STRATEGY).unwrap().parse().unwrap();
    let pg: Arc<dyn Communicator> = Arc::new(ProcessGroup::from_env().unwrap());
    let rank = pg.rank();
    let model = BertForSequenceClassification::new(config()).unwrap();
    let info = model.info();
    let mut layout = Layer::new();
    if strategy.is_hybrid() {
        let count = |v: usize| Value::UInt(v as u64);
        layout.set(Key::NumMachines, count(2), Source::Code);
        layout.set(Key::NumProcesses, count(pg.size()), Source::Code);
        layout.set(
            Key::MainProcessIp,
            Value::Text("127.0.0.1".into()),
            Source::Code,
        );
    }
    let plugin = FsdpPlugin::builder()
        .sharding_strategy(strategy)
        .sync_module_states(true)
        .cpu_ram_efficient_loading(true)
        .resolve(&layout, None)
        .unwrap()
        .fsdp;
    let source: Box<dyn WeightSource> = if rank == 0 {
        match SafetensorsWeights::open(std::slice::from_ref(&file), &info, SEED) {
            Ok(s) => Box::new(s),
            Err(e) => {
                println!("RESULT {}", serde_json::json!({ "error": e.to_string() }));
                // The others wait for rank 0 in the first collective: tell them by failing
                // the same way a bad read does.
                Box::new(NeverRead(0))
            }
        }
    } else {
        Box::new(NeverRead(rank))
    };
    let built = if strategy.is_hybrid() {
        let mesh = Mesh::hybrid(pg.as_ref(), pg.size() / 2).unwrap();
        Fsdp::with_mesh(
            &info,
            source.as_ref(),
            &plugin,
            model.no_split_modules(),
            mesh,
        )
    } else {
        Fsdp::wrap(&model, source.as_ref(), &plugin, pg.clone())
    };
    let engine = match built {
        Ok(e) => e,
        Err(e) => {
            println!("RESULT {}", serde_json::json!({ "error": e.to_string() }));
            return;
        }
    };
    let full = engine.full_state_dict().unwrap();
    // No rank leaves before the root has every row: a rank's last sends may still be queued
    // for its link's writer thread when its gather returns (seen once on a loaded machine:
    // rank 0 lost rank 1 in the gather).
    pg.barrier().wait().unwrap();
    if let Some(full) = full {
        let file_weights = candle_core::safetensors::load(&file, &Device::Cpu).unwrap();
        let fresh = LocalParams::init(&info, SEED, DType::F32, &Device::Cpu)
            .unwrap()
            .tensors();
        let mut worst = 0f32;
        for (name, got) in &full {
            let want = match name.strip_prefix("bert.") {
                Some(base) => &file_weights[base],
                None => &fresh[name],
            };
            worst = worst.max(common::max_abs_diff(got, want));
        }
        println!(
            "RESULT {}",
            serde_json::json!({ "parameters": full.len(), "worst": worst })
        );
    }
}

fn run(world: usize, strategy: &str, file: &Path) -> Vec<String> {
    common::run_workers(
        "loading_worker",
        ROLE,
        world,
        &[(FILE, file.to_str().unwrap()), (STRATEGY, strategy)],
        Duration::from_secs(120),
    )
}

#[test]
fn only_rank_0_reads_and_every_rank_gets_exactly_its_rows() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("model.safetensors");
    let written = write_file(&file);
    for (world, strategy) in [(3, "FULL_SHARD"), (4, "HYBRID_SHARD"), (2, "NO_SHARD")] {
        let outputs = run(world, strategy, &file);
        let result = common::result_of(&outputs[0]);
        assert!(result.get("error").is_none(), "{strategy}: {result}");
        // Every file tensor plus the classifier's weight and bias.
        assert_eq!(result["parameters"], written.len() + 2, "{strategy}");
        assert_eq!(result["worst"], 0.0, "{strategy}: {result}");
    }
}

#[test]
fn a_truncated_file_fails_every_rank_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("model.safetensors");
    write_file(&file);
    let bytes = std::fs::read(&file).unwrap();
    std::fs::write(&file, &bytes[..bytes.len() - 100]).unwrap();
    let outputs = run(2, "FULL_SHARD", &file);
    let first = common::result_of(&outputs[0]);
    let error = first["error"].as_str().unwrap();
    assert!(
        error.contains(&file.display().to_string()) && error.contains("truncated"),
        "{error}"
    );
    let other = common::result_of(&outputs[1]);
    let error = other["error"].as_str().unwrap();
    assert!(error.contains("another rank could not read it"), "{error}");
}
