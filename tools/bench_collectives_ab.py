#!/usr/bin/env python3
"""Two builds of `fsdp` side by side on `fsdp bench collectives`: runs each `--rounds` times,
alternating (so both see the same machine), and prints per op and size from 1 MiB the median
bus bandwidth of each and the ratio after / before, then one JSON document on the last line.
For a change to a transport's hot path; both binaries need the `bench` feature.

    python3 tools/bench_collectives_ab.py BEFORE_FSDP AFTER_FSDP --transport tcp --rounds 3
"""
import argparse
import collections
import json
import os
import statistics
import subprocess
import tempfile


def main():
    p = argparse.ArgumentParser()
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("--transport", default="tcp")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num_processes", type=int, default=2)
    p.add_argument("--max_mib", type=int, default=64)
    a = p.parse_args()
    runs = collections.defaultdict(list)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "run.json")
        for _ in range(a.rounds):
            for name, binary in (("before", a.before), ("after", a.after)):
                subprocess.run([binary, "bench", "collectives", "--transport", a.transport,
                                "--num_processes", str(a.num_processes), "--max_mib",
                                str(a.max_mib), "--json", out],
                               stdout=subprocess.DEVNULL, check=True)
                for row in json.load(open(out))["runs"][0]["results"]:
                    if row["bytes"] >= 1 << 20:
                        runs[(row["op"], row["bytes"], name)].append(row["busbw_gbps"])
    rows = []
    for op, size in sorted({(k[0], k[1]) for k in runs}):
        before = statistics.median(runs[(op, size, "before")])
        after = statistics.median(runs[(op, size, "after")])
        rows.append({"op": op, "bytes": size, "before_busbw_gbps": before,
                     "after_busbw_gbps": after, "after_over_before": after / before})
        print(f"{op:15s} {size >> 20:3d} MiB  before {before:6.2f}  after {after:6.2f} GB/s"
              f"  after/before {after / before:.2f}")
    print(json.dumps({"benchmark": "collectives_ab", "transport": a.transport,
                      "num_processes": a.num_processes, "rounds": a.rounds, "rows": rows}))


if __name__ == "__main__":
    main()
