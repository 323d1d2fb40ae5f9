#!/usr/bin/env python3
"""Loads folders written by fsdp::checkpoint::save_pretrained with Hugging Face transformers
(`from_pretrained`, single file and split with an index) and checks that every weight arrives
unchanged and a forward pass runs. Needs `pip install torch transformers safetensors`.

    FSDP_KEEP_PRETRAINED=/tmp/pre cargo test -p fsdp --test checkpoint save_pretrained
    python3 tools/check_pretrained_transformers.py /tmp/pre/one /tmp/pre/split
"""
import json
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification


def main(dirs):
    for d in dirs:
        model, info = AutoModelForSequenceClassification.from_pretrained(d, output_loading_info=True)
        missing, unexpected = info["missing_keys"], info["unexpected_keys"]
        assert not missing and not unexpected, (d, missing, unexpected)
        try:
            index = json.load(open(f"{d}/model.safetensors.index.json"))
            files = sorted(set(index["weight_map"].values()))
        except FileNotFoundError:
            files = ["model.safetensors"]
        saved = {}
        for f in files:
            saved.update(load_file(f"{d}/{f}"))
        state = model.state_dict()
        for name, t in saved.items():
            assert torch.equal(state[name], t), name
        model.eval()
        with torch.no_grad():
            logits = model(torch.tensor([[1, 5, 7, 2]])).logits
        print(f"{d}: {type(model).__name__}, {len(saved)} tensors in {len(files)} file(s) "
              f"loaded unchanged; logits {logits.tolist()}")


if __name__ == "__main__":
    main(sys.argv[1:])
