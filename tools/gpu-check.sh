#!/usr/bin/env bash
# The checks that need a GPU, in one short script for the lent GPU machine, which has no Rust
# toolchain and no network (docs/GPU.md):
#   tools/gpu-check.sh --build   here: builds the test binaries, the launcher and
#                                gpt2_example with `cuda` (and `nccl`), strips and
#                                compresses them into target/gpu-check/ with the example's
#                                text (28 MB: carry that folder)
#   tools/gpu-check.sh           there: inventory, each binary's GPU tests with
#                                FSDP_REQUIRE_GPU=1 (a missing GPU or library fails them),
#                                the attention kernels' speed beside PyTorch's SDPA, then
#                                gpt2_example launched on the GPU against the CPU;
#                                everything it prints also lands in $OUT/gpu-check.log
# Each step is bounded (STEP_TIMEOUT, 150 s); the script goes on after a failed step and
# exits non-zero if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
dir=target/gpu-check

if [ "${1:-}" = "--build" ]; then
  set -e
  tools/install-cuda-toolchain.sh
  rm -rf "$dir" && mkdir -p "$dir"
  # The executable of each test target, from cargo's JSON messages.
  build() {
    local name=$1
    shift
    local exe
    exe=$(cargo test --release --no-run --message-format=json "$@" 2>/dev/null |
      python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["executable"])' | tail -n 1)
    [ -n "$exe" ] || { echo "no test binary for $*" >&2; exit 1; }
    strip -o "$dir/$name" "$exe"
    gzip -9 "$dir/$name"
  }
  build fsdp-nn-lib -p fsdp-nn --features cuda --lib
  build fsdp-comm-integration -p fsdp-comm --features nccl --test integration
  build fsdp-integration -p fsdp --features cuda --test integration
  # The launcher and an example to launch with use_cpu: false, and the example's text.
  cargo build --release --quiet -p fsdp-cli --features cuda,nccl,bench
  cargo build --release --quiet -p fsdp --features cuda --example gpt2_example
  for bin in target/release/fsdp target/release/examples/gpt2_example; do
    strip -o "$dir/$(basename "$bin")" "$bin"
    gzip -9 "$dir/$(basename "$bin")"
  done
  tools/fetch-test-assets.sh >/dev/null
  cp -r target/assets/vader "$dir/vader"
  du -ch "$dir"/* | tail -n 1
  exit 0
fi

out=${OUT:-target/tmp}
mkdir -p "$out"
exec > >(tee "$out/gpu-check.log") 2>&1
failed=0
step() {
  local what=$1
  shift
  echo "== $what"
  local start=$SECONDS
  if declare -F "$1" >/dev/null; then
    # A function of this script: run by a bash that has it (exported below).
    timeout "${STEP_TIMEOUT:-150}" bash -c '"$@"' _ "$@"
  else
    timeout "${STEP_TIMEOUT:-150}" "$@"
  fi
  local rc=$?
  echo "-- $what: exit $rc, $((SECONDS - start)) s"
  [ "$rc" -eq 0 ] || failed=1
}

echo "== inventory"
nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv 2>&1
grep -m1 "model name" /proc/cpuinfo
for f in amx_tile amx_bf16 avx512_bf16 avx512f; do
  grep -qw "$f" /proc/cpuinfo && echo "cpu flag: $f" || echo "cpu flag: no $f"
done
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1

# CUDA's libraries by the names cudarc loads (libcublas.so.13, libcurand.so.10, libnvrtc.so.13;
# NCCL as libnccl.so): from the pip wheels of the image's Python, else the system's.
libs=$(python3 - <<'PY' 2>/dev/null
import glob, os, site
roots = site.getsitepackages() + [site.getusersitepackages()]
dirs = set()
for r in roots:
    for pat in ("nvidia/*/lib", "nvidia/cu13/lib", "nvidia/nccl/lib"):
        for d in glob.glob(os.path.join(r, pat)):
            dirs.add(d)
