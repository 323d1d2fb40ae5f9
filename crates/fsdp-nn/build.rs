//! With the `cuda` feature: fsdp-nn's own CUDA kernels (`kernels/*.cu`) compiled to PTX by
//! nvcc (found through CUDA_HOME or NVCC; the workspace's `.cargo/config.toml` points at the
//! one tools/install-cuda-toolchain.sh installs, and sets CUDA_COMPUTE_CAP), copied to
//! OUT_DIR with a `kernels.rs` naming each module. Without the feature it does nothing.
//!
//! The PTX is compiled into a folder beside the profile's `build/` (`target/debug/cuda-ptx/
//! fsdp-nn`), not into OUT_DIR, which differs between profiles: `cargo clippy` (dev) and
//! `cargo test` (test) then share one compilation, and cudaforge recompiles a module only
//! when its source, a header, nvcc's arguments or the architecture changed.

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=kernels");
    #[cfg(feature = "cuda")]
    build_kernels();
}

#[cfg(feature = "cuda")]
fn build_kernels() {
    let out_dir = std::path::PathBuf::from(std::env::var_os("OUT_DIR").unwrap_or_default());
    let modules = [
        "norm",
        "activations",
        "rope",
        "attention",
        "cross_entropy",
        "quant",
        "embedding",
        "softmax",
    ];
    let ptx_dir = shared_ptx_dir(&out_dir);
    let built = cudaforge::KernelBuilder::new()
        .source_files(modules.map(|m| format!("kernels/{m}.cu")))
        .watch(["kernels"])
        .out_dir(&ptx_dir)
        .arg("-std=c++17")
        .arg("-O3")
        .build_ptx()
        .and_then(|ptx| {
            for m in modules {
                let name = format!("{m}.ptx");
                std::fs::copy(ptx_dir.join(&name), out_dir.join(&name))?;
            }
            ptx.write(out_dir.join("kernels.rs"))
        });
    if let Err(e) = built {
        eprintln!(
            "fsdp-nn's CUDA kernels (the `cuda` feature) could not be compiled: {e}\n\
             They need nvcc (CUDA 12 or 13) and the compute capability to build for: \
             tools/install-cuda-toolchain.sh installs CUDA 13.0's nvcc from PyPI into \
             target/cuda-toolchain, which the workspace's .cargo/config.toml names (CUDA_HOME, \
             CUDA_COMPUTE_CAP=90); elsewhere set CUDA_HOME (or NVCC) and CUDA_COMPUTE_CAP."
        );
        std::process::exit(1);
    }
}

/// `<target>/<profile>/cuda-ptx/<package>` for an OUT_DIR `<target>/<profile>/build/<unit>/out`,
/// else OUT_DIR itself.
#[cfg(feature = "cuda")]
fn shared_ptx_dir(out_dir: &std::path::Path) -> std::path::PathBuf {
    let mut up = out_dir.ancestors();
    match (up.nth(2), up.next()) {
        (Some(build), Some(profile)) if build.file_name() == Some("build".as_ref()) => profile
            .join("cuda-ptx")
            .join(std::env::var("CARGO_PKG_NAME").unwrap_or_default()),
        _ => out_dir.to_path_buf(),
    }
}
