//! MLflow's local file store (`mlruns/`), the tracking store MLflow reads without a server:
//! one experiment per project, one run per [`super::Accelerator::init_trackers`], the run's
//! configuration as its params, every logged number appended to its metric's file, and the
//! run marked finished by [`super::Accelerator::end_training`]. The layout is MLflow's
//! `FileStore`'s: `ROOT/<experiment id>/meta.yaml`, `ROOT/<experiment id>/<run id>/{meta.yaml,
//! params/<key>, metrics/<key>, tags/<key>, artifacts/}`, a metric file holding one
//! `<milliseconds> <value> <step>` line per point.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde_json::Value;
use yaml_rust2::{Yaml, YamlEmitter, yaml::Hash};

/// MLflow's run status code of a run in progress (`RunStatus.RUNNING`).
const RUNNING: i64 = 1;

/// How a run ended, as MLflow's `RunStatus` codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum RunEnd {
    Finished = 3,
    Failed = 4,
}
/// The file whose lock serialises experiment lookups in a store (a dot file: MLflow lists
/// experiments by their folders).
const EXPERIMENTS_LOCK: &str = ".fsdp-experiments.lock";
/// MLflow's default experiment, which its store expects to exist.
const DEFAULT_EXPERIMENT: (&str, &str) = ("0", "Default");

/// Where the store is: `MLFLOW_TRACKING_URI` when set (a path or a `file:` URI, as
/// Accelerate's MLflow tracker takes it), else `project_dir/mlruns`. A server's or a
/// database's URI is an error naming it: fsdp-rs writes the file store only.
pub(super) fn store_root(project_dir: &Path) -> std::io::Result<PathBuf> {
    store_root_of(
        std::env::var("MLFLOW_TRACKING_URI").ok().as_deref(),
        project_dir,
    )
}

/// [`store_root`] with `MLFLOW_TRACKING_URI` as `uri`.
fn store_root_of(uri: Option<&str>, project_dir: &Path) -> std::io::Result<PathBuf> {
    let Some(uri) = uri.filter(|u| !u.is_empty()) else {
        return Ok(project_dir.join("mlruns"));
    };
    if let Some(path) = uri.strip_prefix("file://") {
        return Ok(PathBuf::from(path));
    }
    if let Some(path) = uri.strip_prefix("file:") {
        return Ok(PathBuf::from(path));
    }
    // MLflow takes a bare `databricks` as that service, like a `databricks://` URI.
    if uri.contains(':') || uri == "databricks" {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!(
                "MLFLOW_TRACKING_URI={uri}: fsdp-rs writes MLflow's local file store only (a folder or a file: URI); a server or database needs MLflow's own client"
            ),
        ));
    }
    Ok(PathBuf::from(uri))
}

/// The experiment a project's runs go to: `MLFLOW_EXPERIMENT_NAME` when set (as Accelerate
/// reads it), else the project folder's name.
pub(super) fn experiment_name(project_dir: &Path) -> String {
    std::env::var("MLFLOW_EXPERIMENT_NAME")
        .ok()
        .filter(|n| !n.is_empty())
        .or_else(|| {
            std::path::absolute(project_dir)
                .ok()?
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
        })
        .unwrap_or_else(|| DEFAULT_EXPERIMENT.1.to_string())
}

/// One open MLflow run.
pub(super) struct MlflowRun {
    /// `ROOT/<experiment id>/<run id>`.
    dir: PathBuf,
    /// The run's `meta.yaml` fields, rewritten when the run ends.
    meta: Hash,
}

