#!/usr/bin/env python3
"""PyTorch's anchor for `fsdp bench attention`: causal grouped-query attention through
`torch.nn.functional.scaled_dot_product_attention` (flash or memory-efficient kernels on a GPU)
on the same shapes, forward and forward+backward, the minimum of `--reps` after two warm-ups.
Prints a table and one JSON line. Run by tools/gpu-check.sh beside `fsdp bench attention
--device cuda`; on a CPU it times PyTorch's CPU kernels.

    python3 tools/bench_attention_torch.py --device cuda --dtype bf16 --seq 2048 --batch 4
"""
import argparse
import json
import time

import torch
import torch.nn.functional as F


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv_heads", type=int, default=3)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--head_dim", type=int, default=64)
    p.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    dev = torch.device(a.device)
    # The heads-first layout SDPA takes (the transposes are views).
    def tensor(heads):
        t = torch.randn(a.batch, a.seq, heads, a.head_dim, device=dev, dtype=dtype)
        return t.transpose(1, 2).requires_grad_()
    q, k, v = tensor(a.heads), tensor(a.kv_heads), tensor(a.kv_heads)
    grad = torch.randn(a.batch, a.heads, a.seq, a.head_dim, device=dev, dtype=dtype)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def attend():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def forward():
        with torch.no_grad():
            attend()

    def train():
        attend().backward(grad)

    def best(f):
        times = []
        for i in range(a.reps + 2):
            sync()
            t = time.perf_counter()
            f()
            sync()
            if i >= 2:
                times.append(time.perf_counter() - t)
        return min(times)

    fwd, trn = best(forward), best(train)
    s = a.seq
    flops = 4.0 * a.batch * a.heads * a.head_dim * (s * (s + 1) / 2)
    print(f"PyTorch {torch.__version__} SDPA causal GQA on {dev}, {a.dtype}: "
          f"forward {fwd * 1e3:.2f} ms ({flops / fwd / 1e9:.1f} GFLOP/s), "
          f"fwd+bwd {trn * 1e3:.2f} ms ({3 * flops / trn / 1e9:.1f} GFLOP/s)")
    print(json.dumps({"bench": "attention_torch", "torch": torch.__version__, "device": a.device,
                      "batch": a.batch, "seq": s, "heads": a.heads, "kv_heads": a.kv_heads,
                      "head_dim": a.head_dim, "dtype": a.dtype, "forward_flops": flops,
                      "forward_seconds": fwd, "train_seconds": trn}))


if __name__ == "__main__":
    main()
