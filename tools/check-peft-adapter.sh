#!/usr/bin/env bash
# Loads an adapter folder fsdp-rs saved (adapter_config.json, adapter_model.safetensors) with
# Python peft onto transformers' model of BASE_DIR and checks its logits on the given ids
# against fsdp-rs's, before and after peft's merge_and_unload (tools/check_peft_adapter.py).
#   tools/check-peft-adapter.sh BASE_DIR ADAPTER_DIR EXPECTED_JSON   # {"ids": [[...]], "logits": [...]}
# Needs a python with torch and transformers (FSDP_TORCH_PYTHON, default python3); peft is
# installed by pip (idempotently) into target/peft and put first on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${FSDP_TORCH_PYTHON:-python3}
"$py" -c "import torch, transformers" 2>/dev/null || { echo "error: $py lacks torch or transformers (set FSDP_TORCH_PYTHON)" >&2; exit 2; }
if [ ! -f target/peft/.installed ]; then
  "$py" -m pip install --quiet --no-deps --target target/peft "peft==0.21.2"
  touch target/peft/.installed
fi
PYTHONPATH="target/peft${PYTHONPATH:+:$PYTHONPATH}" "$py" tools/check_peft_adapter.py "$@"