impl MlflowRun {
    /// Starts run `run_name` in experiment `experiment` of the store at `root` (made, with
    /// MLflow's default experiment, if missing), its params from `config` (nested keys
    /// joined with `.`; null: none).
    pub(super) fn start(
        root: &Path,
        experiment: &str,
        run_name: &str,
        config: &Value,
    ) -> std::io::Result<MlflowRun> {
        std::fs::create_dir_all(root)?;
        let root = std::path::absolute(root)?;
        let experiment_id = {
            // Runs starting together in one store (several jobs, one MLFLOW_TRACKING_URI)
            // look an experiment up and make it one at a time, so a name gets one id.
            let lock = std::fs::File::create(root.join(EXPERIMENTS_LOCK))?;
            lock.lock()?;
            if !root.join(DEFAULT_EXPERIMENT.0).join("meta.yaml").is_file() {
                create_experiment(&root, DEFAULT_EXPERIMENT.0, DEFAULT_EXPERIMENT.1)?;
            }
            match find_experiment(&root, experiment)? {
                Some(id) => id,
                None => {
                    let id = new_experiment_id(&root)?;
                    create_experiment(&root, &id, experiment)?;
                    id
                }
            }
        };
        let run_id = hex(&random_bytes::<16>());
        let dir = root.join(&experiment_id).join(&run_id);
        for sub in ["metrics", "params", "tags", "artifacts"] {
            std::fs::create_dir_all(dir.join(sub))?;
        }
        let user = std::env::var("USER").unwrap_or_else(|_| "unknown".into());
        let source = std::env::args().next().unwrap_or_default();
        let mut meta = Hash::new();
        let mut put = |k: &str, v: Yaml| meta.insert(Yaml::String(k.into()), v);
        let text = |s: &str| Yaml::String(s.to_string());
        put(
            "artifact_uri",
            text(&format!("file://{}", dir.join("artifacts").display())),
        );
        put("end_time", Yaml::Null);
        put("entry_point_name", text(""));
        put("experiment_id", text(&experiment_id));
        put("lifecycle_stage", text("active"));
        put("run_id", text(&run_id));
        put("run_name", text(run_name));
        put("run_uuid", text(&run_id));
        put("source_name", text(""));
        // SourceType.LOCAL.
        put("source_type", Yaml::Integer(4));
        put("source_version", text(""));
        put("start_time", Yaml::Integer(now_millis()));
        put("status", Yaml::Integer(RUNNING));
        put("tags", Yaml::Array(Vec::new()));
        put("user_id", text(&user));
        let run = MlflowRun { dir, meta };
        for (tag, value) in [
            ("mlflow.runName", run_name),
            ("mlflow.user", &user),
            ("mlflow.source.name", &source),
            ("mlflow.source.type", "LOCAL"),
        ] {
            std::fs::write(run.dir.join("tags").join(tag), value)?;
        }
        let mut params = Vec::new();
        flatten_params("", config, &mut params);
        for (key, value) in params {
            std::fs::write(run.dir.join("params").join(key_path(&key)), value)?;
        }
        run.write_meta()?;
        Ok(run)
    }

    /// The run's folder.
    pub(super) fn dir(&self) -> &Path {
        &self.dir
    }

    /// Appends each of `scalars` (MLflow metric key, value) as a point at `step`.
    pub(super) fn log(&self, step: u64, scalars: &[(String, f64)]) -> std::io::Result<()> {
        let millis = now_millis();
        for (key, value) in scalars {
            let file = self.dir.join("metrics").join(key_path(key));
            if let Some(parent) = file.parent() {
                std::fs::create_dir_all(parent)?;
            }
            // One write per line, so a reader never sees half of one.
            let line = format!("{millis} {} {step}\n", python_float(*value));
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&file)?
                .write_all(line.as_bytes())?;
        }
        Ok(())
    }

    /// Marks the run ended now, as `how`.
    pub(super) fn end(&mut self, how: RunEnd) -> std::io::Result<()> {
        let mut put = |k: &str, v: Yaml| self.meta.insert(Yaml::String(k.into()), v);
        put("end_time", Yaml::Integer(now_millis()));
        put("status", Yaml::Integer(how as i64));
        self.write_meta()
    }

    fn write_meta(&self) -> std::io::Result<()> {
        write_yaml(&self.dir.join("meta.yaml"), &self.meta)
    }
}

/// A metric or param key as a path under its folder: MLflow keeps `/` as sub-folders and
/// allows letters, digits, `_ - . / :` and spaces; anything else, and a `..` or empty
/// component, becomes `_`.
fn key_path(key: &str) -> PathBuf {
    let clean: String = key
        .chars()
        .map(|c| match c {
            c if c.is_alphanumeric() => c,
            '_' | '-' | '.' | '/' | ':' | ' ' => c,
            _ => '_',
        })
        .collect();
    clean
        .split('/')
        .map(|part| match part {
            "" | "." | ".." => "_",
            p => p,
        })
        .collect()
}

/// `v` as Python's `float()` reads it back exactly (`nan`, `inf` included).
fn python_float(v: f64) -> String {
    match v {
        v if v.is_nan() => "nan".into(),
        v if v.is_infinite() => (if v > 0.0 { "inf" } else { "-inf" }).into(),
        v => format!("{v:?}"),
    }
}

