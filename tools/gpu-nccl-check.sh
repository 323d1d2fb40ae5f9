#!/usr/bin/env bash
# The NCCL path on a real GPU, as one short script for a lent GPU machine (the device tool):
# carries prebuilt binaries in .device/ (x86-64, built here, see below) and runs
#   1. what the machine has (GPU, driver, the NCCL and CUDA libraries the loader can see),
#   2. `fsdp env` built with NCCL support (what it finds),
#   3. fsdp-comm's NCCL test (all-reduce, all-gather, reduce-scatter, the Communicator trait on
#      device buffers; one rank per GPU), first as the machine is, then with NCCL linked under
#      the name cudarc loads (libnccl.so) when the machine has only libnccl.so.2.
# Build before:  cargo build --release -p fsdp-cli --features nccl && cp target/release/fsdp .device/fsdp-nccl
#                cargo test -p fsdp-comm --features nccl --no-run   (copy the integration binary to .device/comm-integration)
set -uo pipefail
out=${OUT:-/tmp/gpu-nccl-check}
mkdir -p "$out"
echo "== machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
grep -m1 'model name' /proc/cpuinfo
echo "== libraries"
ldconfig -p | grep -E 'libnccl|libcuda\.' || echo "ldconfig knows no libnccl/libcuda"
find / -xdev \( -name 'libnccl.so*' -o -name 'libcuda.so*' \) 2>/dev/null | grep -v '^/proc' | head -20
echo "== fsdp env"
.device/fsdp-nccl env 2>&1 | grep -E 'CUDA|Platform|CPU'
run_test() {
  timeout 300 .device/comm-integration --exact multiprocess::nccl_collectives_on_gpus --nocapture --test-threads 1 2>&1 | tail -40
}
echo "== NCCL test as the machine is"
run_test | tee "$out/nccl-as-is.log"
nccl2=$(find / -xdev -name 'libnccl.so.2' 2>/dev/null | head -1)
if [ -n "$nccl2" ] && ! ldconfig -p | grep -q 'libnccl.so '; then
  echo "== NCCL test with $nccl2 linked as libnccl.so"
  mkdir -p /tmp/nccl-link && ln -sf "$nccl2" /tmp/nccl-link/libnccl.so
  LD_LIBRARY_PATH=/tmp/nccl-link:${LD_LIBRARY_PATH:-} run_test | tee "$out/nccl-linked.log"
  echo "== fsdp env with the link"
  LD_LIBRARY_PATH=/tmp/nccl-link:${LD_LIBRARY_PATH:-} .device/fsdp-nccl env 2>&1 | grep -E 'CUDA'
fi
