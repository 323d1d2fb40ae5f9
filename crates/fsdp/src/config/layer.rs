//! A layer of settings from one kind of source (file, environment, command line, code), and
//! reading and writing Accelerate YAML files.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::error::ConfigError;
use super::schema::{FSDP_SECTION, Key, Section, names_in};
use super::value::{Setting, Source, Value, parse_bool, parse_node, parse_text};
use super::yaml::{self, Node, NodeKind};

/// Settings from one kind of source, keyed by canonical key.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Layer {
    settings: BTreeMap<Key, Setting>,
}

/// Whether `var` is one of a cluster launcher's (SLURM's `srun`, Open MPI's `mpirun`, MPICH's
/// Hydra) that a worker's layout is read from.
pub(crate) fn is_cluster_layout_var(var: &str) -> bool {
    ["SLURM_", "OMPI_", "PMI_", "MPI_LOCAL"]
        .iter()
        .any(|p| var.starts_with(p))
}

/// Whether `var` is one a launched worker's layout is read from: the torchrun contract
/// (`fsdp launch`'s), or a cluster launcher's (SLURM's `srun`, Open MPI's `mpirun`).
fn is_layout_var(var: &str) -> bool {
    matches!(
        var,
        "RANK"
            | "WORLD_SIZE"
            | "LOCAL_RANK"
            | "LOCAL_WORLD_SIZE"
            | "NODE_RANK"
            | "GROUP_RANK"
            | "MASTER_ADDR"
            | "MASTER_PORT"
    ) || is_cluster_layout_var(var)
}

impl Layer {
    /// An empty layer.
    pub fn new() -> Layer {
        Layer::default()
    }

    /// Sets a key, replacing any earlier value in this layer.
    pub fn set(&mut self, key: Key, value: Value, source: Source) {
        self.settings.insert(key, Setting { value, source });
    }

    /// Removes a key from this layer.
    pub fn unset(&mut self, key: Key) {
        self.settings.remove(&key);
    }

    /// The setting for a key, if this layer has one.
    pub fn get(&self, key: Key) -> Option<&Setting> {
        self.settings.get(&key)
    }

    /// All settings in key order.
    pub fn iter(&self) -> impl Iterator<Item = (Key, &Setting)> {
        self.settings.iter().map(|(k, s)| (*k, s))
    }

    /// True when the layer has no settings.
    pub fn is_empty(&self) -> bool {
        self.settings.is_empty()
    }

