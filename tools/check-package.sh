#!/usr/bin/env bash
# Packages the library crates as crates.io would receive them (never publishes): the patched
# candle-core and candle-kernels (`fsdp-candle-core`, `fsdp-candle-kernels`), `fsdp-comm`, `fsdp-nn` and `fsdp`, in one `cargo package` so each
# resolves the others from the packages just made. By default each package is then built from
# its own tarball, as a user would get it (a few minutes); `--no-verify` (what CI runs) stops
# after packaging: manifests, file lists and dependency resolution.
set -euo pipefail
cd "$(dirname "$0")/.."
verify=()
if [[ "${1:-}" == "--no-verify" ]]; then
  verify=(--no-verify)
fi
cargo package --quiet --allow-dirty "${verify[@]}" -p fsdp-candle-kernels -p fsdp-candle-core -p fsdp-comm -p fsdp-nn -p fsdp
ls -1 target/package/fsdp-candle-kernels-*.crate target/package/fsdp-candle-core-*.crate target/package/fsdp-comm-*.crate target/package/fsdp-nn-*.crate target/package/fsdp-[0-9]*.crate
