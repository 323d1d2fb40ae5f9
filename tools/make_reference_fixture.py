#!/usr/bin/env python3
"""Writes crates/fsdp/tests/data/reference/: the PyTorch FSDP reference run the anchored
numerics tests (tests/fsdp_reference.rs, tests/bert_reference.rs) reproduce, small enough to
live in the repository (about 1 MB) so that those tests run on every clone instead of
skipping.

The run is the one of ../shared/reference (README there) at a smaller size: a
BertForSequenceClassification (vocab 2048, hidden 32, 2 layers, 4 heads, intermediate 128,
sequence 32, exact-erf GELU, all dropout 0, 2 labels) trained 30 steps on a 16-sample global
batch by PyTorch FSDP FULL_SHARD (units per BertEmbeddings and BertLayer) on 2 gloo processes,
each taking rows r*8..r*8+7 of the step's batch; and by one process on the whole batch.
Cross entropy, mean over the local batch; AdamW on every parameter (weight decay too), no
scheduler, no clipping. Each sequence's first token (1 or 2) gives its label away, the rest
is random, so the loss has something to learn.

Files (the same names and layout as ../shared/reference):
  init.safetensors                   initial weights (HF names), the config in the metadata
  data.safetensors                   input_ids int64 [30, 16, 32], labels int64 [30, 16]
  losses.json                        per-step losses of both runs, the optimizer's settings,
                                     and how far PyTorch's two runs are apart
  final_after_30_steps.safetensors   the FSDP run's weights after step 30

Needs torch 2.15 and transformers 5.24 (`pip install torch==2.15.0 transformers==5.24.0`).
Usage (repository root): python3 tools/make_reference_fixture.py [OUT_DIR]
"""
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
STEPS = 30
GLOBAL_BATCH = 16
SEQ = 32
VOCAB = 2048
OPTIMIZER = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
CONFIG = {
    "vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    "intermediate_size": 128, "hidden_act": "gelu", "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0, "max_position_embeddings": SEQ, "type_vocab_size": 2,
    "initializer_range": 0.02, "layer_norm_eps": 1e-12, "pad_token_id": 0, "num_labels": 2,
}


def model_from(init_path):
    from safetensors.torch import load_file
    from transformers import BertConfig, BertForSequenceClassification

    model = BertForSequenceClassification(BertConfig(**CONFIG))
    missing, unexpected = model.load_state_dict(load_file(init_path), strict=False)
    assert not unexpected and all("position_ids" in m or "token_type_ids" in m for m in missing), (
        missing, unexpected)
    return model


def optimizer_of(model):
    return torch.optim.AdamW(model.parameters(), lr=OPTIMIZER["lr"],
                             betas=tuple(OPTIMIZER["betas"]), eps=OPTIMIZER["eps"],
                             weight_decay=OPTIMIZER["weight_decay"])


def fsdp_worker(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from safetensors.torch import load_file, save_file
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.bert.modeling_bert import BertEmbeddings, BertLayer

    model = FSDP(model_from(os.path.join(out, "init.safetensors")),
                 sharding_strategy=ShardingStrategy.FULL_SHARD,
                 auto_wrap_policy=ModuleWrapPolicy({BertEmbeddings, BertLayer}),
                 device_id=torch.device("cpu"), use_orig_params=True)
    opt = optimizer_of(model)
    data = load_file(os.path.join(out, "data.safetensors"))
    per_rank = GLOBAL_BATCH // WORLD
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    losses = []
    for step in range(STEPS):
        out_ = model(input_ids=data["input_ids"][step, rows], labels=data["labels"][step, rows])
        out_.loss.backward()
        opt.step()
        opt.zero_grad()
        mean = out_.loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / WORLD)
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        state = model.state_dict()
    if rank == 0:
        state = {k: v.contiguous() for k, v in state.items() if "position_ids" not in k}
        save_file(state, os.path.join(out, "final_after_30_steps.safetensors"))
        with open(os.path.join(out, "fsdp_losses.json"), "w") as f:
            json.dump(losses, f)
    dist.destroy_process_group()


def main():
    from safetensors.torch import load_file, save_file
    from transformers import BertConfig, BertForSequenceClassification

    out = sys.argv[1] if len(sys.argv) > 1 else "crates/fsdp/tests/data/reference"
    os.makedirs(out, exist_ok=True)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(**CONFIG))
    init = {k: v.contiguous() for k, v in model.state_dict().items() if "position_ids" not in k}
    save_file(init, os.path.join(out, "init.safetensors"), metadata={"config": json.dumps(CONFIG)})
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (STEPS, GLOBAL_BATCH, SEQ), generator=g)
    labels = torch.randint(0, 2, (STEPS, GLOBAL_BATCH), generator=g)
    ids[:, :, 0] = 1 + labels
    save_file({"input_ids": ids.contiguous(), "labels": labels.contiguous()},
              os.path.join(out, "data.safetensors"))

    port = 29000 + os.getpid() % 1000
    mp.spawn(fsdp_worker, args=(port, out), nprocs=WORLD, join=True)
    with open(os.path.join(out, "fsdp_losses.json")) as f:
        fsdp_losses = json.load(f)
    os.remove(os.path.join(out, "fsdp_losses.json"))

    single = model_from(os.path.join(out, "init.safetensors"))
    opt = optimizer_of(single)
    single_losses = []
    for step in range(STEPS):
        o = single(input_ids=ids[step], labels=labels[step])
        o.loss.backward()
        opt.step()
        opt.zero_grad()
        single_losses.append(o.loss.item())
    final = load_file(os.path.join(out, "final_after_30_steps.safetensors"))
    single_state = single.state_dict()
    weight_gap = max((final[k] - single_state[k]).abs().max().item() for k in final)
    loss_gap = max(abs(a - b) for a, b in zip(fsdp_losses, single_losses))
    doc = {
        "description": "per-step training loss (mean over the 16-sample global batch) of the "
                       "reference run; steps 1..30 (tools/make_reference_fixture.py)",
        "fsdp_full_shard_2_ranks": fsdp_losses,
        "single_process_batch_16": single_losses,
        "optimizer": OPTIMIZER,
        "pytorch_fsdp_vs_single_process": {"max_abs_loss": loss_gap,
                                           "max_abs_final_weight": weight_gap},
        "torch": torch.__version__,
    }
    with open(os.path.join(out, "losses.json"), "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps({"first_loss": fsdp_losses[0], "last_loss": fsdp_losses[-1],
                      "loss_gap": loss_gap, "weight_gap": weight_gap}))


if __name__ == "__main__":
    main()
