//! Experiment tracking as Accelerate's `log_with`: the trackers a run writes its metrics to
//! (JSON lines, TensorBoard event files in a folder per run under the project folder, MLflow's
//! file store), on the main process only.

use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde_json::Value;

use super::logging::append_json_line;
use super::mlflow::MlflowRun;
use super::tensorboard::EventWriter;

/// The current UTC time as a run folder's name, `YYYY-MM-DD_HH-MM-SS` (sorted by start like
/// transformers' `runs/<time>` logging folders).
pub fn run_name_now() -> String {
    run_name_at(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
    )
}

/// The run folder name of `secs` after the Unix epoch.
pub(super) fn run_name_at(secs: u64) -> String {
    let (days, rest) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}_{:02}-{:02}-{:02}",
        rest / 3600,
        rest / 60 % 60,
        rest % 60
    )
}

/// Makes a folder that did not exist: `dir`, or else `dir_2`, `dir_3`, ... (the first that
/// `mkdir` creates, so two processes never get the same one); returns it.
pub(super) fn new_folder(dir: &Path) -> std::io::Result<PathBuf> {
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)?;
    }
    let mut n = 1u32;
    loop {
        let candidate = match n {
            1 => dir.to_path_buf(),
            n => {
                let mut name = dir.as_os_str().to_owned();
                name.push(format!("_{n}"));
                PathBuf::from(name)
            }
        };
        match std::fs::create_dir(&candidate) {
            Ok(()) => return Ok(candidate),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && n < 10_000 => n += 1,
            Err(e) => return Err(e),
        }
    }
}

/// Where metrics go (Accelerate's `LoggerType`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tracker {
    /// `metrics.jsonl`: one JSON object per [`super::Accelerator::log`] call, with the step.
    JsonLines,
    /// TensorBoard event files (`events.out.tfevents.*`): numbers as scalars, the run's
    /// configuration as text.
    TensorBoard,
    /// MLflow's local file store (`project_dir/mlruns`, or `MLFLOW_TRACKING_URI`): a run in
    /// the project's experiment, the configuration as params, numbers as metrics.
    Mlflow,
}

impl Tracker {
    /// Every tracker (Accelerate's `log_with="all"`).
    pub const ALL: [Tracker; 3] = [Tracker::JsonLines, Tracker::TensorBoard, Tracker::Mlflow];

    /// Trackers from a comma-separated list of names (`jsonl`, `tensorboard`, `mlflow`, `all`), as
    /// `--report_to` takes them. An unknown name is an error listing the known ones.
    pub fn parse_list(list: &str) -> Result<Vec<Tracker>, String> {
        let mut out = Vec::new();
        for name in list.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            let found: Vec<Tracker> = if name.eq_ignore_ascii_case("all") {
                Tracker::ALL.to_vec()
            } else {
                vec![name.parse()?]
            };
            for t in found {
                if !out.contains(&t) {
                    out.push(t);
                }
            }
        }
        Ok(out)
    }
}

impl FromStr for Tracker {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "jsonl" | "json" | "json_lines" => Ok(Tracker::JsonLines),
            "tensorboard" => Ok(Tracker::TensorBoard),
            "mlflow" => Ok(Tracker::Mlflow),
            other => Err(format!(
                "unknown tracker {other:?} (known: jsonl, tensorboard, mlflow, all; wandb, comet_ml and aim need their services, which fsdp-rs does not talk to)"
            )),
        }
    }
}

/// The open trackers of a run (main process).
pub(super) struct ActiveTrackers {
    dir: PathBuf,
    json_lines: bool,
    tensorboard: Option<EventWriter>,
    mlflow: Option<MlflowRun>,
}

impl ActiveTrackers {
    /// Opens `trackers` in `dir`, writing `config` (when it is not null) as `config.json`
    /// and TensorBoard text; MLflow's run, named by `dir`'s last component, goes to the
    /// store of `project_dir` ([`super::mlflow::store_root`]).
    pub(super) fn open(
        project_dir: &Path,
        dir: &Path,
        trackers: &[Tracker],
        config: &Value,
    ) -> Result<ActiveTrackers, (PathBuf, std::io::Error)> {
        let at = |path: &Path| {
            let path = path.to_path_buf();
            move |e| (path, e)
        };
        std::fs::create_dir_all(dir).map_err(at(dir))?;
        let mut tensorboard = match trackers.contains(&Tracker::TensorBoard) {
            true => Some(EventWriter::create(dir).map_err(at(dir))?),
            false => None,
        };
        if !config.is_null() {
            let text = format!("{config:#}");
            let file = dir.join("config.json");
            std::fs::write(&file, &text).map_err(at(&file))?;
            if let Some(tb) = tensorboard.as_mut() {
                tb.text(0, "config", &format!("```json\n{text}\n```"))
                    .map_err(at(tb.path()))?;
            }
        }
        let mlflow = match trackers.contains(&Tracker::Mlflow) {
            true => {
                let root = super::mlflow::store_root(project_dir).map_err(at(project_dir))?;
                let run_name = dir
                    .file_name()
                    .map_or_else(|| "run".into(), |n| n.to_string_lossy().into_owned());
                let experiment = super::mlflow::experiment_name(project_dir);
                let run =
                    MlflowRun::start(&root, &experiment, &run_name, config).map_err(at(&root))?;
                tracing::info!(
                    "MLflow: run {run_name} of experiment {experiment} in {} (`MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri {}` shows it)",
                    run.dir().display(),
                    root.display()
                );
                Some(run)
            }
            false => None,
        };
        Ok(ActiveTrackers {
            dir: dir.to_path_buf(),
            json_lines: trackers.contains(&Tracker::JsonLines),
            tensorboard,
            mlflow,
        })
    }