    /// Reads an Accelerate-style YAML config file (at most 1 MiB: a device or a huge file
    /// given by mistake is refused, not read into memory).
    pub fn from_yaml_file(path: &Path) -> Result<Layer, ConfigError> {
        use std::io::Read;
        const LIMIT: u64 = 1 << 20;
        let read_error = |source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        };
        let mut bytes = Vec::new();
        std::fs::File::open(path)
            .and_then(|f| f.take(LIMIT + 1).read_to_end(&mut bytes))
            .map_err(read_error)?;
        if bytes.len() as u64 > LIMIT {
            return Err(read_error(std::io::Error::other(
                "larger than 1 MiB, which no config file is",
            )));
        }
        let text = String::from_utf8(bytes)
            .map_err(|_| read_error(std::io::Error::other("not UTF-8 text")))?;
        Layer::from_yaml_str(&text, path)
    }

    /// Parses YAML text; `path` is used in messages. Every problem in the file is reported.
    pub fn from_yaml_str(text: &str, path: &Path) -> Result<Layer, ConfigError> {
        let root = yaml::parse(text).map_err(|e| ConfigError::Syntax {
            path: path.to_path_buf(),
            line: e.line,
            col: e.col,
            message: e.message,
        })?;
        let mut reader = FileReader {
            path: path.to_path_buf(),
            layer: Layer::new(),
            errors: Vec::new(),
        };
        if root.is_null() {
            return Ok(reader.layer);
        }
        match root.kind {
            NodeKind::Map(entries) => reader.read_section(Section::Top, entries),
            _ => reader.errors.push(ConfigError::Structure {
                origin: reader.origin(root.line),
                message: "the config file must be a mapping of keys to values".into(),
            }),
        }
        ConfigError::collect(reader.errors)?;
        Ok(reader.layer)
    }

    /// Reads the settings named by environment variables (`FSDP_*`, `ACCELERATE_*`).
    pub fn from_env_vars<I, K, V>(vars: I) -> Result<Layer, ConfigError>
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<str>,
        V: AsRef<str>,
    {
        let mut layer = Layer::new();
        let mut errors = Vec::new();
        let mut layout: Vec<(String, String)> = Vec::new();
        for (var, text) in vars {
            let (var, text) = (var.as_ref(), text.as_ref());
            if is_layout_var(var) {
                layout.push((var.to_string(), text.to_string()));
            }
            let Some(key) = Key::from_env_var(var) else {
                continue;
            };
            let origin = Source::Env {
                var: var.to_string(),
            };
            let parsed = if key == Key::DistributedType {
                // ACCELERATE_USE_FSDP is a switch, not a distributed type.
                match parse_bool(text.trim()) {
                    Ok(true) => Some(Ok(Value::Text("FSDP".into()))),
                    Ok(false) => None,
                    Err(reason) => Some(Err(reason)),
                }
            } else {
                Some(parse_text(key.spec(), text))
            };
            match parsed {
                Some(Ok(value)) => layer.set(key, value, origin),
                Some(Err(reason)) => errors.push(ConfigError::InvalidValue {
                    origin,
                    key: key.name(),
                    value: text.to_string(),
                    reason,
                }),
                None => {}
            }
        }
        ConfigError::collect(errors)?;
        layer.set_launch_layout(&layout);
        Ok(layer)
    }

    /// A launched worker's layout — processes, machines, this machine's rank, the
    /// rendezvous address — from its launcher's variables (`fsdp launch`'s torchrun
    /// contract, or SLURM's / Open MPI's as `fsdp_comm::WorldInfo` reads them), so that
    /// settings checked against the layout (hybrid sharding needs several machines) resolve
    /// in the worker as they did in the launcher. With the torchrun contract only under
    /// `ACCELERATE_USE_FSDP=true` (what `fsdp launch` sets for FSDP jobs); a layout that does
    /// not parse is left to the process group, which reports it.
    fn set_launch_layout(&mut self, vars: &[(String, String)]) {
        use fsdp_comm::{Launcher, WorldInfo};
        let fsdp = self
            .get(Key::DistributedType)
            .is_some_and(|s| s.value == Value::Text("FSDP".into()));
        let map: std::collections::HashMap<String, String> = vars.iter().cloned().collect();
        let Ok(w) = WorldInfo::from_vars(&map) else {
            return;
        };
        // The variables each value comes from, for messages.
        let (size, local, node, addr) = match w.launcher {
            Launcher::Torchrun if fsdp => {
                ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR")
            }
            Launcher::Slurm => (
                "SLURM_NTASKS",
                "SLURM_TASKS_PER_NODE",
                "SLURM_NODEID",
                "SLURM_JOB_NODELIST",
            ),
            Launcher::Mpich => ("PMI_SIZE", "MPI_LOCALNRANKS", "PMI_RANK", "MASTER_ADDR"),
            Launcher::OpenMpi => (
                "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_LOCAL_SIZE",
                "OMPI_COMM_WORLD_RANK",
                "MASTER_ADDR",
            ),
            _ => return,
        };
        let env = |var: &str| Source::Env { var: var.into() };
        let (world, per_machine) = (w.world_size as u64, w.local_world_size as u64);
        self.set(Key::NumProcesses, Value::UInt(world), env(size));
        if per_machine > 0 && world.is_multiple_of(per_machine) {
            self.set(
                Key::NumMachines,
                Value::UInt(world / per_machine),
                env(local),
            );
        }
        self.set(Key::MachineRank, Value::UInt(w.node_rank as u64), env(node));
        // Under a cluster launcher the address is its (MPI needs none; the process group
        // reports one it cannot reach).
        if map.contains_key("MASTER_ADDR") || w.launcher != Launcher::Torchrun {
            self.set(
                Key::MainProcessIp,
                Value::Text(w.master_addr.clone()),
                env(addr),
            );
        }
        if map.contains_key("MASTER_PORT") {
            self.set(
                Key::MainProcessPort,
                Value::UInt(u64::from(w.master_port)),
                env("MASTER_PORT"),
            );
        }
    }

    /// Removes what a cluster launcher's variables set (`SLURM_*`, `OMPI_*`, `PMI_*`): for
    /// `fsdp launch` run as a task of `srun`, the step's task count is the launchers', not
    /// the job's processes.
    pub fn drop_cluster_layout(&mut self) {
        self.settings
            .retain(|_, s| !matches!(&s.source, Source::Env { var } if is_cluster_layout_var(var)));
    }

    /// Reads this process's environment. A variable the configuration reads whose value is
    /// not UTF-8 text is an error naming it (never silently skipped, which would let the
    /// file's value run).
    pub fn from_process_env() -> Result<Layer, ConfigError> {
        let mut vars = Vec::new();
        let mut errors = Vec::new();
        for (k, v) in std::env::vars_os() {
            let Ok(k) = k.into_string() else { continue };
            match v.into_string() {
                Ok(v) => vars.push((k, v)),
                Err(v) => {
                    if let Some(key) = Key::from_env_var(&k) {
                        errors.push(ConfigError::InvalidValue {
                            origin: Source::Env { var: k },
                            key: key.name(),
                            value: v.to_string_lossy().into_owned(),
                            reason: "not UTF-8 text".into(),
                        });
                    } else if is_layout_var(&k) {
                        errors.push(ConfigError::Structure {
                            origin: Source::Env { var: k },
                            message: format!("`{}` is not UTF-8 text", v.to_string_lossy()),
                        });
                    }
                }
            }
        }
        ConfigError::collect(errors)?;
        Layer::from_env_vars(vars)
    }

    /// Writes the layer as an Accelerate YAML file: keys sorted, FSDP keys under
    /// `fsdp_config` (written as `{}` when there are none), canonical spellings.
    pub fn to_yaml(&self) -> String {
        let node_entries = |section: Section| -> Vec<(String, Node)> {
            self.iter()
                .filter(|(k, _)| k.spec().section == section)
                .map(|(k, s)| (k.name().to_string(), s.value.to_node()))
                .collect()
        };
        let fsdp: Vec<(Node, Node)> = {
            let mut entries = node_entries(Section::Fsdp);
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            entries
                .into_iter()
                .map(|(k, v)| (Node::plain(k), v))
                .collect()
        };
        let mut top = node_entries(Section::Top);
        top.push((
            FSDP_SECTION.to_string(),
            Node {
                line: 0,
                kind: NodeKind::Map(fsdp),
            },
        ));
        top.sort_by(|a, b| a.0.cmp(&b.0));
        yaml::emit(&top)
    }

    /// Writes the layer to a file atomically (temporary file, then rename), creating parent
    /// directories.
    pub fn write_yaml_file(&self, path: &Path) -> Result<(), ConfigError> {
        let write_err = |source| ConfigError::Write {
            path: path.to_path_buf(),
            source,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(write_err)?;
        }
        let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
        std::fs::write(&tmp, self.to_yaml()).map_err(write_err)?;
        std::fs::rename(&tmp, path).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            write_err(e)
        })
    }
}

