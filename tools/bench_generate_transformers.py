#!/usr/bin/env python3
"""transformers' `generate` (greedy, its KV cache) on one process for the anchor of
llama_example's generation under FSDP: the same GGUF file, prompt and token count; prints the
continuation and tokens/s as one JSON line.

    python3 tools/bench_generate_transformers.py --threads 2 --max_new_tokens 40
"""
import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

p = argparse.ArgumentParser()
p.add_argument("--gguf", default="target/assets/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
p.add_argument("--prompt", default="The movie was")
p.add_argument("--max_new_tokens", type=int, default=40)
p.add_argument("--threads", type=int, default=2)
a = p.parse_args()
torch.set_num_threads(a.threads)
folder, name = a.gguf.rsplit("/", 1)
tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
ids = tok(a.prompt, return_tensors="pt", add_special_tokens=False).input_ids
with torch.no_grad():
    model.generate(ids, max_new_tokens=2, do_sample=False)  # warm-up
    t = time.perf_counter()
    out = model.generate(ids, max_new_tokens=a.max_new_tokens, min_new_tokens=a.max_new_tokens, do_sample=False)
    secs = time.perf_counter() - t
new = out[0, ids.shape[1]:]
print(json.dumps({"bench": "generate_transformers", "threads": a.threads, "tokens": int(new.numel()),
                  "seconds": secs, "tokens_per_s": new.numel() / secs,
                  "continuation": tok.decode(new, skip_special_tokens=True)}))
