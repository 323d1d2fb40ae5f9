//! With the `cuda` feature: fsdp-nn's own CUDA kernels (`kernels/*.cu`) compiled to PTX by
//! nvcc (found through CUDA_HOME or NVCC; the workspace's `.cargo/config.toml` points at the
//! one tools/install-cuda-toolchain.sh installs, and sets CUDA_COMPUTE_CAP), written to
//! OUT_DIR with a `kernels.rs` naming each module. Without the feature it does nothing.

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=kernels");
    #[cfg(feature = "cuda")]
    build_kernels();
}

#[cfg(feature = "cuda")]
fn build_kernels() {
    let out_dir = std::path::PathBuf::from(std::env::var_os("OUT_DIR").unwrap_or_default());
    let built = cudaforge::KernelBuilder::new()
        .source_files([
            "kernels/norm.cu",
            "kernels/activations.cu",
            "kernels/rope.cu",
            "kernels/attention.cu",
            "kernels/cross_entropy.cu",
            "kernels/quant.cu",
        ])
        .arg("-std=c++17")
        .arg("-O3")
        .build_ptx()
        .and_then(|ptx| ptx.write(out_dir.join("kernels.rs")));
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
