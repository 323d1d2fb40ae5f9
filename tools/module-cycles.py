#!/usr/bin/env python3
"""Lists import circles between the source files of each crate in crates/, and between its
top-level modules (a file counted as the module under src/ it belongs to: `quant/mod.rs` and
`quant/format.rs` are `quant`), where two modules can import each other through files
that do not.

A file depends on another when it names an item through it: `use crate::a::b::X`,
`crate::a::b::f()`, `super::b::X`, also inside `use` groups. A path resolves to the deepest
module file that exists. Edges between a module and its own ancestors or descendants (a
`mod.rs` re-exporting its children, a child using its parent's items) are the module tree,
not a circle, and are left out. Prints each strongly connected component of more than one
file with one cycle through it; exits 1 when there is any.
Usage: tools/module-cycles.py [CRATE_SRC_DIR ...]   (default: every crates/*/src)
       tools/module-cycles.py --self-test           (the checker on a crate made for it)
"""
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def module_files(src):
    """module path (tuple) -> file, for every .rs file under src."""
    mods = {}
    for f in src.rglob("*.rs"):
        rel = f.relative_to(src).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "mod" or (len(parts) == 1 and parts[0] in ("lib", "main")):
            parts = parts[:-1]
        mods[tuple(parts)] = f
    return mods


def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def expand_use(tree):
    """`a::{b, c::{d, e}}` -> ['a::b', 'a::c::d', 'a::c::e']."""
    tree = re.sub(r"\s+", "", tree)
    out = []

    def walk(prefix, s):
        depth, start, items = 0, 0, []
        for i, ch in enumerate(s):
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
            elif ch == "," and depth == 0:
                items.append(s[start:i])
                start = i + 1
        items.append(s[start:])
        for item in items:
            if not item:
                continue
            b = item.find("{")
            if b >= 0 and item.endswith("}"):
                walk(prefix + item[:b], item[b + 1 : -1])
            else:
                out.append(prefix + item.split(" as ")[0])

    walk("", tree)
    return out


def paths_in(text):
    text = strip_comments(text)
    paths = []
    for m in re.finditer(r"\buse\s+([^;]+);", text):
        paths += expand_use(m.group(1))
    paths += re.findall(r"\b((?:crate|super|self)(?:::(?:super|[A-Za-z_][A-Za-z0-9_]*))+)", text)
    return paths


def resolve(module, path, mods):
    parts = path.split("::")
    if parts[0] == "crate":
        base, rest = [], parts[1:]
    elif parts[0] in ("super", "self"):
        base = list(module)
        rest = parts
        while rest and rest[0] in ("super", "self"):
            if rest[0] == "super":
                base = base[:-1]
            rest = rest[1:]
    else:
        return None
    full = base + rest
    for n in range(len(full), -1, -1):
        if tuple(full[:n]) in mods:
            return tuple(full[:n])
    return None


def related(a, b):
    n = min(len(a), len(b))
    return a[:n] == b[:n]


def cycles(src, level="files"):
    """Circles between files, or with `level="modules"` between top-level modules."""
    files = module_files(src)
    key = (lambda m: m) if level == "files" else (lambda m: m[:1])
    mods = {key(m): f for m, f in sorted(files.items(), reverse=True) if key(m)}
    edges = {m: set() for m in mods}
    for m, f in files.items():
        for p in paths_in(f.read_text()):
            t = resolve(m, p, files)
            if t is None or t == m or related(m, t):
                continue
            a, b = key(m), key(t)
            if a and b and a != b:
                edges[a].add(b)
    # Tarjan's strongly connected components.
    index, low, stack, on, comps = {}, {}, [], set(), []
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)

    for v in sorted(mods):
        if v not in index:
            visit(v)
    found = []
    for comp in comps:
        members = set(comp)
        start = min(comp)
        # A shortest cycle through start inside the component (breadth first).
        prev, frontier, cycle = {start: None}, [start], None
        while frontier and cycle is None:
            nxt = []
            for v in frontier:
                for w in sorted(edges[v] & members):
                    if w == start:
                        cycle = [v]
                        break
                    if w not in prev:
                        prev[w] = v
                        nxt.append(w)
                if cycle:
                    break
            frontier = nxt
        path = []
        v = cycle[0]
        while v is not None:
            path.append(v)
            v = prev[v]
        path.reverse()
        name = (lambda m: str(mods[m].relative_to(src))) if level == "files" else (lambda m: m[0] + "/")
        found.append((sorted(name(m) for m in comp), [name(m) for m in path + [start]]))
    return found


def self_test():
    """The checker on a crate made for it: a circle through a `use` group and a `super::`
    path is found, a module tree (mod.rs and its children using each other) is not."""
    import tempfile

    files = {
        "lib.rs": "mod a;\nmod b;\nmod tree;\n",
        "a.rs": "use crate::{b::Thing, tree};\npub struct Other;\n",
        "b.rs": "pub struct Thing;\nfn f() -> super::a::Other { todo!() }\n",
        "tree/mod.rs": "mod leaf;\npub use leaf::Leaf;\n",
        "tree/leaf.rs": "pub struct Leaf(super::Leaf2);\n// crate::a::Other in a comment\n",
        # Modules m and n import each other through different files: no file circle.
        "m/mod.rs": "mod x;\nmod w;\n",
        "m/x.rs": "use crate::n::y::Y;\n",
        "m/w.rs": "pub struct W;\n",
        "n/mod.rs": "pub mod y;\nmod z;\n",
        "n/y.rs": "pub struct Y;\n",
        "n/z.rs": "use crate::m::w::W;\n",
    }
    with tempfile.TemporaryDirectory() as d:
        src = Path(d)
        for name, text in files.items():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            (src / name).write_text(text)
        found = cycles(src)
        by_module = cycles(src, "modules")
    assert [members for members, _ in found] == [["a.rs", "b.rs"]], found
    assert [members for members, _ in by_module] == [["a/", "b/"], ["m/", "n/"]], by_module
    print("module-cycles self-test: ok")
    return 0


def main():
    if sys.argv[1:] == ["--self-test"]:
        return self_test()
    srcs = [Path(a) for a in sys.argv[1:]] or sorted(ROOT.glob("crates/*/src"))
    total = 0
    for src in srcs:
        for level in ("files", "modules"):
            for members, cycle in cycles(src, level):
                total += 1
                print(f"{src}: circle of {len(members)} {level}: {' -> '.join(cycle)}")
    print(f"{total} import circle(s)")
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
