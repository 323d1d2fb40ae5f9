#!/usr/bin/env python3
"""The anchor for `fsdp bench memory`: the reference BERT (hidden 256, 4 layers, 4 heads,
intermediate 1024, vocab 8192, sequence 128, no dropout) trained by PyTorch FSDP FULL_SHARD
(units per BertEmbeddings and BertLayer, as ours, gloo) on 2 CPU processes with one thread each, as `fsdp launch` runs
ours: 8 random sequences per rank per step, AdamW lr 1e-4, gradients clipped to norm 1, one
warm-up step and then timed steps, samples/s from the slowest rank.

With `--ours PATH_TO_FSDP` it runs `fsdp bench memory --strategies FULL_SHARD` between
PyTorch's runs (`--repeat` times each, alternating), for a side-by-side figure from one
sitting, and prints one JSON line per run and the ratio of the medians.

With `--mixed_precision bf16` both train as Accelerate's `mixed_precision: bf16` does under
FSDP: parameters gathered and computed in bf16, gradients reduced in bf16 (PyTorch:
`MixedPrecision(param_dtype, reduce_dtype, buffer_dtype)` all bf16; ours:
`--mixed_precision on --reduce_dtype bf16`), f32 master weights and AdamW.

Not run by CI: needs `pip install torch==2.15.0 transformers==5.24.0`. From the repository
root:

    python3 tools/bench_reference_bert_pytorch.py --ours target/release/fsdp --repeat 3
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
BATCH = 8
SEQ = 128
VOCAB = 8192


def worker(rank, steps, port, result_file, mixed_precision):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers import BertConfig, BertForSequenceClassification
    from transformers.models.bert.modeling_bert import BertEmbeddings, BertLayer

    torch.manual_seed(42)
    config = BertConfig(
        vocab_size=VOCAB, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=1024, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=2)
    model = FSDP(
        BertForSequenceClassification(config),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        auto_wrap_policy=ModuleWrapPolicy({BertEmbeddings, BertLayer}),
        device_id=torch.device("cpu"), use_orig_params=True,
        mixed_precision=MixedPrecision(torch.bfloat16, torch.bfloat16, torch.bfloat16)
        if mixed_precision == "bf16" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(rank)
    timed = 0.0
    for step in range(steps + 1):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        labels = torch.randint(0, 2, (BATCH,), generator=gen)
        started = time.perf_counter()
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step > 0:
            timed += time.perf_counter() - started
    slowest = torch.tensor([timed])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    rss = torch.tensor([float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)])
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    if rank == 0:
        with open(result_file, "w") as f:
            json.dump({"samples_per_s": steps * BATCH * WORLD / slowest.item(),
                       "peak_rss_mib": rss.item() / 1024}, f)
    dist.destroy_process_group()


def pytorch(steps, port, mixed_precision):
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "result.json")
        mp.spawn(worker, args=(steps, port, out, mixed_precision), nprocs=WORLD, join=True)
        with open(out) as f:
            return json.load(f)


def ours(fsdp, steps, mixed_precision):
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "result.json")
        subprocess.run([fsdp, "bench", "memory", "--num_processes", str(WORLD),
                        "--strategies", "FULL_SHARD", "--steps", str(steps),
                        "--batch", str(BATCH), "--seq", str(SEQ), "--json", out]
                       + (["--mixed_precision", "on", "--reduce_dtype", "bf16"]
                          if mixed_precision == "bf16" else []),
                       check=True, capture_output=True)
        with open(out) as f:
            r = json.load(f)["results"][0]
        return {"samples_per_s": r["samples_per_s"],
                "peak_rss_mib": r.get("peak_rss_bytes", 0) / 2**20}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5, help="timed steps after one warm-up step")
    p.add_argument("--repeat", type=int, default=1, help="runs of each, alternating")
    p.add_argument("--ours", help="path to the fsdp binary: run fsdp bench memory between")
    p.add_argument("--port", type=int, default=29517)
    p.add_argument("--mixed_precision", choices=["no", "bf16"], default="no",
                   help="bf16: parameters and compute in bf16, gradients reduced in bf16")
    a = p.parse_args()
    torch_rates, our_rates = [], []
    for i in range(a.repeat):
        t = pytorch(a.steps, a.port + i, a.mixed_precision)
        torch_rates.append(t["samples_per_s"])
        print(json.dumps({"run": i, "pytorch_fsdp": t}), flush=True)
        if a.ours:
            o = ours(a.ours, a.steps, a.mixed_precision)
            our_rates.append(o["samples_per_s"])
            print(json.dumps({"run": i, "fsdp_rs": o}), flush=True)
    summary = {"mixed_precision": a.mixed_precision,
               "pytorch_samples_per_s_median": statistics.median(torch_rates)}
    if our_rates:
        summary["fsdp_rs_samples_per_s_median"] = statistics.median(our_rates)
        summary["ratio"] = summary["fsdp_rs_samples_per_s_median"] / summary[
            "pytorch_samples_per_s_median"]
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
