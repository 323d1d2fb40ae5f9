//! Facts about this machine for `fsdp env` and for defaults: OS, CPU, memory, CUDA/NCCL.

use std::path::{Path, PathBuf};

/// What `fsdp env` reports about the machine.
#[derive(Debug, Clone)]
pub struct SystemInfo {
    /// Distribution name and kernel release.
    pub os: String,
    /// CPU architecture.
    pub arch: &'static str,
    /// CPU model name.
    pub cpu_model: String,
    /// Logical CPUs this process may run on.
    pub available_cores: usize,
    /// Total memory in bytes, if known.
    pub mem_total: Option<u64>,
    /// Available memory in bytes, if known.
    pub mem_available: Option<u64>,
    /// NVIDIA kernel driver version, if loaded.
    pub nvidia_driver: Option<String>,
    /// Path of the CUDA driver library, if found.
    pub libcuda: Option<PathBuf>,
    /// Where NCCL's library is, and whether the `nccl` feature can load it.
    pub libnccl: NcclLibrary,
}

/// NCCL's shared library as the `nccl` feature (cudarc) loads it: by the name `libnccl.so`,
/// which NCCL's development package provides; a runtime-only install (pip's
/// `nvidia-nccl-cu*`, Debian's `libnccl2`) has only `libnccl.so.2`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NcclLibrary {
    /// `libnccl.so` is on the search path.
    Loadable(PathBuf),
    /// Only `libnccl.so.2` was found: NCCL loads once it is linked as `libnccl.so`.
    RuntimeOnly(PathBuf),
    /// Neither name was found.
    Missing,
}

impl NcclLibrary {
    /// The library's path, loadable or not.
    pub fn path(&self) -> Option<&Path> {
        match self {
            NcclLibrary::Loadable(p) | NcclLibrary::RuntimeOnly(p) => Some(p),
            NcclLibrary::Missing => None,
        }
    }

    /// Looks for NCCL in `dirs`, in order.
    pub fn find_in<'a>(dirs: impl IntoIterator<Item = &'a Path> + Clone) -> NcclLibrary {
        if let Some(p) = find_in(dirs.clone(), "libnccl.so") {
            NcclLibrary::Loadable(p)
        } else if let Some(p) = find_in(dirs, "libnccl.so.2") {
            NcclLibrary::RuntimeOnly(p)
        } else {
            NcclLibrary::Missing
        }
    }
}

impl std::fmt::Display for NcclLibrary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NcclLibrary::Loadable(p) => write!(f, "{}", p.display()),
            NcclLibrary::RuntimeOnly(p) => write!(
                f,
                "{} only, which the nccl feature cannot load by that name (it loads \
                 libnccl.so): `ln -s {} DIR/libnccl.so` and put DIR on LD_LIBRARY_PATH",
                p.display(),
                p.display()
            ),
            NcclLibrary::Missing => write!(f, "not found"),
        }
    }
}

impl SystemInfo {
    /// Reads the facts (Linux `/proc` where available; "unknown" elsewhere).
    pub fn collect() -> SystemInfo {
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        SystemInfo {
            os: os_description(),
            arch: std::env::consts::ARCH,
            cpu_model: cpu_model().unwrap_or_else(|| "unknown".into()),
            available_cores: available_cores(),
            mem_total: meminfo_bytes(&meminfo, "MemTotal"),
            mem_available: meminfo_bytes(&meminfo, "MemAvailable"),
            nvidia_driver: std::fs::read_to_string("/proc/driver/nvidia/version")
                .ok()
                .and_then(|t| t.lines().next().map(|l| l.trim().to_string())),
            libcuda: find_library("libcuda.so.1"),
            libnccl: NcclLibrary::find_in(search_path().iter().map(PathBuf::as_path)),
        }
    }

    /// True when a CUDA device could be used: driver loaded and its library present.
    pub fn cuda_usable(&self) -> bool {
        self.nvidia_driver.is_some() && self.libcuda.is_some()
    }
}

/// Logical CPUs this process may use.
pub fn available_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

fn os_description() -> String {
    let pretty = std::fs::read_to_string("/etc/os-release")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("PRETTY_NAME="))
                .map(|v| v.trim_matches('"').to_string())
        });
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .ok()
        .map(|k| k.trim().to_string());
    match (pretty, kernel) {
        (Some(p), Some(k)) => format!("{p}, kernel {k}"),
        (Some(p), None) => p,
        (None, Some(k)) => format!("{} {k}", std::env::consts::OS),
        (None, None) => std::env::consts::OS.to_string(),
    }
}

fn cpu_model() -> Option<String> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    info.lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_string())
}

fn meminfo_bytes(meminfo: &str, field: &str) -> Option<u64> {
    meminfo
        .lines()
        .find(|l| l.split(':').next() == Some(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<u64>().ok())
        .map(|kb| kb * 1024)
}

/// The directories libraries are looked for in: `LD_LIBRARY_PATH`, then the usual system
/// ones.
fn search_path() -> Vec<PathBuf> {
    let from_env = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    let standard = [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/lib64",
        "/usr/lib",
        "/lib/x86_64-linux-gnu",
        "/usr/local/cuda/lib64",
        "/usr/local/nvidia/lib64",
    ];
    from_env
        .split(':')
        .filter(|d| !d.is_empty())
        .chain(standard)
        .map(PathBuf::from)
        .collect()
}

/// Looks for a shared library in the search path.
fn find_library(name: &str) -> Option<PathBuf> {
    find_in(search_path().iter().map(PathBuf::as_path), name)
}

/// The first of `dirs` holding `name`.
fn find_in<'a>(dirs: impl IntoIterator<Item = &'a Path>, name: &str) -> Option<PathBuf> {
    dirs.into_iter().map(|d| d.join(name)).find(|p| p.exists())
}

/// Bytes as GiB with one decimal.
pub fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nccl_is_loadable_only_as_libnccl_so() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let dirs = [a.path(), b.path()];
        assert_eq!(NcclLibrary::find_in(dirs), NcclLibrary::Missing);
        let runtime = b.path().join("libnccl.so.2");
        std::fs::write(&runtime, b"").unwrap();
        let found = NcclLibrary::find_in(dirs);
        assert_eq!(found, NcclLibrary::RuntimeOnly(runtime.clone()));
        let said = found.to_string();
        assert!(
            said.contains("cannot load") && said.contains("ln -s"),
            "{said}"
        );
        let dev = a.path().join("libnccl.so");
        std::fs::write(&dev, b"").unwrap();
        assert_eq!(NcclLibrary::find_in(dirs), NcclLibrary::Loadable(dev));
    }
}
