#!/usr/bin/env python3
"""Two builds of `fsdp` side by side on `fsdp bench gemm`: runs each `--rounds` times,
alternating (so both see the same machine), and prints per shape the best forward and
backward GFLOP/s of each and the ratio after / before, then one JSON document on the last
line. The best round, not the median: on a machine whose speed swings between runs (a VM
sharing its cores) the best is what the code reaches undisturbed. For a change to the
GEMM's hot path; both binaries need the `bench` feature.

    python3 tools/bench_gemm_ab.py BEFORE_FSDP AFTER_FSDP --dtype bf16 --rounds 10 \\
        [--shapes 1024x1024x256,1024x1024x1024]
"""
import argparse
import collections
import json
import subprocess


def run(fsdp, a):
    cmd = [fsdp, "bench", "gemm", "--dtype", a.dtype, "--reps", str(a.reps)]
    if a.shapes:
        cmd += ["--shapes", a.shapes]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    doc = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    return {f'{r["tokens"]}x{r["out"]}x{r["in"]}': (r["forward_gflops"], r["backward_gflops"])
            for r in doc["results"]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "f32"])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--shapes", help="TOKENSxOUTxIN, comma-separated (default: bench gemm's set)")
    a = p.parse_args()
    best = {"before": collections.defaultdict(lambda: [0.0, 0.0]),
            "after": collections.defaultdict(lambda: [0.0, 0.0])}
    for _ in range(a.rounds):
        for build in ("before", "after"):
            for shape, rates in run(getattr(a, build), a).items():
                best[build][shape] = [max(b, r) for b, r in zip(best[build][shape], rates)]
    rows = []
    print(f"best of {a.rounds} alternating rounds, {a.dtype}, GFLOP/s on one thread")
    print(f'{"shape":18} {"fwd before":>10} {"after":>8} {"ratio":>6}   {"bwd before":>10} {"after":>8} {"ratio":>6}')
    for shape, (bf, bb) in best["before"].items():
        af, ab = best["after"][shape]
        rows.append({"shape": shape, "forward": [bf, af], "backward": [bb, ab],
                     "forward_ratio": af / bf, "backward_ratio": ab / bb})
        print(f"{shape:18} {bf:10.1f} {af:8.1f} {af / bf:6.2f}   {bb:10.1f} {ab:8.1f} {ab / bb:6.2f}")
    print(json.dumps({"benchmark": "gemm_ab", "dtype": a.dtype, "rounds": a.rounds,
                      "before": a.before, "after": a.after, "results": rows}))


if __name__ == "__main__":
    main()
