use cudaforge::KernelBuilder;
use std::env;
use std::path::PathBuf;

// fsdp-rs: candle's PTX modules only. Upstream also builds the GGUF/MoE matrix kernels into a
// static library (7 minutes of ptxas on 2 cores) and links the CUDA runtime into every binary
// that uses candle's CUDA backend; candle-core's copy (fsdp-candle-core) does without them.
fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=src");
    println!("cargo::rerun-if-changed=src/compatibility.cuh");
    println!("cargo::rerun-if-changed=src/cuda_utils.cuh");
    println!("cargo::rerun-if-changed=src/binary_op_macros.cuh");
    println!("cargo::rerun-if-env-changed=CUDA_HOME");
    println!("cargo::rerun-if-env-changed=NVCC");

    // Build for PTX
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").unwrap_or_default());
    let ptx_path = out_dir.join("ptx.rs");
    // fsdp-rs: compiled beside the profile's build/ folder (target/debug/cuda-ptx/<package>),
    // not in OUT_DIR, which differs between profiles, so that `cargo clippy` and `cargo test`
    // share one compilation; cudaforge recompiles a module only when its source, a header
    // (watched), the arguments or the architecture changed. Copied to OUT_DIR for ptx.rs.
    let ptx_dir = shared_ptx_dir(&out_dir);
    let built = KernelBuilder::new()
        .source_dir("src") // Scan src/ for .cu files
        .watch(["src"])
        .out_dir(&ptx_dir)
        .arg("--expt-relaxed-constexpr")
        .arg("-std=c++17")
        .arg("-O3")
        .build_ptx()
        .and_then(|bindings| {
            for entry in std::fs::read_dir(&ptx_dir)? {
                let path = entry?.path();
                if path.extension() == Some("ptx".as_ref()) {
                    std::fs::copy(&path, out_dir.join(path.file_name().unwrap_or_default()))?;
                }
            }
            bindings.write(&ptx_path)
        });
    if let Err(e) = built {
        eprintln!(
            "candle's CUDA kernels (the `cuda` feature) could not be compiled: {e}\n\
             They need nvcc (CUDA 12 or 13) and the compute capability to build for: in \
             fsdp-rs, `tools/install-cuda-toolchain.sh` installs CUDA 13.0's nvcc from PyPI \
             into target/cuda-toolchain, which the workspace's .cargo/config.toml names \
             (CUDA_HOME, CUDA_COMPUTE_CAP=90); elsewhere set CUDA_HOME (or NVCC) and \
             CUDA_COMPUTE_CAP yourself."
        );
        std::process::exit(1);
    }
}

// fsdp-rs: `<target>/<profile>/cuda-ptx/<package>` for an OUT_DIR
// `<target>/<profile>/build/<unit>/out`, else OUT_DIR itself.
fn shared_ptx_dir(out_dir: &std::path::Path) -> PathBuf {
    let mut up = out_dir.ancestors();
    match (up.nth(2), up.next()) {
        (Some(build), Some(profile)) if build.file_name() == Some("build".as_ref()) => profile
            .join("cuda-ptx")
            .join(env::var("CARGO_PKG_NAME").unwrap_or_default()),
        _ => out_dir.to_path_buf(),
    }
}
