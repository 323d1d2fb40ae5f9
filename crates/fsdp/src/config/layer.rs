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

/// The torchrun variables a launched worker's layout is read from.
const LAYOUT_VARS: &[&str] = &[
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
];

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
            if LAYOUT_VARS.contains(&var) {
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

    /// A launched FSDP worker's layout from the torchrun variables (`WORLD_SIZE`,
    /// `LOCAL_WORLD_SIZE`, `NODE_RANK`, `MASTER_ADDR`, `MASTER_PORT`), so that settings
    /// checked against the layout (hybrid sharding needs several machines) resolve in the
    /// worker as they did in the launcher. Only with `ACCELERATE_USE_FSDP=true` (what
    /// `fsdp launch` sets for FSDP jobs); values that do not parse are left to the process
    /// group, which reports them.
    fn set_launch_layout(&mut self, vars: &[(String, String)]) {
        let fsdp = self
            .get(Key::DistributedType)
            .is_some_and(|s| s.value == Value::Text("FSDP".into()));
        if !fsdp {
            return;
        }
        let get = |name: &str| {
            vars.iter()
                .find(|(v, _)| v == name)
                .map(|(_, t)| t.trim().to_string())
        };
        let number = |name: &str| get(name)?.parse::<u64>().ok().filter(|n| *n > 0);
        let env = |var: &str| Source::Env { var: var.into() };
        if let Some(world) = number("WORLD_SIZE") {
            self.set(Key::NumProcesses, Value::UInt(world), env("WORLD_SIZE"));
            if let Some(local) = number("LOCAL_WORLD_SIZE").filter(|l| world % l == 0) {
                let machines = Value::UInt(world / local);
                self.set(Key::NumMachines, machines, env("LOCAL_WORLD_SIZE"));
            }
        }
        if let Some(node) = get("NODE_RANK").and_then(|t| t.parse::<u64>().ok()) {
            self.set(Key::MachineRank, Value::UInt(node), env("NODE_RANK"));
        }
        if let Some(addr) = get("MASTER_ADDR").filter(|a| !a.is_empty()) {
            self.set(Key::MainProcessIp, Value::Text(addr), env("MASTER_ADDR"));
        }
        if let Some(port) = get("MASTER_PORT").and_then(|t| t.parse::<u64>().ok()) {
            self.set(Key::MainProcessPort, Value::UInt(port), env("MASTER_PORT"));
        }
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
                    } else if LAYOUT_VARS.contains(&k.as_str()) {
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