/// A run's configuration as MLflow params: nested objects' keys joined with `.`, strings
/// as they are, everything else as its JSON text.
fn flatten_params(prefix: &str, v: &Value, out: &mut Vec<(String, String)>) {
    match v {
        Value::Null if prefix.is_empty() => {}
        Value::Object(m) => {
            for (k, v) in m {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                flatten_params(&key, v, out);
            }
        }
        Value::String(s) => out.push((prefix.to_string(), s.clone())),
        other => out.push((prefix.to_string(), other.to_string())),
    }
}

/// The id of the experiment named `name` in the store at `root`, if one is there.
fn find_experiment(root: &Path, name: &str) -> std::io::Result<Option<String>> {
    for entry in std::fs::read_dir(root)? {
        let path = entry?.path();
        let Ok(text) = std::fs::read_to_string(path.join("meta.yaml")) else {
            continue;
        };
        let Ok(docs) = yaml_rust2::YamlLoader::load_from_str(&text) else {
            continue;
        };
        let doc = docs.first();
        let field = |k: &str| doc.and_then(|d| d[k].as_str().map(str::to_string));
        if field("name").as_deref() == Some(name)
            && field("lifecycle_stage").as_deref() == Some("active")
            && let Some(id) = field("experiment_id")
        {
            return Ok(Some(id));
        }
    }
    Ok(None)
}