    /// Ends the run: MLflow's is marked finished.
    pub(super) fn finish(&mut self) -> Result<(), (PathBuf, std::io::Error)> {
        match self.mlflow.take() {
            Some(mut run) => run
                .end(super::mlflow::RunEnd::Finished)
                .map_err(|e| (run.dir().to_path_buf(), e)),
            None => Ok(()),
        }
    }

    /// The run's folder.
    pub(super) fn dir(&self) -> &Path {
        &self.dir
    }

    /// Writes `metrics` at `step` to every tracker; returns the file that failed with the
    /// error.
    pub(super) fn log(
        &mut self,
        step: u64,
        metrics: &Value,
    ) -> Result<(), (PathBuf, std::io::Error)> {
        if self.json_lines {
            let path = self.dir.join("metrics.jsonl");
            append_json_line(&path, step, metrics.clone()).map_err(|e| (path, e))?;
        }
        let mut scalars = Vec::new();
        flatten("", metrics, &mut scalars);
        if let Some(tb) = self.tensorboard.as_mut()
            && !scalars.is_empty()
        {
            let f32s: Vec<(String, f32)> = scalars
                .iter()
                .map(|(k, v)| (k.clone(), *v as f32))
                .collect();
            tb.scalars(step, &f32s)
                .map_err(|e| (tb.path().to_path_buf(), e))?;
        }
        if let Some(run) = self.mlflow.as_ref() {
            run.log(step, &scalars)
                .map_err(|e| (run.dir().to_path_buf(), e))?;
        }
        Ok(())
    }
}

impl Drop for ActiveTrackers {
    /// Trackers dropped before [`ActiveTrackers::finish`]: the program ended early, and
    /// MLflow's run says it failed instead of running forever.
    fn drop(&mut self) {
        if let Some(run) = self.mlflow.as_mut()
            && let Err(e) = run.end(super::mlflow::RunEnd::Failed)
        {
            tracing::warn!(
                "marking MLflow's run in {} failed: {e}",
                run.dir().display()
            );
        }
    }
}

/// The numbers in `v` as scalars (TensorBoard's tags, MLflow's metric keys): an object's keys
/// and an array's indices joined with `/` (`{"lr": [1e-4, 2e-4]}` → `lr/0`, `lr/1`);
/// strings, booleans and nulls skipped.
fn flatten(prefix: &str, v: &Value, out: &mut Vec<(String, f64)>) {
    let join = |k: &str| {
        if prefix.is_empty() {
            k.to_string()
        } else {
            format!("{prefix}/{k}")
        }
    };
    match v {
        Value::Number(n) => {
            if let Some(x) = n.as_f64() {
                out.push((prefix.to_string(), x));
            }
        }
        Value::Object(m) => m.iter().for_each(|(k, v)| flatten(&join(k), v, out)),
        Value::Array(a) => a
            .iter()
            .enumerate()
            .for_each(|(i, v)| flatten(&join(&i.to_string()), v, out)),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_names_are_utc_dates_and_times() {
        assert_eq!(run_name_at(0), "1970-01-01_00-00-00");
        // 2026-12-03 09:21:27 UTC; 2024-02-29 (a leap day) 23:59:59.
        assert_eq!(run_name_at(1_796_289_687), "2026-12-03_09-21-27");
        assert_eq!(run_name_at(1_709_251_199), "2024-02-29_23-59-59");
    }

    #[test]
    fn run_folders_are_never_shared() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("runs/2026-12-05_01-02-03");
        let made: Vec<PathBuf> = (0..3).map(|_| new_folder(&dir).unwrap()).collect();
        assert_eq!(
            made,
            [
                dir.clone(),
                tmp.path().join("runs/2026-12-05_01-02-03_2"),
                tmp.path().join("runs/2026-12-05_01-02-03_3")
            ]
        );
    }

    #[test]
    fn tracker_lists_parse_like_report_to() {
        assert_eq!(Tracker::parse_list("all").unwrap(), Tracker::ALL);
        assert_eq!(
            Tracker::parse_list("tensorboard, jsonl,tensorboard").unwrap(),
            [Tracker::TensorBoard, Tracker::JsonLines]
        );
        assert!(Tracker::parse_list("").unwrap().is_empty());
        let e = Tracker::parse_list("jsonl,wandb").unwrap_err();
        assert!(
            e.contains("\"wandb\"") && e.contains("known: jsonl, tensorboard, mlflow"),
            "{e}"
        );
        assert_eq!(Tracker::parse_list("MLflow").unwrap(), [Tracker::Mlflow]);
    }

    #[test]
    fn nested_numbers_become_slash_joined_scalars() {
        let mut out = Vec::new();
        let v = serde_json::json!({"loss": 0.5, "lr": [1.0, 2.0], "eval": {"acc": 3}, "note": "x"});
        flatten("", &v, &mut out);
        let tags: Vec<&str> = out.iter().map(|(t, _)| t.as_str()).collect();
        assert_eq!(tags, ["eval/acc", "loss", "lr/0", "lr/1"]);
    }
}
