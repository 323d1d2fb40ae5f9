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
    /// Path of the NCCL library, if found.
    pub libnccl: Option<PathBuf>,
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
            libnccl: find_library("libnccl.so.2"),
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

/// Looks for a shared library in `LD_LIBRARY_PATH` and the usual system directories.
fn find_library(name: &str) -> Option<PathBuf> {
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
        .map(|d| Path::new(d).join(name))
        .find(|p| p.exists())
}

/// Bytes as GiB with one decimal.
pub fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}
