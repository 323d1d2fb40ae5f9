#!/usr/bin/env python3
"""Writes crates/fsdp/tests/data/param_groups/: a single-process PyTorch run that the
Accelerator must reproduce on any number of processes.

A tiny transformers BertForSequenceClassification (dropout 0) trained as fine-tuning recipes
do: AdamW with two parameter groups (weight decay 0.01, and none for biases and LayerNorm
weights), transformers' linear schedule with warmup stepped once per optimizer step, gradient
accumulation over 2 micro-batches (each loss divided by 2), and clipping to global norm 1.0.

Files: init.safetensors (initial weights), data.safetensors (input_ids [N, 5] and labels [N],
int64, consumed in order, 12 per micro-batch), expected.json (the loss of every micro-batch,
each group's learning rate at every optimizer step, the gradient norm before clipping), and
final.safetensors (the weights after the last step).

Needs torch, transformers and safetensors (pip); run from the repository root.
"""

import json
import math
import pathlib

import torch
from safetensors.torch import save_file
from transformers import BertConfig, BertForSequenceClassification

OUT = pathlib.Path("crates/fsdp/tests/data/param_groups")
MICRO = 12
ACCUMULATION = 2
STEPS = 6
WARMUP = 2


def no_decay(name):
    return name.endswith("bias") or "LayerNorm" in name


def main():
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=37,
        hidden_size=12,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=20,
        max_position_embeddings=8,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=0,
        attn_implementation="eager",
    )
    model = BertForSequenceClassification(config)
    model.train()
    init = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}

    n = MICRO * ACCUMULATION * STEPS
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 37, (n, 5), generator=g)
    labels = torch.randint(0, 3, (n,), generator=g)

    named = list(model.named_parameters())
    groups = [
        {"params": [p for k, p in named if not no_decay(k)], "weight_decay": 0.01},
        {"params": [p for k, p in named if no_decay(k)], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.999), eps=1e-8)

    def linear(step):  # transformers' get_linear_schedule_with_warmup
        if step < WARMUP:
            return step / max(1, WARMUP)
        return max(0.0, (STEPS - step) / max(1, STEPS - WARMUP))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, linear)
    losses, lrs, norms = [], [], []
    for step in range(STEPS):
        lrs.append([grp["lr"] for grp in opt.param_groups])
        for micro in range(ACCUMULATION):
            start = (step * ACCUMULATION + micro) * MICRO
            logits = model(input_ids=ids[start : start + MICRO]).logits
            loss = torch.nn.functional.cross_entropy(logits, labels[start : start + MICRO])
            losses.append(loss.item())
            (loss / ACCUMULATION).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        opt.step()
        sched.step()
        opt.zero_grad()

    OUT.mkdir(parents=True, exist_ok=True)
    save_file(init, OUT / "init.safetensors")
    save_file({"input_ids": ids.contiguous(), "labels": labels.contiguous()}, OUT / "data.safetensors")
    final = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    save_file(final, OUT / "final.safetensors")
    expected = {
        "torch": torch.__version__,
        "micro_batch": MICRO,
        "accumulation": ACCUMULATION,
        "steps": STEPS,
        "warmup": WARMUP,
        "lr": 1e-2,
        "weight_decay": 0.01,
        "max_grad_norm": 1.0,
        "losses": losses,
        "lrs": lrs,
        "grad_norms": norms,
    }
    (OUT / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    assert all(math.isfinite(x) for x in losses)
    print(f"wrote {OUT}: losses {losses[0]:.4f} -> {losses[-1]:.4f}")


if __name__ == "__main__":
    main()
