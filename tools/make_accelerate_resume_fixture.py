#!/usr/bin/env python3
"""A run in PyTorch + Accelerate FSDP that moves to fsdp-rs mid-training: the tiny BERT of
fsdp-rs's tests (`crates/fsdp/tests/common/tiny.rs`: same shape, same batches) trained 3
steps with AdamW under Accelerate's FSDP (FULL_SHARD, BertLayer units, SHARDED_STATE_DICT) on
2 CPU processes (gloo), constant learning rate, then `accelerator.save_state(OUT/checkpoint)`, then 3 more steps.
Once with FSDP1 (Accelerate's default) and once with FSDP2. What fsdp-rs must reproduce after loading that checkpoint: the losses of steps 4-6 and the
final weights. Not run by CI: needs
`pip install torch==2.15.0 accelerate==1.15.0 transformers==5.24.0`.

    python3 tools/make_accelerate_resume_fixture.py crates/fsdp/tests/data/accelerate_resume

writes, for fsdp1 and fsdp2, OUT/fsdpN/checkpoint/ (what Accelerate wrote: pytorch_model_fsdp_0/ and optimizer_0/ as
PyTorch DCP, random_states_{rank}.pkl), OUT/expected.json (losses of all 6
steps, the step saved) and OUT/fsdpN/final.safetensors (the weights after step 6).
"""
import json
import os
import shutil
import sys

import torch
import torch.multiprocessing as mp

GLOBAL_BATCH, SEQ, VOCAB = 12, 5, 37
MASK = (1 << 64) - 1


def batch(step):
    """tiny.rs's `batch(step)`: xorshift64 from a seed of the step."""
    s = 0x2545_F491_4F6C_DD1D ^ (((step + 1) * 0x9E37_79B9) & MASK)

    def next_():
        nonlocal s
        s ^= (s << 13) & MASK
        s ^= s >> 7
        s ^= (s << 17) & MASK
        return s

    ids = [next_() % VOCAB for _ in range(GLOBAL_BATCH * SEQ)]
    labels = [next_() % 3 for _ in range(GLOBAL_BATCH)]
    return torch.tensor(ids).view(GLOBAL_BATCH, SEQ), torch.tensor(labels)


def prepare(rank, version, port):
    """Rank `rank` of 2: the tiny BERT (seed 0) and AdamW (no decay on biases and LayerNorm
    weights) prepared by Accelerate's FSDP`version` (FULL_SHARD, BertLayer units,
    SHARDED_STATE_DICT) on CPU processes over gloo."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    torch.set_num_threads(1)
    from accelerate import FullyShardedDataParallelPlugin
    from transformers import BertConfig, BertForSequenceClassification

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=version,
        reshard_after_forward=True if version == 2 else "FULL_SHARD",
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["BertLayer"],
        state_dict_type="SHARDED_STATE_DICT",
        use_orig_params=True,
        sync_module_states=False,
        cpu_ram_efficient_loading=False,
    )
    from accelerate.utils import DistributedType
    from accelerate_cpu_fsdp import accelerator_with_fsdp
    acc = accelerator_with_fsdp(plugin)
    assert acc.distributed_type == DistributedType.FSDP, acc.distributed_type
    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB, hidden_size=12, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=20, max_position_embeddings=8, num_labels=3,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertForSequenceClassification(config)
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias") or "LayerNorm" in n]
    decay = [p for n, p in model.named_parameters() if not (n.endswith("bias") or "LayerNorm" in n)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=1e-3)
    # Together, as FSDP2 requires (the optimizer's parameters are replaced by sharded ones).
    model, optimizer = acc.prepare(model, optimizer)
    assert type(model).__name__.startswith("FullyShardedDataParallel" if version == 1 else "FSDP"), type(model)
    model.train()
    return acc, model, optimizer


def train_step(acc, model, optimizer, step, rank):
    """One step on this rank's half of `batch(step)`; the loss averaged over the ranks."""
    per_rank = GLOBAL_BATCH // 2
    ids, labels = batch(step)
    ids, labels = ids[rank * per_rank:(rank + 1) * per_rank], labels[rank * per_rank:(rank + 1) * per_rank]
    loss = torch.nn.functional.cross_entropy(model(input_ids=ids).logits, labels)
    acc.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    return float(acc.reduce(loss.detach(), reduction="mean"))


def save_weights(acc, model, path):
    """The full weights, written by rank 0 as safetensors."""
    state = acc.get_state_dict(model)
    if acc.process_index == 0:
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in state.items()}, path)


def worker(rank, out, version):
    acc, model, optimizer = prepare(rank, version, 29655 + version)
    losses = []
    for step in range(6):
        if step == 3:
            acc.save_state(f"{out}/checkpoint")
        losses.append(train_step(acc, model, optimizer, step, rank))
    save_weights(acc, model, f"{out}/final.safetensors")
    if rank == 0:
        json.dump({"losses": losses, "saved_after_steps": 3}, open(f"{out}/expected.json", "w"), indent=1)


def main(root):
    for version in (1, 2):
        out = os.path.join(root, f"fsdp{version}")
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        mp.spawn(worker, args=(out, version), nprocs=2)
        print(f"{out}: written")


if __name__ == "__main__":
    main(sys.argv[1])