/// Reads one file's mappings into a layer, collecting every error.
struct FileReader {
    path: PathBuf,
    layer: Layer,
    errors: Vec<ConfigError>,
}

impl FileReader {
    fn origin(&self, line: usize) -> Source {
        Source::File {
            path: self.path.clone(),
            line,
        }
    }

    fn read_section(&mut self, section: Section, entries: Vec<(Node, Node)>) {
        for (key_node, value) in entries {
            let name = key_node.as_scalar().unwrap_or_default().to_string();
            let origin = self.origin(key_node.line);
            if section == Section::Top && name == FSDP_SECTION {
                match value.kind {
                    NodeKind::Map(inner) => self.read_section(Section::Fsdp, inner),
                    _ if value.is_null() => {}
                    _ => self.errors.push(ConfigError::Structure {
                        origin,
                        message: format!("`{FSDP_SECTION}` must be a mapping of fsdp_* keys"),
                    }),
                }
                continue;
            }
            let Some(key) = Key::from_yaml_name(section, &name) else {
                self.errors.push(ConfigError::UnknownKey {
                    origin,
                    suggestion: nearest(&name, section),
                    section: (section == Section::Fsdp).then_some(FSDP_SECTION),
                    key: name,
                });
                continue;
            };
            if let Some(first) = self.layer.get(key) {
                self.errors.push(ConfigError::Duplicate {
                    origin,
                    key: key.name(),
                    first: first.source.clone(),
                });
                continue;
            }
            if value.is_null() {
                // `key: null` means "not set", as Accelerate writes optional values.
                continue;
            }
            match parse_node(key.spec(), &value) {
                Ok(v) => self.layer.set(key, v, origin),
                Err(reason) => self.errors.push(ConfigError::InvalidValue {
                    origin,
                    key: key.name(),
                    value: describe_node(&value),
                    reason,
                }),
            }
        }
    }
}

fn describe_node(node: &Node) -> String {
    match &node.kind {
        NodeKind::Scalar { text, .. } => text.clone(),
        NodeKind::Seq(_) => "[...]".into(),
        NodeKind::Map(_) => "{...}".into(),
    }
}

/// The valid key closest to a misspelt one, when it is close enough to be a likely typo. Keys
/// of the other section count too (an `fsdp_*` key written at the top level is common).
fn nearest(name: &str, section: Section) -> Option<String> {
    let other = match section {
        Section::Top => Section::Fsdp,
        Section::Fsdp => Section::Top,
    };
    let candidates = names_in(section)
        .map(|c| (c, section))
        .chain(names_in(other).map(|c| (c, other)));
    let (candidate, found_in) = candidates
        .map(|(c, s)| (strsim::damerau_levenshtein(name, c), c, s))
        .filter(|(d, c, _)| *d <= (c.len() / 3).max(2))
        .min_by_key(|(d, _, _)| *d)
        .map(|(_, c, s)| (c, s))?;
    Some(match (found_in == section, found_in) {
        (true, _) => format!("`{candidate}`"),
        (false, Section::Fsdp) => format!("`{candidate}` inside `{FSDP_SECTION}`"),
        (false, Section::Top) => format!("`{candidate}` at the top level"),
    })
}
