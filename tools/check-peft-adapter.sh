#!/usr/bin/env bash
# Loads an adapter folder fsdp-rs saved (adapter_config.json, adapter_model.safetensors) with
# Python peft onto transformers' model of BASE_DIR and checks its logits on the given ids
# against fsdp-rs's, before and after peft's merge_and_unload (tools/check_peft_adapter.py).
#   tools/check-peft-adapter.sh BASE_DIR ADAPTER_DIR EXPECTED_JSON   # {"ids": [[...]], "logits": [...]}
# or, as a user would load it: AutoPeftModelForCausalLM.from_pretrained(ADAPTER_DIR), its base
# found by the adapter's own base_model_name_or_path, against transformers' logits of the
# merged folder fsdp-rs saved beside it (tools/check_peft_auto.py):
#   tools/check-peft-adapter.sh ADAPTER_DIR MERGED_DIR
# Needs a python with torch and transformers (FSDP_TORCH_PYTHON, default python3); peft is
# installed by pip (idempotently) into target/peft and put first on PYTHONPATH.
set -euo pipefail
tools=$(cd "$(dirname "$0")" && pwd)
# Paths given relative to where it was called from still name the same folders below.
args=()
for a in "$@"; do args+=("$(realpath -m -- "$a")"); done
cd "$tools/.."
py=${FSDP_TORCH_PYTHON:-python3}
"$py" -c "import torch, transformers" 2>/dev/null || { echo "error: $py lacks torch or transformers (set FSDP_TORCH_PYTHON)" >&2; exit 2; }
if [ ! -f target/peft/.installed ]; then
  "$py" -m pip install --quiet --no-deps --target target/peft "peft==0.21.2"
  touch target/peft/.installed
fi
script=tools/check_peft_adapter.py
[ "${#args[@]}" -eq 2 ] && script=tools/check_peft_auto.py
PYTHONPATH="$PWD/target/peft${PYTHONPATH:+:$PYTHONPATH}" "$py" "$script" "${args[@]}"
