#!/usr/bin/env python3
"""The `Tensor` methods tch-rs's public examples call, as data (`docs/tch-example-methods.csv`),
and whether `toma::lazy` records each.

    scripts/tch-methods.py                      # check: the `lazy` column matches src/lazy
    scripts/tch-methods.py --write              # rewrite the `lazy` column from src/lazy
    scripts/tch-methods.py --extract TCH_RS     # re-read the examples of a tch-rs checkout

The examples themselves are not in this repository: only the method names, how often and where
they are called (read from tch-rs at the commit in the file's header). A method is `lazy` when
`LazyTensor` has it (`fn name` or `fn f_name` under src/lazy), `eager` when it is not a graph op
by nature (the reason is in `EAGER`), else `missing`.
"""
import collections
import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
DATA = os.path.join(ROOT, "docs", "tch-example-methods.csv")

# Not ops of a recorded graph: what they are instead.
EAGER = {
    "get": "indexes a Vec or a module list, not a tensor op",
    "clone": "Rust's clone (a lazy tensor's is `shallow_clone`)",
    "to_string": "prints a value: computes it",
    "print": "prints a value: computes it",
    "double_value": "reads a value: `f64::try_from(&lazy)` computes it",
    "backward": "the step itself: `LazyTensor::backward`",
    "grad": "reads a parameter's gradient after the step",
    "zero_grad": "optimizer / parameter state between steps",
    "copy_": "in place on a parameter or buffer, outside the step",
    "f_copy_": "in place on a parameter or buffer, outside the step",
    "set_requires_grad": "marks a parameter, outside the step",
    "index_add_": "in place on a buffer (an optimizer's state)",
    "addcmul_": "in place on an optimizer's state",
    "addcdiv_": "in place on an optimizer's state",
    "triu_": "in place on a constant mask, built before the step",
    "view_": "in place on a constant, built before the step",
    "set": "sets a variable, outside the step",
    "data": "a parameter's data, outside the step",
    "as_ptr": "a raw pointer",
    "is_sparse": "a sparse-tensor query (sparse tensors are not planned)",
    "coalesce": "sparse tensors are not planned",
    "indices": "sparse tensors are not planned",
    "values": "sparse tensors are not planned",
    "to_sparse_sparse_dim": "sparse tensors are not planned",
    "multinomial": "sampling at generation time: data-dependent, run eagerly",
    "random_batch": "draws a batch from a dataset, before the step",
    "Tensor::zeros": "builds an input or constant (then `lazy(..)` or `TensorOps::constant`)",
    "Tensor::ones": "builds an input or constant",
    "Tensor::randn": "builds an input or constant",
    "Tensor::randint": "builds an input or constant",
    "Tensor::rand": "builds an input or constant",
    "Tensor::randn_like": "builds an input or constant",
    "Tensor::from_slice": "builds an input or constant",
    "device": "a query, the same on both",
    "kind": "a query, the same on both",
    "size": "a query, the same on both",
    "any": "reads a boolean: data-dependent",
    "take": "indexes a Vec (iterator adaptor), not a tensor op",
}


def tch_methods(tch):
    """Names of tch's `Tensor` methods (taking self) and its associated functions."""
    methods, statics = set(), set()
    for rel in ("src/wrappers/tensor_generated.rs", "src/wrappers/tensor.rs", "src/tensor/mod.rs", "src/tensor/index.rs"):
        with open(os.path.join(tch, rel)) as f:
            s = f.read()
        for m in re.finditer(r"pub fn ([a-z_0-9]+)(?:<[^>]*>)?\(([^)]*)\)", s, re.S):
            first = m.group(2).split(",")[0]
            (methods if "self" in first else statics).add(m.group(1))
    return methods, statics


def extract(tch):
    methods, statics = tch_methods(tch)
    uses = collections.defaultdict(collections.Counter)
    for root, _, files in os.walk(os.path.join(tch, "examples")):
        for name in files:
            if not name.endswith(".rs"):
                continue
            path = os.path.join(root, name)
            rel = os.path.relpath(path, tch)
            with open(path) as f:
                src = re.sub(r"//[^\n]*", "", f.read())
            for m in re.finditer(r"\.([a-z_][a-z_0-9]*)\s*(?:::<[^>]*>)?\(", src):
                if m.group(1) in methods:
                    uses[m.group(1)][rel] += 1
            for m in re.finditer(r"Tensor::([a-z_][a-z_0-9]*)\s*(?:::<[^>]*>)?\(", src):
                if m.group(1) in statics or m.group(1) in methods:
                    uses["Tensor::" + m.group(1)][rel] += 1
    commit = os.popen(f"git -C {tch} rev-parse HEAD 2>/dev/null").read().strip() or "unknown"
    rows = []
    for name in sorted(uses, key=lambda k: (-sum(uses[k].values()), k)):
        files = " ".join(sorted(uses[name]))
        rows.append([name, str(sum(uses[name].values())), files, ""])
    return commit, rows


def lazy_names():
    names = set()
    for root, _, files in os.walk(os.path.join(ROOT, "src", "lazy")):
        for name in files:
            if name.endswith(".rs"):
                with open(os.path.join(root, name)) as f:
                    for m in re.finditer(r"\bfn (?:f_)?([a-z_0-9]+)\s*[<(]", f.read()):
                        names.add(m.group(1))
    return names


def status(name, have):
    if name in EAGER:
        return "eager: " + EAGER[name]
    bare = name.split("::")[-1]
    return "lazy" if bare in have else "missing"


def read():
    with open(DATA) as f:
        lines = f.read().splitlines()
    header = [l for l in lines if l.startswith("#")]
    rows = [l.split("\t") for l in lines if l and not l.startswith("#")][1:]
    return header, rows


def write(header, rows):
    with open(DATA, "w") as f:
        f.write("\n".join(header) + "\n")
        f.write("method\tcalls\tfiles\tlazy\n")
        for r in rows:
            f.write("\t".join(r) + "\n")


def main():
    args = sys.argv[1:]
    have = lazy_names()
    if args[:1] == ["--extract"]:
        commit, rows = extract(args[1])
        for r in rows:
            r[3] = status(r[0], have)
        header = [
            f"# Tensor methods called in tch-rs's examples/ (github.com/LaurentMazare/tch-rs at {commit}),",
            "# tab-separated; regenerate with scripts/tch-methods.py (its docstring says how).",
        ]
        write(header, rows)
        return 0
    header, rows = read()
    stale = [(r[0], r[3], status(r[0], have)) for r in rows if r[3] != status(r[0], have)]
    if "--write" in args:
        for r in rows:
            r[3] = status(r[0], have)
        write(header, rows)
        return 0
    if stale:
        for name, was, now in stale:
            print(f"tch-methods: {name}: the data says `{was}`, the code says `{now}`")
        print("tch-methods: regenerate with scripts/tch-methods.py --write")
        return 1
    counts = collections.Counter(r[3].split(":")[0] for r in rows)
    print(f"tch-methods: {len(rows)} methods in tch-rs's examples: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
