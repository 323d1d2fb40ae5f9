//! Where config files live by default.

use std::path::PathBuf;

/// Variable naming the default config file explicitly.
pub const CONFIG_FILE_ENV: &str = "FSDP_CONFIG_FILE";

/// The file `fsdp config` writes and `fsdp launch` reads when no `--config_file` is given:
/// `$FSDP_CONFIG_FILE`, else `$FSDP_HOME/default_config.yaml`, else
/// `$XDG_CACHE_HOME/fsdp-rs/default_config.yaml`, else `~/.cache/fsdp-rs/default_config.yaml`.
pub fn default_config_path() -> PathBuf {
    let env_path = |var: &str| {
        std::env::var_os(var)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(file) = env_path(CONFIG_FILE_ENV) {
        return file;
    }
    if let Some(home) = env_path("FSDP_HOME") {
        return home.join("default_config.yaml");
    }
    cache_dir().join("fsdp-rs").join("default_config.yaml")
}

/// Accelerate's default config file (`$HF_HOME/accelerate/default_config.yaml`), read when
/// fsdp-rs has none of its own, so an existing Accelerate setup works unchanged.
pub fn accelerate_config_path() -> PathBuf {
    let hf_home = std::env::var_os("HF_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| cache_dir().join("huggingface"));
    hf_home.join("accelerate").join("default_config.yaml")
}

/// The config file to read when none is named: ours if it exists, else Accelerate's if that
/// exists, else `None`.
pub fn existing_default_config() -> Option<PathBuf> {
    [default_config_path(), accelerate_config_path()]
        .into_iter()
        .find(|p| p.is_file())
}

/// fsdp-rs's own folder for what it keeps between runs: `$FSDP_HOME`, else
/// `$XDG_CACHE_HOME/fsdp-rs`, else `~/.cache/fsdp-rs` (where `default_config.yaml` lives).
pub fn fsdp_home() -> PathBuf {
    std::env::var_os("FSDP_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| cache_dir().join("fsdp-rs"))
}

fn cache_dir() -> PathBuf {
    std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| PathBuf::from(".cache"))
}
