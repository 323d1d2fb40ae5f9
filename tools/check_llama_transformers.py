#!/usr/bin/env python3
"""Loads the model llama_example saved (model.safetensors + config.json) with transformers'
AutoModelForCausalLM, checks that every weight arrives unchanged and nothing is missing or
left over, and continues the example's prompt greedily with the tokenizer transformers builds
from the GGUF file; with --expect, the continuation must equal the one the example printed
after fine-tuning. Needs torch, transformers, accelerate and gguf (pip).

    fsdp launch --num_processes 2 --example llama_example
    python3 tools/check_llama_transformers.py target/llama_example/model \
        target/assets/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --expect " ..."
"""
import argparse
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("gguf")
    ap.add_argument("--prompt", default="The movie was")
    ap.add_argument("--max_new_tokens", type=int, default=20)
    ap.add_argument("--expect")
    a = ap.parse_args()
    model, info = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    saved = load_file(str(Path(a.model) / "model.safetensors"))
    state = model.state_dict()
    for name, t in saved.items():
        assert torch.equal(state[name], t), name
    gguf = Path(a.gguf)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    ids = tokenizer(a.prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=a.max_new_tokens, do_sample=False, eos_token_id=model.config.eos_token_id)
    text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    print(f"{a.model}: {type(model).__name__}, {len(saved)} tensors loaded unchanged "
          f"(lm_head tied: {model.config.tie_word_embeddings}); {a.prompt!r} -> {text!r}")
    if a.expect is not None:
        assert text == a.expect, f"expected {a.expect!r}"
        print("the same continuation as fsdp-rs's")


if __name__ == "__main__":
    main()
