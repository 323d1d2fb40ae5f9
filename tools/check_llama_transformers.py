#!/usr/bin/env python3
"""Loads the folder llama_example saved with transformers alone (`AutoModelForCausalLM`,
`AutoTokenizer`, `GenerationConfig` from the folder: no GGUF file, no argument telling it
anything), checks that every weight arrives unchanged, nothing is missing or left over, the
tokenizer's special tokens are the model's and inside its vocabulary, and the RoPE base is the
one config.json states; then continues the prompt greedily with the folder's own generation
settings. Prints one JSON line (transformers' version, the prompt's ids, the last position's
logits, the continuation), for tools/check-llama-transformers-versions.sh to compare across
transformers versions; with --expect, the continuation must equal the one the example
printed after fine-tuning. Needs torch and transformers (pip).

    fsdp launch --num_processes 2 --example llama_example
    python3 tools/check_llama_transformers.py target/llama_example/model --expect " ..."
"""
import argparse
import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig


def rope_base(config) -> float:
    """The RoPE base the loaded config will use: 4.x's attribute, or 5.x's parameters."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params and transformers.__version__ >= "5":
        return float(params["rope_theta"])
    return float(config.rope_theta)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prompt", default="The movie was")
    ap.add_argument("--max_new_tokens", type=int, default=20)
    ap.add_argument("--expect")
    a = ap.parse_args()
    folder = Path(a.model)
    stated = json.loads((folder / "config.json").read_text())
    config = AutoConfig.from_pretrained(folder)
    theta = rope_base(config)
    assert theta == float(stated["rope_theta"]), f"RoPE base read as {theta}, config.json says {stated['rope_theta']}"
    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    saved = load_file(str(folder / "model.safetensors"))
    state = model.state_dict()
    for name, t in saved.items():
        assert torch.equal(state[name], t), name
    tokenizer = AutoTokenizer.from_pretrained(folder)
    vocab = model.config.vocab_size
    for kind in ("bos", "eos", "pad"):
        want = stated.get(f"{kind}_token_id")
        got = getattr(tokenizer, f"{kind}_token_id")
        assert got == want, f"tokenizer's {kind}_token_id {got}, config.json's {want}"
    assert len(tokenizer) <= vocab, f"the tokenizer has {len(tokenizer)} tokens, the model {vocab}"
    generation = GenerationConfig.from_pretrained(folder)
    assert generation.eos_token_id == stated["eos_token_id"], generation
    generation.update(max_new_tokens=a.max_new_tokens, do_sample=False)
    encoded = tokenizer(a.prompt, return_tensors="pt")
    ids = encoded.input_ids
    assert int(ids.max()) < vocab, f"prompt ids {ids.tolist()} outside the vocabulary of {vocab}"
    with torch.no_grad():
        logits = model(ids).logits[0, -1]
        out = model.generate(**encoded, generation_config=generation)
    text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    print(json.dumps({
        "transformers": transformers.__version__,
        "rope_theta": theta,
        "tokenizer": type(tokenizer).__name__,
        "special_tokens": [tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token],
        "prompt_ids": ids[0].tolist(),
        "last_logits": logits.tolist(),
        "continuation": text,
    }))
    if a.expect is not None:
        assert text == a.expect, f"continuation {text!r}, expected {a.expect!r}"


if __name__ == "__main__":
    main()
