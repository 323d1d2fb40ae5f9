//! Using a model against FULL_SHARD's rules gives errors that name the parameter and the unit,
//! on every rank, never a hang or a silently wrong gradient: a parameter read after its unit
//! released it, a parameter tensor kept from inside its unit and used after it (found before
//! backward from the NaN poisoning of debug mode), a unit whose output never reaches `module_output`, and a
//! model whose graph differs between ranks (a mismatched collective). Two real processes.
//! Outside debug mode, a unit whose output never reaches `module_output` trains but is warned
//! about once (in process).

use std::collections::BTreeMap;
use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use fsdp::config::{FsdpPlugin, Layer};
use fsdp::engine::Fsdp;
use fsdp::nn::layers::Linear;
use fsdp::nn::{Forward, LocalParams, Module, ModuleInfo, Params};
use fsdp::optim::{Sgd, SgdConfig};
use fsdp_comm::ProcessGroup;

use crate::common;

const ROLE: &str = "FSDP_USAGE_WORKER";

/// A block holding one linear layer (a unit under the wrap policy below).
struct Block {
    path: String,
    lin: Linear,
}

impl Block {
    fn new(path: &str) -> Block {
        Block {
            path: path.into(),
            lin: Linear::new(format!("{path}.lin"), 8, 8, 0.2),
        }
    }
}

impl Module for Block {
    fn path(&self) -> &str {
        &self.path
    }

    fn info(&self) -> ModuleInfo {
        ModuleInfo::new(self.path.clone(), "Block").child(self.lin.info())
    }
}

impl Forward<&Tensor> for Block {
    type Output = Tensor;

    fn forward(&self, p: &dyn Params, x: &Tensor) -> candle_core::Result<Tensor> {
        self.lin.call(p, x)
    }
}

struct Toy {
    a: Block,
    b: Block,
    head: Linear,
}

fn toy() -> Toy {
    Toy {
        a: Block::new("a"),
        b: Block::new("b"),
        head: Linear::new("head".into(), 8, 2, 0.2),
    }
}

impl Toy {
    fn info(&self) -> ModuleInfo {
        ModuleInfo::new("", "Toy")
            .child(self.a.info())
            .child(self.b.info())
            .child(self.head.info())
    }
}

#[derive(Clone, Copy, Debug)]
enum Misuse {
    None,
    ReadAfterRelease,
    HeldAcrossUnits,
    NotHooked,
}

fn forward(t: &Toy, p: &dyn Params, x: &Tensor, misuse: Misuse) -> candle_core::Result<Tensor> {
    let held = p.get("a.lin.weight")?;
    let mut h = t.a.call(p, x)?;
    match misuse {
        Misuse::ReadAfterRelease => {
            h = (h + t.a.lin.call(p, x)?)?;
        }
        Misuse::HeldAcrossUnits => {
            h = (h + x.matmul(&held.t()?)?)?;
        }
        _ => {}
    }
    // `forward` instead of `call`: the block's output is never reported.
    h = if matches!(misuse, Misuse::NotHooked) {
        t.b.forward(p, &h)?
    } else {
        t.b.call(p, &h)?
    };
    t.head.call(p, &h)?.sqr()?.sum_all()
}

fn attempt(pg: &std::sync::Arc<ProcessGroup>, misuse: Misuse) -> Result<(), String> {
    train(pg.clone(), misuse, true, 1)
}

