#!/usr/bin/env python3
"""Builds fixtures of PyTorch distributed checkpoints (torch.distributed.checkpoint, the format
Accelerate's SHARDED_STATE_DICT writes) for fsdp-rs's DCP reader, and the file Accelerate's own
`merge-weights` makes of each, so the reader can be checked bit for bit. Not run by CI: needs
`pip install torch==2.15.0 accelerate==1.15.0 transformers==5.24.0`.

    python3 tools/make_dcp_fixture.py OUT_DIR

writes, for FSDP1 (Accelerate's default) and FSDP2 on 2 CPU processes (gloo):
    OUT_DIR/<fsdp1|fsdp2>/pytorch_model_fsdp_0/        .metadata + __{rank}_0.distcp
    OUT_DIR/<fsdp1|fsdp2>/accelerate_merged.safetensors `accelerate merge-weights` of it
    OUT_DIR/<fsdp1|fsdp2>/full.safetensors              the unsharded weights

`crates/fsdp/tests/data/dcp` holds the first two of each (`tests/dcp.rs` reads them).
"""
import os
import subprocess
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp


def model():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=37, hidden_size=12, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=20, max_position_embeddings=8, num_labels=3)
    return BertForSequenceClassification(config)


def worker(rank, out, version):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29600 + (version == 2)))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    m = model()
    if rank == 0:
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in m.state_dict().items()}, f"{out}/full.safetensors",
                  metadata={"format": "pt"})
    ckpt = f"{out}/pytorch_model_fsdp_0"
    if version == 1:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        from transformers.models.bert.modeling_bert import BertLayer
        fsdp = FSDP(m, auto_wrap_policy=ModuleWrapPolicy({BertLayer}), device_id=torch.device("cpu"))
        with FSDP.state_dict_type(fsdp, StateDictType.SHARDED_STATE_DICT):
            state = {"model": fsdp.state_dict()}
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (2,))
        for layer in m.bert.encoder.layer:
            fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        state = {"model": m.state_dict()}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(ckpt))
    dist.destroy_process_group()


def main(root):
    for version in (1, 2):
        out = os.path.join(root, f"fsdp{version}")
        os.makedirs(out, exist_ok=True)
        mp.spawn(worker, args=(out, version), nprocs=2)
        subprocess.run(["accelerate", "merge-weights", f"{out}/pytorch_model_fsdp_0",
                        f"{out}/expected"], check=True)
        os.replace(f"{out}/expected/model.safetensors", f"{out}/accelerate_merged.safetensors")
        os.rmdir(f"{out}/expected")
        print(f"{out}: written")


if __name__ == "__main__":
    main(sys.argv[1])
