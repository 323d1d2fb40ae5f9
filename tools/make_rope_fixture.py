#!/usr/bin/env python3
"""Rotary position embedding as transformers computes it (LlamaRotaryEmbedding and
apply_rotary_pos_emb), for crates/fsdp-nn/src/ops/rope.rs's tests: for each rope_scaling
(default, linear, llama3) the f32 inv_freq and the embedding of a fixed random q
[2, 2, 5, head_dim] at per-sequence positions. Needs torch and transformers (pip):

    python3 tools/make_rope_fixture.py crates/fsdp-nn/tests/data/rope
"""
import json
import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

CASES = {
    "default": dict(theta=10000.0, head_dim=8, scaling=None),
    "linear": dict(theta=10000.0, head_dim=8, scaling={"rope_type": "linear", "factor": 2.0}),
    "llama3": dict(
        theta=500000.0,
        head_dim=16,
        scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
}


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tensors, cases = {}, {}
    positions = torch.tensor([[0, 1, 2, 3, 4], [3, 4, 5, 6, 7000]])
    for name, c in CASES.items():
        rope = {"rope_type": "default", "rope_theta": c["theta"]}
        if c["scaling"]:
            rope.update(c["scaling"])
        config = LlamaConfig(
            hidden_size=2 * c["head_dim"],
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=c["head_dim"],
            max_position_embeddings=8192,
            rope_parameters=rope,
        )
        rotary = LlamaRotaryEmbedding(config)
        g = torch.Generator().manual_seed(7)
        q = torch.rand(2, 2, 5, c["head_dim"], generator=g, dtype=torch.float32) * 2 - 1
        cos, sin = rotary(q, positions)
        embedded, _ = apply_rotary_pos_emb(q, q, cos, sin)
        tensors[f"{name}.inv_freq"] = rotary.inv_freq.float().contiguous()
        tensors[f"{name}.q"] = q.contiguous()
        tensors[f"{name}.out"] = embedded.contiguous()
        cases[name] = {"theta": c["theta"], "head_dim": c["head_dim"], "rope_scaling": c["scaling"]}
    save_file(tensors, str(out / "rope.safetensors"))
    doc = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "positions": positions.tolist(),
        "cases": cases,
    }
    (out / "rope.json").write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