/// `steps` steps of SGD on the toy model, misused as `misuse` says.
fn train(
    pg: std::sync::Arc<dyn fsdp_comm::Communicator>,
    misuse: Misuse,
    debug: bool,
    steps: usize,
) -> Result<(), String> {
    let model = toy();
    let info = model.info();
    let init = LocalParams::init(&info, 3, DType::F32, &Device::Cpu).unwrap();
    let plugin = common::tiny::block_units()
        .resolve(&Layer::new(), None)
        .unwrap()
        .fsdp;
    let mut engine =
        Fsdp::new(&info, &init.tensors(), &plugin, &[], pg).map_err(|e| e.to_string())?;
    engine.set_debug(debug);
    let x = Tensor::ones((3, 8), DType::F32, &Device::Cpu).unwrap();
    let mut sgd = Sgd::new(SgdConfig::default()).map_err(|e| e.to_string())?;
    for _ in 0..steps {
        let params = engine.begin_step().map_err(|e| e.to_string())?;
        let loss = forward(&model, &params, &x, misuse).map_err(|e| e.to_string())?;
        engine
            .backward(params, loss, true)
            .map_err(|e| e.to_string())?;
        engine.step(&mut sgd).map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// What `tracing` wrote while `f` ran on this thread.
fn logs_of(f: impl FnOnce()) -> String {
    #[derive(Clone, Default)]
    struct Shared(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);
    impl std::io::Write for Shared {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let buf = Shared::default();
    let writer = buf.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    tracing::subscriber::with_default(subscriber, f);
    String::from_utf8(buf.0.lock().unwrap().clone()).unwrap()
}

#[test]
fn a_unit_run_with_forward_trains_but_is_warned_about_once_outside_debug_mode() {
    // Two ranks on threads (on one rank nothing is released after forward); each thread's
    // logs, in rank order.
    let logs = |misuse: Misuse| -> Vec<String> {
        let threads: Vec<_> = fsdp_comm::LocalGroup::create(2)
            .into_iter()
            .map(|group| {
                std::thread::spawn(move || {
                    logs_of(|| train(std::sync::Arc::new(group), misuse, false, 3).unwrap())
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    };
    let ranks = logs(Misuse::NotHooked);
    let warnings: Vec<&str> = ranks[0].lines().filter(|l| l.contains("WARN")).collect();
    assert_eq!(warnings.len(), 1, "{ranks:?}");
    assert!(
        warnings[0].contains("unit `b`")
            && warnings[0].contains("module_output")
            && warnings[0].contains("Forward::call")
            && !warnings[0].contains("unit `a`"),
        "{ranks:?}"
    );
    assert!(!ranks[1].contains("WARN"), "only rank 0 reports: {ranks:?}");
    for (rank, l) in logs(Misuse::None).iter().enumerate() {
        assert!(!l.contains("WARN"), "rank {rank}: {l}");
    }
}

#[test]
#[ignore = "a worker entry: its parent test runs it as real processes"]
fn usage_worker() {
    if std::env::var(ROLE).is_err() {
        return;
    }
    let pg = std::sync::Arc::new(ProcessGroup::from_env().unwrap());
    let mut out = BTreeMap::new();
    for misuse in [
        Misuse::None,
        Misuse::ReadAfterRelease,
        Misuse::HeldAcrossUnits,
        Misuse::NotHooked,
        Misuse::None,
    ] {
        let result = attempt(&pg, misuse);
        out.insert(
            format!("{misuse:?}"),
            result.err().unwrap_or_else(|| "ok".into()),
        );
    }
    // Ranks whose graphs differ: rank 1 skips unit b's hook, so its backward order and
    // collectives differ; every rank must stop with an error instead of hanging.
    let diverged = attempt(
        &pg,
        if pg.rank() == 1 {
            Misuse::NotHooked
        } else {
            Misuse::None
        },
    );
    out.insert(
        "Diverged".into(),
        diverged.err().unwrap_or_else(|| "ok".into()),
    );
    println!("RESULT {}", serde_json::json!(out));
}

#[test]
fn misuse_is_an_error_naming_the_parameter_and_unit() {
    let outputs = common::run_workers(
        "usage_worker",
        ROLE,
        2,
        &[("FSDP_COMM_TIMEOUT_SECS", "20")],
        Duration::from_secs(120),
    );
    for (rank, output) in outputs.iter().enumerate() {
        let r = common::result_of(output);
        let get = |k: &str| r[k].as_str().unwrap().to_string();
        assert_eq!(get("None"), "ok", "rank {rank}");
        let e = get("ReadAfterRelease");
        assert!(
            e.contains("`a.lin.weight`") && e.contains("unit `a`") && e.contains("released"),
            "rank {rank}: {e}"
        );
        let e = get("HeldAcrossUnits");
        assert!(
            e.contains("`a.lin.weight`")
                && e.contains("unit `a`")
                && e.contains("used outside its unit")
                && !e.contains("b.lin"),
            "rank {rank}: {e}"
        );
        let e = get("NotHooked");
        assert!(
            e.contains("unit `b`") && e.contains("module_output"),
            "rank {rank}: {e}"
        );
        let e = get("Diverged");
        assert_ne!(e, "ok", "rank {rank}: diverged ranks must fail");
        eprintln!("rank {rank} diverged: {e}");
        eprintln!("rank {rank} held: {}", get("HeldAcrossUnits"));
    }
}

#[test]
fn a_trace_folder_that_cannot_be_written_is_an_error_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("not_a_folder");
    std::fs::write(&file, b"x").unwrap();
    let plugin = FsdpPlugin::builder()
        .trace_dir(file.join("trace").to_str().unwrap())
        .resolve(&Layer::new(), None)
        .unwrap()
        .fsdp;
    let model = common::tiny::model(0.0);
    let init = LocalParams::init(&model.info(), 1, DType::F32, &Device::Cpu)
        .unwrap()
        .tensors();
    let err = Fsdp::wrap(
        &model,
        &init,
        &plugin,
        std::sync::Arc::new(fsdp_comm::SingleRank::new(0)),
    )
    .err()
    .expect("the trace folder is refused")
    .to_string();
    assert!(
        err.contains("fsdp_trace_dir") && err.contains("not_a_folder/trace"),
        "{err}"
    );
}
