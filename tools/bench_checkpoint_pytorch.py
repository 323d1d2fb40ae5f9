#!/usr/bin/env python3
"""The anchor for `fsdp bench checkpoint`: what Accelerate's `save_state` does for
SHARDED_STATE_DICT (torch.distributed.checkpoint of the FSDP model and of its AdamW state,
after one training step) and DCP's `async_save` of the same state on 2 CPU processes (gloo), and the `accelerate merge-weights` command
on the result, for the same BERT shapes. With `--ours PATH_TO_FSDP` it runs `fsdp bench
checkpoint` right after, and prints the ratios. Not run by CI: needs
`pip install torch==2.15.0 accelerate==1.15.0 transformers==5.24.0`.

    python3 tools/bench_checkpoint_pytorch.py --ours target/release/fsdp
    python3 tools/bench_checkpoint_pytorch.py --hidden 768 --layers 12 --vocab 30522 --ours target/release/fsdp
"""
import argparse
import json
import os
import subprocess
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp


def worker(rank, args, out, result_file):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29650")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers import BertConfig, BertForSequenceClassification
    from transformers.models.bert.modeling_bert import BertLayer

    torch.manual_seed(0)
    config = BertConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                        num_attention_heads=max(args.hidden // 64, 1), intermediate_size=4 * args.hidden,
                        max_position_embeddings=128)
    model = FSDP(BertForSequenceClassification(config), auto_wrap_policy=ModuleWrapPolicy({BertLayer}),
                 device_id=torch.device("cpu"))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loss = model(torch.zeros(2, 16, dtype=torch.long), labels=torch.zeros(2, dtype=torch.long)).loss
    loss.backward()
    optim.step()
    times = []
    for rep in range(args.reps):
        dist.barrier()
        t = time.perf_counter()
        # Accelerate's save_fsdp_model and save_fsdp_optimizer for SHARDED_STATE_DICT.
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            dcp.save({"model": model.state_dict()},
                     storage_writer=dcp.FileSystemWriter(f"{out}/pytorch_model_fsdp_0"))
            optim_state = FSDP.optim_state_dict(model, optim)
            dcp.save({"optimizer": optim_state},
                     storage_writer=dcp.FileSystemWriter(f"{out}/optimizer_0"))
        dist.barrier()
        times.append(time.perf_counter() - t)
    # DCP's async_save (what a job that does not want to stall uses): the time the caller is
    # blocked, and until the files are written. Its background collectives get a gloo group
    # of their own, as PyTorch recommends, so they never meet the training's.
    ckpt_group = dist.new_group(backend="gloo")
    blocked, total = [], []
    for rep in range(args.reps):
        dist.barrier()
        t = time.perf_counter()
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            state = {"model": model.state_dict(), "optimizer": FSDP.optim_state_dict(model, optim)}
            future = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(f"{out}/async"),
                                    process_group=ckpt_group)
        blocked.append(time.perf_counter() - t)
        future.result()
        dist.barrier()
        total.append(time.perf_counter() - t)
    if rank == 0:
        median = lambda v: sorted(v)[len(v) // 2]
        json.dump({"save_s": median(times), "async_save_blocked_s": median(blocked),
                   "async_save_total_s": median(total)}, open(result_file, "w"))
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--ours", help="path to the fsdp binary: run `fsdp bench checkpoint` too")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as out:
        result_file = f"{out}/result.json"
        mp.spawn(worker, args=(args, out, result_file), nprocs=2)
        result = json.load(open(result_file))
        t = time.perf_counter()
        subprocess.run(["accelerate", "merge-weights", f"{out}/pytorch_model_fsdp_0", f"{out}/merged"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        result["merge_weights_cli_s"] = time.perf_counter() - t
    print("pytorch+accelerate", json.dumps(result))
    if args.ours:
        out = subprocess.run([args.ours, "bench", "checkpoint", "--num_processes", "2", "--hidden",
                              str(args.hidden), "--layers", str(args.layers), "--vocab", str(args.vocab),
                              "--reps", str(args.reps)], check=True, capture_output=True, text=True).stdout
        ours = json.loads(out.strip().splitlines()[-1])
        print("fsdp-rs", json.dumps({k: ours[k] for k in ("save_sharded_s", "save_torch_dcp_s", "save_async_blocked_s",
                                                            "save_async_total_s", "merge_weights_cli_s")}))
        print("ratio (ours / theirs): save_state", ours["save_sharded_s"] / result["save_s"],
              "save_state as DCP (torch-dcp)", ours["save_torch_dcp_s"] / result["save_s"],
              "async save blocked", ours["save_async_blocked_s"] / result["async_save_blocked_s"],
              "async save until written", ours["save_async_total_s"] / result["async_save_total_s"],
              "merge-weights CLI", ours["merge_weights_cli_s"] / result["merge_weights_cli_s"])


if __name__ == "__main__":
    main()
