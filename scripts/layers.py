#!/usr/bin/env python3
"""The import graph of `src/`, one node per module file: its cycles and its layers.

Reads every `use` tree and every inline `crate::`/`super::`/`self::` path, resolves re-exports
(`pub use` in a parent module points at the module that defines the item) and ignores
`#[cfg(test)]` modules, whose imports do not shape the layers. Exits 1 when modules import each
other in a cycle, or when a module imports from a layer above its own (`LAYERS`), printing
what it found.

    scripts/layers.py              # check: no cycle
    scripts/layers.py --edges      # also print every edge, "from -> to"
    scripts/layers.py --dot        # the graph in Graphviz's language
"""
import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")

# The layers, lowest first (ARCHITECTURE.md): a module may import from its own layer and the
# layers below, never from one above. A name covers the module and its submodules; the crate
# root and `lazy`'s mod.rs are facades (declarations and re-exports) and stand outside.
LAYERS = [
    ["hash", "dims", "error", "policy", "svg", "progress"],
    ["memory"],
    ["autocast"],
    ["oom"],
    ["cache"],
    ["dist"],
    ["retry"],
    ["execute"],
    ["lazy::error", "lazy::phase", "lazy::unplaced", "lazy::shape", "lazy::int_list", "lazy::options", "lazy::tch_compat", "lazy::facts", "lazy::size"],
    ["lazy::graph"],
    ["lazy::ops"],
    ["lazy::cost"],
    ["lazy::plan"],
    ["lazy::exec"],
    ["lazy::tensor", "lazy::nn", "lazy::rnn", "lazy::optim", "lazy::scaler", "lazy::index", "lazy::tensor_ops", "lazy::wrap"],
    ["lazy::vision", "lazy::models"],
]


def module_files():
    """Module path (tuple) -> file, for every .rs file under src/."""
    mods = {}
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if not f.endswith(".rs"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, f), ROOT)
            parts = rel[:-3].split(os.sep)
            if parts[-1] in ("mod", "lib"):
                parts = parts[:-1]
            mods[tuple(parts)] = os.path.join(dirpath, f)
    return mods


