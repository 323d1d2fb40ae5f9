//! `fsdp merge-weights`: a sharded checkpoint's model merged into one `model.safetensors`
//! (like `accelerate merge-weights`), streaming one tensor at a time.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;

/// Merge a sharded checkpoint into one `model.safetensors`.
#[derive(Args)]
pub struct MergeArgs {
    /// The checkpoint folder written by `save_state`, or its `pytorch_model_fsdp_0` folder.
    checkpoint_directory: PathBuf,
    /// The folder to write `model.safetensors` into.
    output_path: PathBuf,
    /// Write PyTorch's pickle format (`pytorch_model.bin`) instead of safetensors.
    #[arg(long = "unsafe_serialization", visible_alias = "unsafe-serialization")]
    unsafe_serialization: bool,
    /// Remove the checkpoint folder once the merged file is written.
    #[arg(
        long = "remove_checkpoint_dir",
        visible_alias = "remove-checkpoint-dir"
    )]
    remove_checkpoint_dir: bool,
}

/// Runs `fsdp merge-weights`.
pub fn run(args: MergeArgs) -> Result<()> {
    if args.unsafe_serialization {
        bail!(
            "--unsafe_serialization (pickle, pytorch_model.bin) is not written by fsdp-rs: pickle files can run code when loaded; merge to model.safetensors, which transformers loads as it is"
        );
    }
    if args.remove_checkpoint_dir {
        let checkpoint = resolved(&args.checkpoint_directory)?;
        let output = resolved(&args.output_path)?;
        if output.starts_with(&checkpoint) {
            bail!(
                "--remove_checkpoint_dir would remove the merged file with the checkpoint: {} is inside {}; write the output elsewhere (nothing was merged or removed)",
                args.output_path.display(),
                args.checkpoint_directory.display()
            );
        }
        // Only a whole checkpoint that holds nothing but what its save wrote is removed:
        // asked before anything is merged.
        fsdp::checkpoint::check_removable(&args.checkpoint_directory).with_context(|| {
            format!(
                "--remove_checkpoint_dir: {} is not removed (nothing was merged)",
                args.checkpoint_directory.display()
            )
        })?;
    }
    let started = Instant::now();
    let report = fsdp::checkpoint::merge_weights(&args.checkpoint_directory, &args.output_path)?;
    println!(
        "merged {} tensors into {} ({:.1} MiB) in {:.2} s",
        report.tensors,
        report.output.display(),
        report.bytes as f64 / (1 << 20) as f64,
        started.elapsed().as_secs_f64()
    );
    if args.remove_checkpoint_dir {
        fsdp::checkpoint::remove_checkpoint(&args.checkpoint_directory).with_context(|| {
            format!(
                "the merged file is written; {} is not removed",
                args.checkpoint_directory.display()
            )
        })?;
        println!("removed {}", args.checkpoint_directory.display());
    }
    Ok(())
}

/// `path` with symbolic links and `..` resolved, for a path that may not exist yet: its
/// deepest existing ancestor resolved, the rest appended (where `..` goes up lexically).
fn resolved(path: &std::path::Path) -> Result<PathBuf> {
    use std::path::Component;
    let absolute =
        std::path::absolute(path).with_context(|| format!("resolving {}", path.display()))?;
    let mut existing = absolute.as_path();
    let mut rest = Vec::new();
    while std::fs::symlink_metadata(existing).is_err() {
        match (existing.parent(), existing.file_name()) {
            (Some(parent), Some(name)) => {
                rest.push(name.to_owned());
                existing = parent;
            }
            _ => break,
        }
    }
    let mut out = existing
        .canonicalize()
        .with_context(|| format!("resolving {}", existing.display()))?;
    for name in rest.iter().rev() {
        match std::path::Path::new(name).components().next() {
            Some(Component::ParentDir) => {
                out.pop();
            }
            Some(Component::CurDir) | None => {}
            _ => out.push(name),
        }
    }
    Ok(out)
}