print(":".join(sorted(dirs)))
PY
)
links=$(mktemp -d)
nccl=$(find ${libs//:/ } /usr/lib /usr/local -name 'libnccl.so.2*' 2>/dev/null | head -n 1)
[ -n "$nccl" ] && ln -sf "$nccl" "$links/libnccl.so"
export LD_LIBRARY_PATH="$links:$libs:${LD_LIBRARY_PATH:-}"
for l in libcuda.so.1 libcublas.so.13 libcublasLt.so.13 libcurand.so.10 libnvrtc.so.13 libnccl.so; do
  found=$(find "$links" ${libs//:/ } /usr/lib /usr/local/nvidia /usr/lib64 -name "$l*" 2>/dev/null | head -n 1)
  echo "library $l: ${found:-not found}"
done

bins=$(mktemp -d)
for f in "$dir"/*.gz; do
  gzip -dc "$f" > "$bins/$(basename "$f" .gz)" && chmod +x "$bins/$(basename "$f" .gz)"
done
export FSDP_REQUIRE_GPU=1
# fsdp-nn's unit tests: the device probe, every op on the GPU against the CPU, and the bf16
# GEMM's AMX kernel where this host has AMX.
step "fsdp-nn: every op and the NF4 base on the GPU against the CPU" "$bins/fsdp-nn-lib" device:: on_a_gpu
# (Not the CUDA kernels' emulator tests, `*_on_the_emulator_*`: they build their driver from
# the source tree, and run on any CPU.)
step "fsdp-nn: the other unit tests (bf16 GEMM, AMX where present)" "$bins/fsdp-nn-lib" --skip on_a_gpu --skip on_the_emulator
step "fsdp: the engine on the GPU (host-staged) trains as on the CPU" "$bins/fsdp-integration" engine_in_process::training_on_a_gpu_matches_the_cpu
step "fsdp: Llama-family models on the GPU against transformers" "$bins/fsdp-integration" llama::logits_loss_and_gradients_on_a_gpu
step "fsdp: BERT's packed batches on the GPU against the CPU's padded ones" "$bins/fsdp-integration" models::bert_packed_batches_on_a_gpu
step "fsdp-comm: NCCL collectives" "$bins/fsdp-comm-integration" nccl_collectives_on_gpus

# The attention kernels' speed on the GPU beside PyTorch's SDPA on the same shapes
# (SmolLM2-135M's heads, 4 sequences of 2048), bf16 and f32, the tiled kernels and (rows) the
# row kernels: figures for docs/BENCHMARKS.md.
attention_speed() {
  local dt
  for dt in bf16 f32; do
    "$bins/fsdp" bench attention --device cuda --dtype "$dt" --batch 4 --seq 2048 --reps 3 || return 1
    FSDP_CUDA_ATTENTION=rows "$bins/fsdp" bench attention --device cuda --dtype "$dt" --batch 4 \
      --seq 2048 --reps 3 | grep -E "grouped-query causal|GPU 0" || return 1
    python3 tools/bench_attention_torch.py --device cuda --dtype "$dt" --batch 4 --seq 2048 \
      --reps 3 || echo "(no PyTorch anchor here)"
  done
}

# The launcher end to end: gpt2_example (byte-level GPT-2 on VADER's sentences, 20 steps)
# with the guide's config on 1 and 2 processes, use_cpu: true and false (2 processes share
# the GPU through host memory); the GPU's held-out and training losses within 2e-3 (their
# printed precision and f32's drift) of the CPU's.
launched() {
  local procs=$1 use_cpu=$2 log="$out/gpt2-$1-$2.log"
  sed -e "s/^use_cpu: .*/use_cpu: $use_cpu/" -e "s/^num_processes: .*/num_processes: $procs/" \
    examples/fsdp_config.yaml > "$out/config-$procs-$use_cpu.yaml"
  "$bins/fsdp" launch --config_file "$out/config-$procs-$use_cpu.yaml" "$bins/gpt2_example" -- \
    --data "$dir/vader" --max_train_steps 20 --eval_every 20 --eval_samples 64 \
    --output_dir "$out/gpt2-$procs-$use_cpu" --overwrite_output_dir > "$log" 2>&1
  local rc=$?
  grep -E "computing on|held-out loss|tokens/s" "$log"
  # use_cpu: false must have reached the GPU (a CPU fallback would compare the CPU with itself).
  if [ "$use_cpu" = false ] && ! grep -q "computing on Cuda" "$log"; then
    echo "use_cpu: false did not compute on the GPU ($log)"
    return 1
  fi
  return "$rc"
}
compare_launches() {
  local procs=$1
  launched "$procs" true && launched "$procs" false || return 1
  python3 - "$out/gpt2-$procs-true.log" "$out/gpt2-$procs-false.log" <<'PY'
import re, sys
def losses(path):
    text = open(path).read()
    found = re.findall(r"train loss ([0-9.]+), held-out loss ([0-9.]+)", text)
    if not found:
        sys.exit(f"{path}: no loss line")
    return [float(x) for x in found[-1]]
cpu, gpu = losses(sys.argv[1]), losses(sys.argv[2])
print(f"cpu train/held-out {cpu}, gpu {gpu}")
sys.exit(0 if all(abs(a - b) <= 2e-3 for a, b in zip(cpu, gpu)) else 1)
PY
}
export out bins dir
export -f launched compare_launches attention_speed
step "attention kernels: speed beside PyTorch SDPA" attention_speed
step "launch: gpt2_example on 1 process, GPU against CPU" compare_launches 1
step "launch: gpt2_example on 2 processes sharing the GPU, against CPU" compare_launches 2
echo "gpu-check: $([ "$failed" -eq 0 ] && echo passed || echo FAILED)"
exit "$failed"
