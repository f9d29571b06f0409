#!/usr/bin/env python3
"""Finds import cycles between the modules of each crate in the workspace.

A module is a file under a crate's src/ (foo.rs and foo/mod.rs are module
`foo`). Module A imports module B when A's file names B by path: `crate::b`,
`super::b`, `self::b` or, from a parent, a child `b::` declared with `mod b`.
A cycle is a set of modules that import one another in a ring (A -> B -> A,
or longer). A parent declaring `mod child;` is not an import; a child using
its parent's items is one, so a parent must not use its child back.

Prints each crate's module map (module: what it imports) with --map, and
every cycle found. Exits 1 if there is one.

    python3 ci/import-cycles.py [--map] [crate_dir ...]
"""
import os
import re
import sys

PATH = re.compile(r"\b(crate|super|self)((?:::[A-Za-z_][A-Za-z0-9_]*)+)")
MOD_DECL = re.compile(r"^\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+([A-Za-z_][A-Za-z0-9_]*)\s*;", re.M)
COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


def modules(src):
    """Maps module path (tuple) -> file, for every .rs file under src."""
    out = {}
    for root, _, files in os.walk(src):
        for f in files:
            if not f.endswith(".rs"):
                continue
            full = os.path.join(root, f)
            rel = os.path.relpath(full, src)[:-3].split(os.sep)
            if rel[-1] in ("mod", "lib", "main"):
                rel = rel[:-1]
            if rel and rel[0] == "bin":
                continue
            out[tuple(rel)] = full
    return out


def resolve(mods, here, kind, parts):
    """The module a path starting at `here` names (the longest known prefix)."""
    if kind == "crate":
        base = []
    elif kind == "self":
        base = list(here)
    else:
        base = list(here)
        for p in parts:
            if p != "super":
                break
            base = base[:-1]
        parts = [p for p in parts if p != "super"]
        base = base[:-1]
    best = None
    cur = list(base)
    for p in parts:
        cur.append(p)
        if tuple(cur) in mods:
            best = tuple(cur)
    return best


def imports(mods):
    graph = {m: set() for m in mods}
    for m, f in mods.items():
        text = COMMENT.sub("", open(f, encoding="utf-8").read())
        children = {m + (c,) for c in MOD_DECL.findall(text)}
        for kind, rest in PATH.findall(text):
            parts = [p for p in rest.split("::") if p]
            target = resolve(mods, m, kind, parts)
            if target is None or target == m:
                continue
            # A module reaching into itself or its own descendants is no import.
            if target[: len(m)] == m and len(target) > len(m):
                continue
            graph[m].add(target)
        # `use child::x` from a parent: allowed (a parent may use its children);
        # it matters only if the child imports the parent back, which the
        # `super::` paths above record.
        for c in children:
            if c in mods and re.search(r"\b" + re.escape(c[-1]) + r"::", text):
                graph[m].add(c)
    return graph


def cycles(graph):
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
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
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def name(m):
    return "::".join(m) or "(root)"


def main():
    args = sys.argv[1:]
    show = "--map" in args
    crates = [a for a in args if a != "--map"] or ["."] + sorted(
        d for d in ("transport", "engine", "gpu", "cli", "bench") if os.path.isdir(d)
    )
    bad = 0
    for c in crates:
        src = os.path.join(c, "src")
        mods = modules(src)
        graph = imports(mods)
        found = cycles(graph)
        label = os.path.basename(os.path.abspath(c))
        if show:
            print(f"{label}:")
            for m in sorted(graph):
                deps = ", ".join(name(d) for d in sorted(graph[m])) or "-"
                print(f"  {name(m):<28} -> {deps}")
        for comp in found:
            bad += 1
            print(f"{label}: import cycle between " + ", ".join(name(m) for m in comp))
        print(f"{label}: {len(mods)} modules, {len(found)} import cycles")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
