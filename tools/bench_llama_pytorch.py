#!/usr/bin/env python3
"""The anchor for llama_example: the same fine-tuning of SmolLM2-135M-Instruct in PyTorch +
Accelerate FSDP (FULL_SHARD, LlamaDecoderLayer units, gloo on CPU, 2 processes of 1 thread
each, as `fsdp launch` runs ours), on the same weights (transformers dequantizes the same GGUF
file with the `gguf` package), the same batches in the same order on each rank (ours dumps
them with --dump_batches), AdamW with no decay on the RMSNorm weights, the same cosine
schedule, gradient clipping at 1.0, no dropout. It runs ours first, then PyTorch, and prints
the losses side by side, tokens/s and peak RSS per rank, and one JSON line. With
`--mixed_precision bf16` both compute in bf16 from f32 master weights, gradients reduced in
f32 (ours: `--mixed_precision bf16`; PyTorch: FSDP `MixedPrecision(param_dtype=bf16,
reduce_dtype=f32, buffer_dtype=bf16)`); the losses then agree to bf16's precision only. With
`--lora_r R` both train LoRA adapters (r R, alpha 2R, no dropout, `--lora_target_modules`) on
the frozen base: PyTorch through PEFT, starting from the initial adapters ours saved in PEFT's
format (`PeftModel.from_pretrained(..., is_trainable=True)`). Not run by CI: needs
`pip install torch==2.15.0 accelerate==1.15.0 transformers==5.24.0 gguf` (and peft==0.21.2
for LoRA).

    cargo build --release -p fsdp-cli -p fsdp --examples
    python3 tools/bench_llama_pytorch.py --ours target/release/fsdp --steps 10
"""
import argparse
import json
import os
import resource
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

GGUF = "target/assets/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def worker(rank, a, work, result_file):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29653", RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    torch.set_num_threads(1)
    from accelerate import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import MixedPrecision
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, get_cosine_schedule_with_warmup

    plugin = FullyShardedDataParallelPlugin(
        sharding_strategy="FULL_SHARD",
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        use_orig_params=True,
        sync_module_states=False,
        cpu_ram_efficient_loading=False,
        mixed_precision_policy=MixedPrecision(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
        if a.mixed_precision == "bf16" else None,
    )
    from accelerate_cpu_fsdp import accelerator_with_fsdp
    acc = accelerator_with_fsdp(plugin)
    gguf = Path(a.gguf)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.config.use_cache = False
    if a.lora_r:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, f"{work}/initial_adapter", is_trainable=True)
    norms = {n for n, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")}
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if n.rsplit(".", 1)[0] in norms or n.endswith(".bias") else decay).append(p)
    model = acc.prepare(model)
    assert type(model).__name__ == "FullyShardedDataParallel", type(model)
    # use_orig_params keeps the parameters' identity through wrapping, so the groups hold.
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}], lr=a.lr
    )
    optimizer = acc.prepare(optimizer)
    # Stepped once per optimizer step by hand (a prepared scheduler steps once per process).
    scheduler = get_cosine_schedule_with_warmup(optimizer, a.steps // 10, a.steps)
    batches = load_file(f"{work}/batches.rank{rank}.safetensors")["ids"]
    losses, seconds = [], []
    model.train()
    for step in range(a.steps):
        t = time.perf_counter()
        ids = batches[step]
        loss = model(input_ids=ids, labels=ids).loss
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        mean = acc.reduce(loss.detach(), reduction="mean")
        seconds.append(time.perf_counter() - t)
        losses.append(float(mean))
        if rank == 0:
            print(f"pytorch step {step + 1}: loss {losses[-1]:.6f} ({seconds[-1]:.2f} s)", flush=True)
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0])
    peaks = acc.gather(peak).tolist()
    if rank == 0:
        tokens = a.steps * 2 * batches.shape[1] * batches.shape[2]
        json.dump({"losses": losses, "step_seconds": seconds, "tokens_per_s": tokens / sum(seconds),
                   "peak_rss_mib": peaks}, open(result_file, "w"))
    acc.end_training()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ours", required=True, help="path to the fsdp binary (llama_example beside it in examples/)")
    p.add_argument("--gguf", default=GGUF)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--mixed_precision", choices=["no", "bf16"], default="no")
    p.add_argument("--lora_r", type=int, default=None)
    p.add_argument("--lora_target_modules", default="q_proj,v_proj")
    a = p.parse_args()
    example = Path(a.ours).resolve().parent / "examples" / "llama_example"
    with tempfile.TemporaryDirectory() as work:
        subprocess.run([a.ours, "launch", "--num_processes", "2", str(example), "--max_train_steps", str(a.steps),
                        "--seq_len", str(a.seq_len), "--batch_size", str(a.batch_size), "--lr", str(a.lr),
                        "--eval_samples", "0", "--gguf", a.gguf, "--dump_batches", work,
                        "--output_dir", f"{work}/out", "--mixed_precision", a.mixed_precision]
                       + (["--lora_r", str(a.lora_r), "--lora_alpha", str(2 * a.lora_r), "--lora_dropout", "0",
                           "--lora_target_modules", a.lora_target_modules] if a.lora_r else []),
                       check=True)
        ours = json.load(open(f"{work}/fsdp-rs.json"))
        mp.spawn(worker, args=(a, work, f"{work}/pytorch.json"), nprocs=2)
        theirs = json.load(open(f"{work}/pytorch.json"))
    print(f"{'step':>4} {'fsdp-rs loss':>14} {'pytorch loss':>14} {'rel. diff':>10}")
    worst = 0.0
    for i, (x, y) in enumerate(zip(ours["losses"], theirs["losses"])):
        d = abs(x - y) / abs(y)
        worst = max(worst, d)
        print(f"{i + 1:>4} {x:>14.6f} {y:>14.6f} {d:>10.2e}")
    # The first step includes one-time work (allocation, thread pools) on both sides.
    steady = lambda r: sum(r["step_seconds"][1:]) / max(len(r["step_seconds"]) - 1, 1)  # noqa: E731
    print(f"tokens/s: fsdp-rs {ours['tokens_per_s']:.0f}, pytorch {theirs['tokens_per_s']:.0f} "
          f"({ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x); steady step: fsdp-rs {steady(ours):.2f} s, "
          f"pytorch {steady(theirs):.2f} s ({steady(theirs) / steady(ours):.2f}x)")
    print(f"peak RSS per rank (MiB): fsdp-rs {', '.join(f'{m:.0f}' for m in ours['peak_rss_mib'])}; "
          f"pytorch {', '.join(f'{m:.0f}' for m in theirs['peak_rss_mib'])} "
          f"({max(ours['peak_rss_mib']) / max(theirs['peak_rss_mib']):.2f}x)")
    print(json.dumps({"bench": "llama_vs_pytorch", "mixed_precision": a.mixed_precision, "lora_r": a.lora_r,
                      "lora_target_modules": a.lora_target_modules if a.lora_r else None, "steps": a.steps, "seq_len": a.seq_len,
                      "batch_size_per_rank": a.batch_size, "max_rel_loss_diff": worst,
                      "fsdp_rs": ours, "pytorch": theirs}))


if __name__ == "__main__":
    main()
