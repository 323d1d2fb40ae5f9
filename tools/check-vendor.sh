#!/usr/bin/env bash
# Checks that each patched copy under vendor/ is exactly its crates.io package with its patch
# applied, so a copy can never drift from what vendor/README.md says it is:
#   vendor/candle-core    = candle-core 0.11.1 (Cargo.toml, LICENSE, README.md, src/)
#                           + vendor/candle-core.patch
#   vendor/candle-kernels = candle-kernels 0.11.1 (Cargo.toml, README.md, build.rs, and of
#                           src/ the PTX modules' sources: not the GGUF/MoE static library's
#                           moe/, mmq_gguf/, mmvq_gguf.cu, nor ffi.rs, their bindings)
#                           + vendor/candle-kernels.patch
# The packages are fetched by cargo, the ordinary package client (nothing else reaches a
# network).
set -euo pipefail
cd "$(dirname "$0")/.."
version=0.11.1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/fetch/src"
touch "$work/fetch/src/lib.rs"
cat > "$work/fetch/Cargo.toml" <<TOML
[package]
name = "vendor-check"
version = "0.0.0"
edition = "2024"
publish = false

[dependencies]
candle-core = { version = "=$version", default-features = false }
candle-kernels = { version = "=$version", default-features = false }
TOML
(cd "$work/fetch" && cargo fetch --quiet)
status=0
for name in candle-core candle-kernels; do
  crate=$(ls "${CARGO_HOME:-$HOME/.cargo}"/registry/cache/*/"$name-$version.crate" | head -n 1)
  mkdir -p "$work/pristine" "$work/expected/$name"
  tar xzf "$crate" -C "$work/pristine"
  src="$work/pristine/$name-$version"
  expected="$work/expected/$name"
  if [ "$name" = candle-core ]; then
    cp -r "$src/Cargo.toml" "$src/LICENSE" "$src/README.md" "$src/src" "$expected/"
  else
    cp "$src/Cargo.toml" "$src/README.md" "$src/build.rs" "$expected/"
    mkdir "$expected/src"
    for f in "$src"/src/*.cu "$src"/src/*.cuh "$src/src/lib.rs" "$src/src/ptx.rs"; do
      [ "$(basename "$f")" = mmvq_gguf.cu ] || cp "$f" "$expected/src/"
    done
  fi
  patch --quiet -p1 -d "$expected" < "vendor/$name.patch"
  if diff -r "$expected" "vendor/$name"; then
    echo "vendor/$name is $name $version + vendor/$name.patch"
  else
    echo "vendor/$name differs from $name $version + vendor/$name.patch (above)" >&2
    status=1
  fi
done
exit "$status"
