#!/usr/bin/env python3
"""Llama-family reference outputs from transformers, for crates/fsdp/tests/llama.rs: for each
small random config (grouped-query 4:1 and 4:2, multi-head 4:4, tied and untied, Llama's
attention/MLP biases, Qwen2's q/k/v biases, rope_scaling linear and llama3, a head_dim that is
not hidden / heads) the weights, a right-padded batch with its attention mask and labels
(-100 on padding), and the logits, loss and every parameter's gradient in f32 and in f64
(eager attention). Needs torch and transformers (pip):

    python3 tools/make_llama_fixture.py crates/fsdp/tests/data/llama
"""
import contextlib
import json
import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm, Qwen2RotaryEmbedding

COMMON = dict(
    vocab_size=40,
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
    initializer_range=0.2,
    rms_norm_eps=1e-5,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

CASES = {
    "gqa_tied": lambda: LlamaConfig(**COMMON, num_key_value_heads=1, tie_word_embeddings=True),
    "mha_biases_linear_rope": lambda: LlamaConfig(
        **COMMON,
        num_key_value_heads=4,
        tie_word_embeddings=False,
        attention_bias=True,
        mlp_bias=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    ),
    "qwen2": lambda: Qwen2Config(
        **COMMON,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    "llama3_rope_head_dim": lambda: LlamaConfig(
        **COMMON,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8,
        },
    ),
}


@contextlib.contextmanager
def f64_throughout():
    """RMSNorm and softmax in their input's dtype (transformers casts both to f32), and the
    rotary cos/sin of the f32 angles correctly rounded to f32 (what libm's cosf/sinf give
    fsdp-rs; PyTorch's vectorised f32 cos can be an ulp away)."""
    softmax = torch.nn.functional.softmax

    def softmax_in_input_dtype(x, dim=None, _stacklevel=3, dtype=None):
        return softmax(x, dim=dim, dtype=None if x.dtype == torch.float64 else dtype)

    def rms_norm(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon))

    def rotary(self, x, position_ids):
        freqs = (self.inv_freq.float()[None, :, None] @ position_ids[:, None, :].float()).transpose(1, 2)
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.double().cos().float().to(x.dtype), angles.double().sin().float().to(x.dtype)

    patched = [(n, rms_norm) for n in (LlamaRMSNorm, Qwen2RMSNorm)]
    patched += [(r, rotary) for r in (LlamaRotaryEmbedding, Qwen2RotaryEmbedding)]
    saved = [c.forward for c, _ in patched]
    torch.nn.functional.softmax = softmax_in_input_dtype
    for c, f in patched:
        c.forward = f
    try:
        yield
    finally:
        torch.nn.functional.softmax = softmax
        for (c, _), f in zip(patched, saved):
            c.forward = f


def main(out: Path) -> None:
    for name, make in CASES.items():
        case = out / name
        case.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(11)
        config = make()
        config._attn_implementation = "eager"
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
        with torch.no_grad():
            # Norm weights and biases away from their initial ones and zeros, so both are tested.
            for n, p in model.named_parameters():
                if n.endswith("norm.weight"):
                    p.copy_(1 + 0.2 * torch.randn_like(p))
                elif n.endswith(".bias"):
                    p.copy_(0.1 * torch.randn_like(p))
        g = torch.Generator().manual_seed(5)
        input_ids = torch.randint(3, config.vocab_size, (2, 9), generator=g)
        attention_mask = torch.ones_like(input_ids)
        attention_mask[1, 6:] = 0
        input_ids[1, 6:] = config.pad_token_id
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        result = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
        result.loss.backward()
        params = dict(model.named_parameters())
        save_file({n: p.detach().contiguous() for n, p in params.items()}, str(case / "weights.safetensors"))
        expected = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "labels": labels,
            "logits": result.logits.detach().contiguous(),
            "loss": result.loss.detach().reshape(1),
        }
        expected.update({f"grad.{n}": p.grad.contiguous() for n, p in params.items()})
        # The same in f64: the formulas compared without f32's rounding on either side.
        # transformers computes RMSNorm, the attention softmax and the loss in f32 whatever the
        # model's dtype; here they run in f64 too (the rotary angles stay f32, as in both).
        model.zero_grad()
        model.double()
        with f64_throughout():
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, config.vocab_size), labels[:, 1:].reshape(-1), ignore_index=-100
            )
        loss.backward()
        expected["f64.logits"] = logits.detach().contiguous()
        expected["f64.loss"] = loss.detach().reshape(1)
        expected.update({f"f64.grad.{n}": p.grad.contiguous() for n, p in model.named_parameters()})
        save_file(expected, str(case / "expected.safetensors"))
        config.to_json_file(str(case / "config.json"))
        (case / "versions.json").write_text(
            json.dumps({"torch": torch.__version__, "transformers": transformers.__version__}) + "\n"
        )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
