"""Python peft loads an fsdp-rs adapter folder by itself: AutoPeftModelForCausalLM finds the
base through the adapter's own base_model_name_or_path, and its logits (before and after
merge_and_unload) are compared with transformers' logits of the merged folder fsdp-rs saved
(max |diff| / max |x|), on token ids of the adapter's tokenizer. Prints one JSON line; exits
non-zero when either differs by more than 1e-5."""

import json
import sys

import peft
import torch
import transformers

adapter_dir, merged_dir = sys.argv[1:3]
tokenizer = transformers.AutoTokenizer.from_pretrained(adapter_dir)
ids = tokenizer(["The film was a quiet delight", "I would not watch it again"], return_tensors="pt", padding=True)

adapted = peft.AutoPeftModelForCausalLM.from_pretrained(adapter_dir, torch_dtype=torch.float32)
adapted.eval()
merged_ours = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, torch_dtype=torch.float32)
merged_ours.eval()

with torch.no_grad():
    want = merged_ours(**ids).logits.reshape(-1)

    def rel(got):
        got = got.reshape(-1).to(torch.float32)
        return float((got - want).abs().max() / want.abs().max())

    with_adapter = rel(adapted(**ids).logits)
    layers = sum(1 for n, _ in adapted.named_modules() if n.endswith(".lora_A"))
    after_merge = rel(adapted.merge_and_unload()(**ids).logits)
report = {
    "peft": peft.__version__,
    "transformers": transformers.__version__,
    "base": adapted.peft_config["default"].base_model_name_or_path,
    "adapted_layers": layers,
    "logits_max_rel_diff": with_adapter,
    "merged_logits_max_rel_diff": after_merge,
}
print(json.dumps(report))
if not (with_adapter <= 1e-5 and after_merge <= 1e-5):
    sys.exit(f"peft's logits differ from the merged model's: {with_adapter:.2e} with the adapter, {after_merge:.2e} merged")