/// A new experiment id (as MLflow makes them: a random positive number) whose folder did
/// not exist; the folder is made.
fn new_experiment_id(root: &Path) -> std::io::Result<String> {
    loop {
        let id = (u64::from_le_bytes(random_bytes::<8>()) >> 4).to_string();
        match std::fs::create_dir(root.join(&id)) {
            Ok(()) => return Ok(id),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
}

/// Writes experiment `id`'s `meta.yaml` in `root`.
fn create_experiment(root: &Path, id: &str, name: &str) -> std::io::Result<()> {
    let dir = root.join(id);
    std::fs::create_dir_all(&dir)?;
    let now = now_millis();
    let mut meta = Hash::new();
    let mut put = |k: &str, v: Yaml| meta.insert(Yaml::String(k.into()), v);
    put(
        "artifact_location",
        Yaml::String(format!("file://{}", dir.display())),
    );
    put("creation_time", Yaml::Integer(now));
    put("experiment_id", Yaml::String(id.into()));
    put("last_update_time", Yaml::Integer(now));
    put("lifecycle_stage", Yaml::String("active".into()));
    put("name", Yaml::String(name.into()));
    write_yaml(&dir.join("meta.yaml"), &meta)
}

/// Writes `fields` as a YAML mapping, put in place by a rename so a reader never sees half.
fn write_yaml(path: &Path, fields: &Hash) -> std::io::Result<()> {
    let mut text = String::new();
    YamlEmitter::new(&mut text)
        .dump(&Yaml::Hash(fields.clone()))
        .map_err(|e| std::io::Error::other(format!("{}: {e}", path.display())))?;
    text.push('\n');
    let partial = path.with_extension("yaml.partial");
    std::fs::write(&partial, text)?;
    std::fs::rename(&partial, path)
}

fn now_millis() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// `N` bytes from the system's random source (the time and process id where it cannot be
/// read: ids need only be unlikely to repeat).
fn random_bytes<const N: usize>() -> [u8; N] {
    let mut bytes = [0u8; N];
    let read = std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut bytes));
    if read.is_err() {
        let seed = now_millis() as u128 ^ (u128::from(std::process::id()) << 64);
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (seed >> (8 * (i % 16))) as u8;
        }
    }
    bytes
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_store_is_a_folder_and_a_servers_uri_is_refused() {
        let project = Path::new("out");
        assert_eq!(
            store_root_of(None, project).unwrap(),
            project.join("mlruns")
        );
        assert_eq!(
            store_root_of(Some(""), project).unwrap(),
            project.join("mlruns")
        );
        for (uri, path) in [
            ("file:///srv/mlruns", "/srv/mlruns"),
            ("file:rel/mlruns", "rel/mlruns"),
            ("/srv/mlruns", "/srv/mlruns"),
        ] {
            assert_eq!(store_root_of(Some(uri), project).unwrap(), Path::new(path));
        }
        for uri in ["http://localhost:5000", "sqlite:///mlflow.db", "databricks"] {
            let e = store_root_of(Some(uri), project).unwrap_err().to_string();
            assert!(e.contains(uri) && e.contains("file store only"), "{e}");
        }
    }

    #[test]
    fn runs_starting_together_share_one_experiment() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("mlruns");
        let runs: Vec<PathBuf> = std::thread::scope(|s| {
            let started: Vec<_> = (0..8)
                .map(|i| {
                    let root = &root;
                    s.spawn(move || {
                        let name = format!("run{i}");
                        MlflowRun::start(root, "shared", &name, &Value::Null)
                            .unwrap()
                            .dir()
                            .to_path_buf()
                    })
                })
                .collect();
            started.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let experiments: std::collections::BTreeSet<_> = runs
            .iter()
            .map(|r| r.parent().unwrap().to_path_buf())
            .collect();
        assert_eq!(experiments.len(), 1, "{experiments:?}");
        let folders = std::fs::read_dir(&root)
            .unwrap()
            .filter(|e| e.as_ref().unwrap().path().is_dir())
            .count();
        assert_eq!(folders, 2, "the default experiment and one more");
    }

    #[test]
    fn keys_stay_inside_their_folder() {
        assert_eq!(key_path("lr/0"), Path::new("lr/0"));
        assert_eq!(key_path("../../etc/passwd"), Path::new("_/_/etc/passwd"));
        assert_eq!(key_path("/abs"), Path::new("_/abs"));
        assert_eq!(key_path("a\nb*c"), Path::new("a_b_c"));
    }

    #[test]
    fn values_read_back_as_python_floats() {
        assert_eq!(python_float(0.5), "0.5");
        assert_eq!(python_float(2e-5), "2e-5");
        assert_eq!(python_float(1.0), "1.0");
        assert_eq!(python_float(f64::NAN), "nan");
        assert_eq!(python_float(f64::NEG_INFINITY), "-inf");
        for v in [0.1, 1.0 / 3.0, 1e300, 5e-324, -123456.789] {
            assert_eq!(python_float(v).parse::<f64>().unwrap(), v);
        }
    }

    #[test]
    fn a_run_is_laid_out_as_mlflows_file_store() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("mlruns");
        let config = serde_json::json!({"lr": 2e-5, "model": {"name": "bert"}, "tag": "x"});
        let mut run = MlflowRun::start(&root, "nlp", "2026-12-05_01-02-03", &config).unwrap();
        run.log(1, &[("loss".into(), 0.5), ("lr/0".into(), 1e-5)])
            .unwrap();
        run.log(2, &[("loss".into(), 0.25)]).unwrap();
        run.end(RunEnd::Finished).unwrap();
        let read = |p: &str| std::fs::read_to_string(run.dir().join(p)).unwrap();
        let lines: Vec<Vec<String>> = read("metrics/loss")
            .lines()
            .map(|l| l.split(' ').map(String::from).collect())
            .collect();
        assert_eq!(
            lines
                .iter()
                .map(|l| (&l[1][..], &l[2][..]))
                .collect::<Vec<_>>(),
            [("0.5", "1"), ("0.25", "2")]
        );
        assert_eq!(read("metrics/lr/0").split(' ').nth(1), Some("1e-5"));
        assert_eq!(read("params/lr").parse::<f64>().unwrap(), 2e-5);
        assert_eq!(read("params/model.name"), "bert");
        assert_eq!(read("params/tag"), "x");
        assert_eq!(read("tags/mlflow.runName"), "2026-12-05_01-02-03");
        let meta = yaml_rust2::YamlLoader::load_from_str(&read("meta.yaml")).unwrap();
        assert_eq!(meta[0]["status"].as_i64(), Some(RunEnd::Finished as i64));
        assert_eq!(meta[0]["run_name"].as_str(), Some("2026-12-05_01-02-03"));
        // A second run of the experiment joins it; the default experiment exists.
        let second = MlflowRun::start(&root, "nlp", "again", &Value::Null).unwrap();
        assert_eq!(second.dir().parent(), run.dir().parent());
        assert!(root.join("0/meta.yaml").is_file());
        let experiment = run.dir().parent().unwrap().join("meta.yaml");
        let meta = std::fs::read_to_string(experiment).unwrap();
        assert!(meta.contains("name: nlp"), "{meta}");
    }
}
