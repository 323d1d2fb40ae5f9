#!/usr/bin/env python3
"""The PyTorch anchor for `fsdp bench optimizer`: one torch.optim step over a flat f32 shard
of the same size, on the same number of threads, with the same timing rule (two warm-ups,
then the median of the timed steps), for each implementation PyTorch has on the CPU:
single-tensor (`foreach=False`), `foreach=True` and `fused=True`. Prints a table and one
JSON line, which `fsdp bench optimizer --torch PYTHON` reads.

Needs torch (`pip install torch`); not part of the test suite.
"""
import argparse
import json
import statistics
import time

import torch


def build(name, params, **impl):
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, **impl)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3, weight_decay=0.01, **impl)
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9, **impl)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--elements", type=int, default=100_000_000)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "adam", "sgd"])
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    variants = {"single-tensor": {"foreach": False}, "foreach": {"foreach": True}}
    if a.optimizer != "sgd" or hasattr(torch, "_fused_sgd_"):
        variants["fused"] = {"fused": True}
    results = {}
    for label, impl in variants.items():
        p = torch.nn.Parameter(torch.rand(a.elements) * 2 - 1)
        p.grad = (torch.rand(a.elements) - 0.5) * 1e-2
        try:
            opt = build(a.optimizer, [p], **impl)
        except (RuntimeError, ValueError) as e:
            print(f"{label}: not available ({e})")
            continue
        times = []
        with torch.no_grad():
            for step in range(a.steps + 2):
                t = time.perf_counter()
                opt.step()
                if step >= 2:
                    times.append(time.perf_counter() - t)
        results[label] = statistics.median(times)
        print(f"torch {label:<14} {results[label] * 1e3:9.1f} ms/step")
        del opt, p
    print(json.dumps({"torch": torch.__version__, "threads": a.threads, "results": results}))


if __name__ == "__main__":
    main()
