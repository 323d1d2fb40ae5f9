"""Python peft reads an fsdp-rs adapter: logits of PeftModel.from_pretrained(base, adapter)
and of its merge_and_unload() against the ones fsdp-rs computed (max |diff| / max |x|).
Prints one JSON line; exits non-zero when either differs by more than 1e-5."""

import json
import sys

import peft
import torch
import transformers

base_dir, adapter_dir, expected_path = sys.argv[1:4]
expected = json.load(open(expected_path))
ids = torch.tensor(expected["ids"], dtype=torch.long)
want = torch.tensor(expected["logits"], dtype=torch.float32).reshape(-1)

model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
model.eval()
adapted = peft.PeftModel.from_pretrained(model, adapter_dir)
adapted.eval()


def rel(got):
    got = got.reshape(-1).to(torch.float32)
    return float((got - want).abs().max() / want.abs().max())


with torch.no_grad():
    with_adapter = rel(adapted(input_ids=ids).logits)
    layers = sum(1 for n, _ in adapted.named_modules() if n.endswith(".lora_A"))
    merged = adapted.merge_and_unload()
    after_merge = rel(merged(input_ids=ids).logits)
report = {
    "peft": peft.__version__,
    "transformers": transformers.__version__,
    "adapted_layers": layers,
    "logits_max_rel_diff": with_adapter,
    "merged_logits_max_rel_diff": after_merge,
}
print(json.dumps(report))
if not (with_adapter <= 1e-5 and after_merge <= 1e-5):
    sys.exit(f"peft's logits differ from fsdp-rs's: {with_adapter:.2e} with the adapter, {after_merge:.2e} merged")
