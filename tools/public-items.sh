#!/usr/bin/env bash
# Counts the public items of the library crates as rustdoc documents them: one page per
# struct, enum, trait, function, type alias, constant, static, macro and module (methods and
# fields not counted), per top-level module. The figure issue 54's public-surface work is
# measured by: `tools/public-items.sh [TARGET_DIR]` prints one JSON line per crate.
set -euo pipefail
cd "$(dirname "$0")/.."
target=${1:-target}
for crate in fsdp fsdp-nn fsdp-comm; do
    CARGO_TARGET_DIR=$target cargo doc -q -p "$crate" --no-deps --all-features 2>/dev/null
    lib=${crate//-/_}
    [ "$crate" = fsdp-nn ] && lib=fsdp_nn
    python3 - "$target/doc/$lib" "$crate" <<'PY'
import json, os, sys
root, crate = sys.argv[1], sys.argv[2]
kinds = ("struct.", "enum.", "trait.", "fn.", "type.", "constant.", "static.", "macro.", "union.")
per_module, total = {}, 0
for folder, _, files in os.walk(root):
    rel = os.path.relpath(folder, root)
    top = "(root)" if rel == "." else rel.split(os.sep)[0]
    for f in files:
        if not (f.endswith(".html") and (f.startswith(kinds) or (f == "index.html" and rel != "."))):
            continue
        with open(os.path.join(folder, f), errors="replace") as page:
            if "Redirecting to" in page.read(2000):
                continue  # a redirect rustdoc leaves for another path to the same item
        if True:
            per_module[top] = per_module.get(top, 0) + 1
            total += 1
print(json.dumps({"crate": crate, "public_items": total, "per_module": dict(sorted(per_module.items()))}))
PY
done
