#!/usr/bin/env python3
"""The PyTorch anchor for `fsdp bench layer`: one BERT encoder layer (post-norm, exact GELU),
forward and forward+backward on one thread, with the same shapes and the same timing rules
(two warm-ups, then median and minimum over the repetitions; backward seeded like
`y.backward(w)` with the input requiring a gradient). Prints a table and one JSON line.

With `--ours PATH_TO_FSDP_BINARY` it alternates rounds of `fsdp bench layer --layer-only` and
this script's own measurement (so both see the same machine state) and prints the ratio of
the minima, ours over PyTorch's faster attention path.

Needs torch (`pip install torch`); not part of the test suite.
"""
import argparse
import json
import subprocess
import math
import statistics
import time

import torch
import torch.nn.functional as F


class BertLayer(torch.nn.Module):
    def __init__(self, hidden, heads, intermediate, sdpa):
        super().__init__()
        self.heads, self.sdpa = heads, sdpa
        self.query = torch.nn.Linear(hidden, hidden)
        self.key = torch.nn.Linear(hidden, hidden)
        self.value = torch.nn.Linear(hidden, hidden)
        self.attn_out = torch.nn.Linear(hidden, hidden)
        self.ln1 = torch.nn.LayerNorm(hidden, eps=1e-12)
        self.inter = torch.nn.Linear(hidden, intermediate)
        self.out = torch.nn.Linear(intermediate, hidden)
        self.ln2 = torch.nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, x):
        b, s, h = x.shape
        d = h // self.heads
        split = lambda t: t.view(b, s, self.heads, d).transpose(1, 2)
        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        if self.sdpa:
            ctx = F.scaled_dot_product_attention(q, k, v)
        else:
            probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), dim=-1)
            ctx = probs @ v
        ctx = ctx.transpose(1, 2).reshape(b, s, h)
        a = self.ln1(self.attn_out(ctx) + x)
        return self.ln2(self.out(F.gelu(self.inter(a))) + a)


def timed(reps, f):
    f()
    f()
    ms = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        ms.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ms), min(ms)


def measure(a):
    """[(name, fwd_med, fwd_min, all_med, all_min)] for eager and SDPA attention."""
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    x = torch.randn(a.batch, a.seq, a.hidden, dtype=dtype, requires_grad=True)
    w = torch.randn(a.batch, a.seq, a.hidden, dtype=dtype)
    rows = []
    for sdpa in (False, True):
        layer = BertLayer(a.hidden, a.heads, a.intermediate, sdpa).to(dtype)

        def fwd():
            with torch.no_grad():
                layer(x)

        def fwd_bwd():
            layer(x).backward(w)
            layer.zero_grad(set_to_none=True)
            x.grad = None

        fm, fmin = timed(a.reps, fwd)
        am, amin = timed(a.reps, fwd_bwd)
        rows.append(("layer (sdpa)" if sdpa else "layer (eager attention)", fm, fmin, am, amin))
    return rows


def ours(a):
    """(name, fwd_med, fwd_min, all_med, all_min) of `fsdp bench layer --layer-only`."""
    out = subprocess.run(
        [a.ours, "bench", "layer", "--layer-only", "--threads", str(a.threads),
         "--reps", str(a.reps), "--batch", str(a.batch), "--seq", str(a.seq),
         "--hidden", str(a.hidden), "--heads", str(a.heads),
         "--intermediate", str(a.intermediate), "--dtype", a.dtype],
        check=True, capture_output=True, text=True).stdout
    r = json.loads(out.strip().splitlines()[-1])["results"][0]
    return ("fsdp-rs", r["forward_median_ms"], r["forward_min_ms"],
            r["forward_backward_median_ms"], r["forward_backward_min_ms"])


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--dtype", choices=["f32", "bf16"], default="f32",
                   help="parameters and activations (bf16: mixed precision's compute dtype)")
    p.add_argument("--ours", help="path of the fsdp binary to measure side by side")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds with --ours")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    runs = []
    for _ in range(a.rounds if a.ours else 1):
        if a.ours:
            runs.append(ours(a))
        runs.extend(measure(a))
    # Per name: median of the medians and minimum of the minima over the rounds.
    rows = []
    for name in dict.fromkeys(r[0] for r in runs):
        rs = [r for r in runs if r[0] == name]
        rows.append((name, statistics.median(r[1] for r in rs), min(r[2] for r in rs),
                     statistics.median(r[3] for r in rs), min(r[4] for r in rs)))
    print(f"PyTorch {torch.__version__}, one BERT layer, {a.dtype}, batch {a.batch} seq {a.seq} "
          f"hidden {a.hidden} heads {a.heads} intermediate {a.intermediate}, {a.threads} thread(s)")
    print(f"{'part':<26} {'fwd_med':>10} {'fwd_min':>10} {'fwd+bwd_med':>12} {'fwd+bwd_min':>12}")
    for name, fm, fmin, am, amin in rows:
        print(f"{name:<26} {fm:8.2f}ms {fmin:8.2f}ms {am:10.2f}ms {amin:10.2f}ms")
    result = {
        "benchmark": "layer-pytorch", "torch": torch.__version__, "threads": a.threads, "dtype": a.dtype,
        "reps": a.reps,
        "results": [{"part": n, "forward_median_ms": fm, "forward_min_ms": fmin,
                     "forward_backward_median_ms": am, "forward_backward_min_ms": amin}
                    for n, fm, fmin, am, amin in rows],
    }
    if a.ours:
        best = {k: min(r[k] for r in rows if r[0] != "fsdp-rs") for k in (2, 4)}
        mine = next(r for r in rows if r[0] == "fsdp-rs")
        result["ratio_forward_min"] = mine[2] / best[2]
        result["ratio_forward_backward_min"] = mine[4] / best[4]
        print(f"ratio fsdp-rs / PyTorch (minima): forward {result['ratio_forward_min']:.3f}, "
              f"forward+backward {result['ratio_forward_backward_min']:.3f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
