#!/usr/bin/env bash
# Installs, once, the CUDA compiler the `cuda` feature builds candle's kernels with, from PyPI
# by pip (no CUDA toolkit on the machine, no GPU needed): CUDA 13.0's nvcc, NVVM, headers and
# runtime headers (nvidia-cuda-nvcc, nvidia-nvvm, nvidia-cuda-crt, nvidia-cuda-runtime,
# nvidia-cuda-cccl 13.0), 110 MB of wheels, into target/cuda-toolchain. The workspace's
# .cargo/config.toml points the kernels' build at it (CUDA_HOME) and at compute capability
# 9.0 (Hopper: CUDA_COMPUTE_CAP); a CUDA_HOME or CUDA_COMPUTE_CAP of your own wins.
# 13.0, not 12.x: CUDA 12's PyPI nvcc wheels carry ptxas only. Its PTX (ISA 9.0) loads on
# driver 580 (CUDA 13.0) and later. Idempotent: a marker per pinned list; a second run does
# nothing. Prints the nvcc it installed.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=target/cuda-toolchain
pins="nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85"
marker="$dir/.installed-$(echo "$pins" | sha256sum | cut -c1-16)"
if [ ! -f "$marker" ]; then
  rm -rf "$dir"
  # shellcheck disable=SC2086 # one argument per pin
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps --target "$dir" $pins
  touch "$marker"
fi
"$dir/nvidia/cu13/bin/nvcc" --version | tail -n 2 | head -n 1
