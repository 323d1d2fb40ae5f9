#!/usr/bin/env bash
# Loads a folder llama_example saved with two transformers versions, 4.57 and 5.24, with
# tools/check_llama_transformers.py (each: weights unchanged, special tokens and RoPE base as
# config.json states them, a greedy continuation from the folder's own tokenizer and
# generation config), and checks that both give the same prompt ids, the same last-position
# logits (within 1e-5, relative to the largest) and the same continuation.
#   tools/check-llama-transformers-versions.sh target/llama_example/model [--expect " ..."]
# Needs a python with torch (FSDP_TORCH_PYTHON, default python3); the two transformers
# versions are installed by pip (idempotently) into target/transformers-4 and
# target/transformers-5 and put first on PYTHONPATH in turn.
set -euo pipefail
cd "$(dirname "$0")/.."
model=$1
shift
py=${FSDP_TORCH_PYTHON:-python3}
"$py" -c "import torch" 2>/dev/null || { echo "error: $py has no torch (set FSDP_TORCH_PYTHON to a python with torch)" >&2; exit 2; }
install() { # dir requirement... (installed again when the list changes)
  local dir=$1
  shift
  local marker
  marker="$dir/.installed-$(printf '%s\n' "$@" | cksum | cut -d' ' -f1)"
  if [ ! -f "$marker" ]; then
    "$py" -m pip install --quiet --no-deps --target "$dir" "$@"
    touch "$marker"
  fi
}
# huggingface_hub 0.x imports requests (1.x and later use httpx): its own dependencies too.
install target/transformers-4 "transformers==4.57.3" "huggingface_hub==0.36.2" "tokenizers==0.22.2" \
  "requests==2.32.5" "urllib3==2.5.0" "idna==3.10" "certifi==2025.8.3" "charset_normalizer==3.4.3"
install target/transformers-5 "transformers==5.24.0" "huggingface_hub==2.4.0" "tokenizers==0.23.3"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for v in 4 5; do
  PYTHONPATH="target/transformers-$v${PYTHONPATH:+:$PYTHONPATH}" "$py" tools/check_llama_transformers.py "$model" "$@" > "$out/$v.json"
done
"$py" - "$out/4.json" "$out/5.json" <<'PY'
import json, sys
a, b = (json.load(open(f)) for f in sys.argv[1:])
for k in ("rope_theta", "special_tokens", "prompt_ids", "continuation"):
    assert a[k] == b[k], f"{k}: transformers {a['transformers']} {a[k]!r}, {b['transformers']} {b[k]!r}"
scale = max(abs(x) for x in a["last_logits"])
worst = max(abs(x - y) for x, y in zip(a["last_logits"], b["last_logits"], strict=True)) / scale
assert worst <= 1e-5, f"last logits differ by {worst:.2e} (relative to the largest)"
print(json.dumps({"versions": [a["transformers"], b["transformers"]], "tokenizers": [a["tokenizer"], b["tokenizer"]],
                  "rope_theta": a["rope_theta"], "prompt_ids": a["prompt_ids"], "logits_max_rel_diff": worst,
                  "continuation": a["continuation"]}))
PY
