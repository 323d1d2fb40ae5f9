#!/usr/bin/env python3
"""The PyTorch anchor for `fsdp bench gemm`: the same products as a layer computes them
(`F.linear(x, W)` forward; its backward, seeded with ones as ours is, gives dX = dY W and
dW = dYᵀ x) on the same shapes, one thread, the minimum over the repetitions after two
warm-ups. With `--ours PATH_TO_FSDP_BINARY` it alternates rounds of `fsdp bench gemm` and
this measurement, so both see the same machine state, and prints per shape the ratio of our
GFLOP/s to PyTorch's (best round each) and one JSON line.

Needs torch (`pip install torch==2.15.0`); not part of the test suite. From the repository
root:

    python3 tools/bench_gemm_pytorch.py --ours target/release/fsdp --dtype bf16 --rounds 3
"""
import argparse
import json
import subprocess
import time

import torch
import torch.nn.functional as F

# (name, tokens, out, in): `fsdp bench gemm`'s default shapes, in its order.
SHAPES = [
    ("square 256", 256, 256, 256), ("square 512", 512, 512, 512),
    ("square 1024", 1024, 1024, 1024), ("square 2048", 2048, 2048, 2048),
    ("BERT ref qkv/out", 1024, 256, 256), ("BERT ref up", 1024, 1024, 256),
    ("BERT ref down", 1024, 256, 1024), ("BERT-base qkv/out", 512, 768, 768),
    ("BERT-base up", 512, 3072, 768), ("BERT-base down", 512, 768, 3072),
    ("SmolLM2 q/o", 2048, 576, 576), ("SmolLM2 k/v", 2048, 192, 576),
    ("SmolLM2 gate/up", 2048, 1536, 576), ("SmolLM2 down", 2048, 576, 1536),
]


def best(reps, f):
    times = []
    for i in range(reps + 2):
        started = time.perf_counter()
        f()
        if i >= 2:
            times.append(time.perf_counter() - started)
    return min(times)


def pytorch(dtype, reps):
    out = {}
    for name, t, o, i in SHAPES:
        x = torch.randn(t, i).to(dtype).requires_grad_()
        w = (torch.randn(o, i) * 0.05).to(dtype).requires_grad_()
        ones = torch.ones(t, o, dtype=dtype)
        forward = best(reps, lambda: F.linear(x, w))

        def backward_alone():
            # The backward timed alone (the difference of two minima, forward + backward and
            # forward, came near zero when the forward's fastest run was slower).
            y = F.linear(x, w)
            started = time.perf_counter()
            y.backward(ones)
            took = time.perf_counter() - started
            x.grad = w.grad = None
            return took

        backward = min(backward_alone() for _ in range(reps + 2))
        flops = 2.0 * t * o * i
        out[name] = {"forward_gflops": flops / forward / 1e9,
                     "backward_gflops": 2 * flops / backward / 1e9}
    return out


def ours(fsdp, dtype, reps):
    run = subprocess.run([fsdp, "bench", "gemm", "--dtype", dtype, "--reps", str(reps)],
                         check=True, capture_output=True, text=True)
    doc = json.loads(run.stdout.strip().splitlines()[-1])
    return {r["shape"]: r for r in doc["results"]}, doc


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=["f32", "bf16"], default="bf16")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ours", help="path to the fsdp binary to measure side by side")
    a = p.parse_args()
    torch.set_num_threads(1)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    theirs, mine, peak = {}, {}, None
    keep = lambda acc, new: {k: {m: max(v[m], acc.get(k, {}).get(m, 0.0))
                                 for m in ("forward_gflops", "backward_gflops")}
                             for k, v in new.items()}
    for _ in range(a.rounds):
        theirs = keep(theirs, pytorch(dtype, a.reps))
        if a.ours:
            results, doc = ours(a.ours, a.dtype, a.reps)
            mine = keep(mine, results)
            peak = doc["instruction_peak_gflops"]
    print(f"PyTorch {torch.__version__} {a.dtype} products on 1 thread, best of {a.rounds} rounds"
          + (f"; instruction peak {peak:.1f} GFLOP/s" if peak else ""))
    head = f"  {'shape':<20} {'torch fwd':>9} {'torch bwd':>9}"
    if mine:
        head += f" {'ours fwd':>9} {'ours bwd':>9} {'fwd x':>6} {'bwd x':>6}"
    print(head)
    rows = []
    for name, *_ in SHAPES:
        t = theirs[name]
        line = f"  {name:<20} {t['forward_gflops']:>9.1f} {t['backward_gflops']:>9.1f}"
        row = {"shape": name, "pytorch": t}
        if mine:
            o = mine[name]
            fx = o["forward_gflops"] / t["forward_gflops"]
            bx = o["backward_gflops"] / t["backward_gflops"]
            line += (f" {o['forward_gflops']:>9.1f} {o['backward_gflops']:>9.1f}"
                     f" {fx:>6.2f} {bx:>6.2f}")
            row.update(fsdp_rs=o, forward_ratio=fx, backward_ratio=bx)
        print(line)
        rows.append(row)
    print(json.dumps({"bench": "gemm_pytorch", "dtype": a.dtype, "torch": torch.__version__,
                      "instruction_peak_gflops": peak, "results": rows}))


if __name__ == "__main__":
    main()
