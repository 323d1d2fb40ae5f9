#!/usr/bin/env bash
# Checks that vendor/candle-core is exactly the crates.io package candle-core 0.11.1
# (its Cargo.toml, LICENSE, README.md and src/) with vendor/candle-core.patch applied, so the
# patched copy can never drift from what vendor/README.md says it is. The package is fetched
# by cargo, the ordinary package client (nothing else reaches a network).
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
TOML
(cd "$work/fetch" && cargo fetch --quiet)
crate=$(ls "${CARGO_HOME:-$HOME/.cargo}"/registry/cache/*/"candle-core-$version.crate" | head -n 1)
mkdir "$work/pristine" "$work/expected"
tar xzf "$crate" -C "$work/pristine"
src="$work/pristine/candle-core-$version"
cp -r "$src/Cargo.toml" "$src/LICENSE" "$src/README.md" "$src/src" "$work/expected/"
patch --quiet -p1 -d "$work/expected" < vendor/candle-core.patch
if ! diff -r "$work/expected" vendor/candle-core; then
  echo "vendor/candle-core differs from candle-core $version + vendor/candle-core.patch (above)" >&2
  exit 1
fi
echo "vendor/candle-core is candle-core $version + vendor/candle-core.patch"