def strip(text):
    """Source without comments, strings, char literals and `#[cfg(test)]` modules."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    i += 1
        elif c == "r" and re.match(r'r#*"', text[i:i + 10]) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            hashes = re.match(r"r(#*)\"", text[i:]).group(1)
            end = text.find('"' + hashes, i + 2 + len(hashes))
            out.append('""')
            i = n if end < 0 else end + 1 + len(hashes)
        elif c == '"':
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
            out.append('""')
            i += 1
        elif c == "'" and re.match(r"'(\\.|[^\\'])'", text[i:i + 4]):
            m = re.match(r"'(\\.|[^\\'])'", text[i:i + 4])
            out.append("' '")
            i += len(m.group(0))
        else:
            out.append(c)
            i += 1
    code = "".join(out)
    # Visibility paths (`pub(in crate::memory)`) name no dependency.
    code = re.sub(r"pub\(in [^)]*\)", "pub", code)
    # Drop `#[cfg(test)] mod name { ... }` blocks.
    while True:
        m = re.search(r"#\[cfg\((all\()?test[^\]]*\)\]\s*(pub(\([^)]*\))?\s+)?mod\s+\w+\s*\{", code)
        if not m:
            break
        code = code[:m.start()] + code[block_end(code, m.end()):]
    # Inside an inline `mod name { ... }`, `super` is the file's own module.
    pos = 0
    while True:
        m = re.compile(r"\bmod\s+\w+\s*\{").search(code, pos)
        if not m:
            return code
        end = block_end(code, m.end())
        code = code[:m.end()] + re.sub(r"\bsuper\s*::", "self::", code[m.end():end]) + code[end:]
        pos = m.end()


def block_end(code, j):
    """The position just past the `}` closing the block whose `{` ends before `j`."""
    depth = 1
    while j < len(code) and depth:
        depth += {"{": 1, "}": -1}.get(code[j], 0)
        j += 1
    return j


def use_paths(tree, prefix=()):
    """Expands a `use` tree (`a::{b, c::{d as e}}`) into (path, visible name) pairs."""
    tree = tree.strip()
    # Split at the first top-level `{`.
    depth = 0
    for k, ch in enumerate(tree):
        if ch == "{" and depth == 0:
            head = [p for p in tree[:k].strip().rstrip(":").split("::") if p]
            inner = tree[k + 1:tree.rfind("}")]
            parts, depth2, start = [], 0, 0
            for q, ch2 in enumerate(inner):
                if ch2 == "{":
                    depth2 += 1
                elif ch2 == "}":
                    depth2 -= 1
                elif ch2 == "," and depth2 == 0:
                    parts.append(inner[start:q])
                    start = q + 1
            parts.append(inner[start:])
            result = []
            for p in parts:
                if p.strip():
                    result += use_paths(p, prefix + tuple(head))
            return result
        if ch == "{":
            depth += 1
    alias = None
    m = re.match(r"(.*?)\s+as\s+(\w+)$", tree)
    if m:
        tree, alias = m.group(1), m.group(2)
    path = prefix + tuple(p for p in tree.split("::") if p)
    if not path:
        return []
    if path[-1] == "self":
        path = path[:-1]
    name = alias or (path[-1] if path else None)
    return [(path, name)]


def absolute(path, module, is_dir_module):
    """`path` as seen from `module`, made absolute (a tuple from the crate root), or None."""
    if not path:
        return None
    head, rest = path[0], list(path[1:])
    if head in ("crate", "$crate"):
        base = ()
    elif head == "self":
        base = module
    elif head == "super":
        base = module[:-1]
        while rest and rest[0] == "super":
            base, rest = base[:-1], rest[1:]
    else:
        return None  # an external crate, or a name in scope
    return base + tuple(rest)


def main():
    mods = module_files()
    codes = {m: strip(open(f, encoding="utf-8").read()) for m, f in mods.items()}
    # Re-exports: (module, name) -> absolute path of what it names.
    reexports = {}
    uses = {}
    for m, code in codes.items():
        found = []
        for um in re.finditer(r"(pub(\([^)]*\))?\s+)?use\s+([^;]+);", code):
            public = um.group(1) is not None
            for path, name in use_paths(um.group(3)):
                target = absolute(path, m, True)
                if target is None and path[0] not in ("std", "core", "alloc", "tch", "crate", "super", "self"):
                    # `use family::Item;` after `mod family;`: a child module's item.
                    if (m + (path[0],)) in mods:
                        target = m + tuple(path)
                if target is None:
                    continue
                # A re-export is an alias: paths through it resolve to its source. A module
                # re-exporting its own descendants is their facade; re-exporting any other
                # module's item is a use of that module.
                if public and name and name != "*":
                    reexports[(m, name)] = target
                if not (public and target[:len(m)] == m):
                    found.append(target)
        # Inline paths, outside `use` statements (already read above).
        body = re.sub(r"(pub(\([^)]*\))?\s+)?use\s+[^;]+;", ";", code)
        for pm in re.finditer(r"(?<![\w:])(\$?crate|super|self)((?:\s*::\s*\w+)+)", body):
            path = (pm.group(1),) + tuple(s.strip() for s in pm.group(2).split("::") if s.strip())
            target = absolute(path, m, True)
            if target is not None:
                found.append(target)
        # Paths through a child module declared here (`record::leaf`, `ops::Op`).
        for pm in re.finditer(r"(?<![\w:])(\w+)((?:\s*::\s*\w+)+)", body):
            head = pm.group(1)
            if head in ("crate", "super", "self", "std", "core", "tch"):
                continue
            if (m + (head,)) in mods:
                found.append(m + (head,) + tuple(s.strip() for s in pm.group(2).split("::") if s.strip()))
        uses[m] = found

    def resolve(target, seen=()):
        """The module that defines what `target` names."""
        for k in range(len(target), -1, -1):
            module = target[:k]
            if module in mods:
                if k < len(target):
                    key = (module, target[k])
                    if key in reexports and key not in seen:
                        return resolve(reexports[key] + target[k + 1:], seen + (key,))
                return module
        return None

    edges = {m: set() for m in mods}
    for m, targets in uses.items():
        for t in targets:
            r = resolve(t)
            if r is None or r == m:
                continue
            # A parent naming its own child module (`mod x;`, `x::Item`) is containment when
            # the item is a re-export; a real use otherwise. Either way it is a dependency on
            # the child, which is fine; a child on its parent is a dependency too.
            edges[m].add(r)

    name = lambda m: "::".join(("crate",) + m)
    if "--edges" in sys.argv:
        for m in sorted(edges):
            for t in sorted(edges[m]):
                print(f"{name(m)} -> {name(t)}")
    if "--dot" in sys.argv:
        print("digraph toma {")
        for m in sorted(edges):
            for t in sorted(edges[m]):
                print(f'  "{name(m)}" -> "{name(t)}";')
        print("}")

    # Tarjan's strongly connected components.
    index, low, stack, on, sccs, counter = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
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
                sccs.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    total = sum(len(e) for e in edges.values())

    def layer(m):
        path = "::".join(m)
        for k, names in enumerate(LAYERS):
            if any(path == n or path.startswith(n + "::") for n in names):
                return k
        return None

    upward = []
    for m in sorted(edges):
        for t in sorted(edges[m]):
            lm, lt = layer(m), layer(t)
            if lm is not None and lt is not None and lt > lm:
                upward.append(f"  {name(m)} -> {name(t)} (layer {lm} imports layer {lt})")
    if upward:
        print("imports from a layer above (scripts/layers.py's LAYERS):", file=sys.stderr)
        print("\n".join(upward), file=sys.stderr)
    if sccs:
        print(f"import cycles among {sum(map(len, sccs))} of {len(mods)} modules:", file=sys.stderr)
        for comp in sccs:
            members = set(comp)
            print("  " + ", ".join(name(m) for m in comp), file=sys.stderr)
            for m in comp:
                for t in sorted(edges[m] & members):
                    print(f"      {name(m)} -> {name(t)}", file=sys.stderr)
    if sccs or upward:
        sys.exit(1)
    print(f"layers: {len(mods)} modules, {total} imports, no cycle, none upward")


if __name__ == "__main__":
    main()
