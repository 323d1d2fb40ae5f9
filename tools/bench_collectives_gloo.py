#!/usr/bin/env python3
"""The anchor for `fsdp bench collectives`: PyTorch's gloo backend (what PyTorch FSDP and
Accelerate use between CPU processes) timed with the same conventions as ours — f32 buffers
from 4 KiB up to `--max_mib`, one warm-up, `--iters` repetitions back to back between
barriers, the slowest rank's time per op, NCCL-tests' bus bandwidth (2(n-1)/n for
all-reduce, (n-1)/n for all-gather, reduce-scatter and all-to-all, 1 for broadcast) — on
`--num_processes` local processes with one thread each, as `fsdp launch` runs ours.

With `--ours PATH_TO_FSDP` (a build with the `bench` feature) it runs `fsdp bench collectives
--transport tcp,shm` between gloo's runs (`--repeat` times each, alternating) and prints, per
op and size, the median bus bandwidth of each and the ratios ours / gloo: one JSON document on
the last line.

Not run by CI: needs `pip install torch`. From the repository root:

    python3 tools/bench_collectives_gloo.py --ours target/release/fsdp --repeat 2
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def sizes(max_mib):
    out, s = [], 4 << 10
    while s <= max_mib << 20:
        out.append(s)
        s *= 4
    return out


def time_op(f, iters):
    f()
    dist.barrier()
    started = time.perf_counter()
    for _ in range(iters):
        f()
    mine = torch.tensor([(time.perf_counter() - started) / iters], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return mine.item()


def worker(rank, world, port, iters, max_mib, result_file):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = []
    for nbytes in sizes(max_mib):
        elems = nbytes // 4
        shard = elems // world
        full = torch.ones(elems)
        part = torch.ones(shard)
        gathered = torch.zeros(shard * world)
        scattered = torch.zeros(shard)
        exchanged = torch.zeros(shard * world)
        cases = [
            ("all_reduce", 2 * (world - 1) / world, lambda: dist.all_reduce(full)),
            ("all_gather", (world - 1) / world,
             lambda: dist.all_gather_into_tensor(gathered, part)),
            ("reduce_scatter", (world - 1) / world,
             lambda: dist.reduce_scatter_tensor(scattered, gathered)),
            ("all_to_all", (world - 1) / world,
             lambda: dist.all_to_all_single(exchanged, gathered)),
            ("broadcast", 1.0, lambda: dist.broadcast(full, 0)),
        ]
        for op, factor, f in cases:
            try:
                seconds = time_op(f, iters)
            except RuntimeError as e:  # an op this gloo build lacks
                if rank == 0:
                    print(f"gloo {op}: {e}".splitlines()[0])
                continue
            algbw = nbytes / seconds / 1e9
            rows.append({"op": op, "bytes": nbytes, "time_us": seconds * 1e6,
                         "algbw_gbps": algbw, "busbw_gbps": algbw * factor})
    if rank == 0:
        with open(result_file, "w") as out:
            json.dump({"transport": "gloo", "num_processes": world, "iters": iters,
                       "torch": torch.__version__, "results": rows}, out)
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_gloo(a):
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "gloo.json")
        mp.spawn(worker, args=(a.num_processes, free_port(), a.iters, a.max_mib, result),
                 nprocs=a.num_processes, join=True)
        with open(result) as f:
            return [json.load(f)]


def run_ours(a):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ours.json")
        subprocess.run([a.ours, "bench", "collectives", "--num_processes", str(a.num_processes),
                        "--iters", str(a.iters), "--max_mib", str(a.max_mib),
                        "--transport", a.transport, "--json", out],
                       check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)["runs"]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num_processes", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--max_mib", type=int, default=64)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--ours", help="path to an fsdp binary built with the bench feature")
    p.add_argument("--transport", default="tcp,shm", help="our transports to measure")
    a = p.parse_args()
    busbw = {}  # (transport, op, bytes) -> [GB/s per run]
    for _ in range(a.repeat):
        runs = run_gloo(a) + (run_ours(a) if a.ours else [])
        for run in runs:
            for r in run["results"]:
                busbw.setdefault((run["transport"], r["op"], r["bytes"]), []).append(
                    r["busbw_gbps"])
    median = {k: statistics.median(v) for k, v in busbw.items()}
    transports = sorted({k[0] for k in median} - {"gloo"})
    rows = []
    print(f"{'op':>15} {'bytes':>10} {'gloo':>8} " + " ".join(
        f"{t:>8} {t + '/gloo':>9}" for t in transports) + "   (bus GB/s, medians)")
    for (t, op, nbytes), gloo in sorted(median.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        if t != "gloo":
            continue
        row = {"op": op, "bytes": nbytes, "gloo_busbw_gbps": gloo}
        line = f"{op:>15} {nbytes:>10} {gloo:>8.3f} "
        for ours in transports:
            mine = median.get((ours, op, nbytes))
            if mine is None:
                line += f"{'-':>8} {'-':>9} "
                continue
            row[f"{ours}_busbw_gbps"] = mine
            row[f"{ours}_over_gloo"] = mine / gloo
            line += f"{mine:>8.3f} {mine / gloo:>9.2f} "
        print(line)
        rows.append(row)
    print(json.dumps({"benchmark": "collectives_vs_gloo", "num_processes": a.num_processes,
                      "repeat": a.repeat, "iters": a.iters, "torch": torch.__version__,
                      "rows": rows}))


if __name__ == "__main__":
    main()
