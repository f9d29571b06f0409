#!/usr/bin/env python3
"""Finds import cycles between the modules of each crate in the workspace.

A module is a file under a crate's src/ (foo.rs and foo/mod.rs are module
`foo`). Module A imports module B when A's file names B by path: `crate::b`,
`super::b`, `self::b` or, from a parent, a child `b::` declared with `mod b`.
A cycle is a set of modules that import one another in a ring (A -> B -> A,
or longer). A parent declaring `mod child;` is not an import, nor is a
re-export (`pub use child::Item;`): a facade depends on nothing. A child
using its parent's own items is an import, so then the parent must not use
that child back.

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
# A re-export (`pub use a::b;`, possibly over several lines) is an export, not an import:
# a facade that lists its children's items depends on nothing.
REEXPORT = re.compile(r"^\s*pub(?:\([^)]*\))?\s+use\b[^;]*;", re.M | re.S)


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


REEXPORTS = {}


USE = re.compile(r"^\s*use\b[^;]*;", re.M | re.S)


def use_items(stmt):
    """(kind, path, alias) for every item a `use` or `pub use` statement names."""
    body = re.sub(r"^\s*(pub(\([^)]*\))?\s+)?use\s+", "", stmt).rstrip().rstrip(";")
    out = []

    def walk(prefix, body):
        body = body.strip()
        if not body:
            return
        if body.startswith("{") or ("{" in body and body.rstrip().endswith("}")):
            head, rest = body.split("{", 1) if not body.startswith("{") else ("", body[1:])
            rest = rest.rsplit("}", 1)[0]
            depth, cur, items = 0, "", []
            for ch in rest:
                if ch == "{":
                    depth += 1
                elif ch == "}":
                    depth -= 1
                if ch == "," and depth == 0:
                    items.append(cur)
                    cur = ""
                else:
                    cur += ch
            items.append(cur)
            for it in items:
                walk(prefix + re.sub(r"\s+", "", head), it)
            return
        parts = re.split(r"\s+as\s+", body)
        full = prefix + re.sub(r"\s+", "", parts[0])
        segs = [x for x in full.split("::") if x]
        if not segs or segs[-1] == "*":
            segs = segs[:-1]
        if not segs:
            return
        alias = parts[1].strip() if len(parts) > 1 else segs[-1]
        if segs[0] in ("crate", "self", "super"):
            kind, path = segs[0], segs[1:]
            if kind == "self" and path and path[0] == "super":
                kind, path = "super", path[1:]
        else:
            kind, path = "self", segs
        if alias == "self":
            alias = segs[-2] if len(segs) > 1 else alias
            path = path[:-1]
        out.append((kind, path, alias))

    walk("", body)
    return out


def reexports(mods):
    """(module, name) -> the module that defines `name`, for every `pub use` re-export."""
    out = {}
    for m, f in mods.items():
        text = COMMENT.sub("", open(f, encoding="utf-8").read())
        for stmt in REEXPORT.findall(text):
            for kind, path, alias in use_items(stmt):
                target = resolve(mods, m, kind, path, follow=False)
                if target is not None and target != m:
                    out[(m, alias)] = target
    return out


def resolve(mods, here, kind, parts, follow=True):
    """The module a path starting at `here` names (the longest known prefix),
    following re-exports to the module that defines the item."""
    if kind == "crate":
        base = []
    elif kind == "self":
        base = list(here)
    else:
        base = list(here)[:-1]
        parts = list(parts)
        while parts and parts[0] == "super":
            parts = parts[1:]
            base = base[:-1]
    # The path names the base module itself (an item in it), or a module below.
    best = tuple(base) if tuple(base) in mods else None
    rest = list(parts)
    cur = list(base)
    for i, p in enumerate(parts):
        cur.append(p)
        if tuple(cur) in mods:
            best = tuple(cur)
            rest = parts[i + 1:]
    # An item the module only re-exports is defined elsewhere.
    seen = set()
    while follow and best is not None and rest and (best, rest[0]) in REEXPORTS and best not in seen:
        seen.add(best)
        best = REEXPORTS[(best, rest[0])]
        rest = rest[1:]
    return best


INLINE_MOD = re.compile(r"\bmod\s+[A-Za-z_][A-Za-z0-9_]*\s*\{")


def flatten_inline_mods(text):
    """Inside an inline `mod x { ... }` (tests, mostly), `super::` names the
    file's own module: rewrite it so paths resolve as from the file."""
    out, i = [], 0
    for m in INLINE_MOD.finditer(text):
        if m.start() < i:
            continue
        depth, j = 0, m.end() - 1
        while j < len(text):
            if text[j] == "{":
                depth += 1
            elif text[j] == "}":
                depth -= 1
                if depth == 0:
                    break
            j += 1
        out.append(text[i : m.end()])
        out.append(re.sub(r"(?<!::)\bsuper::", "self::", text[m.end() : j]))
        i = j
    out.append(text[i:])
    return "".join(out)


def imports(mods):
    graph = {m: set() for m in mods}
    for m, f in mods.items():
        text = REEXPORT.sub("", flatten_inline_mods(COMMENT.sub("", open(f, encoding="utf-8").read())))
        children = {m + (c,) for c in MOD_DECL.findall(text)}
        for stmt in USE.findall(text):
            for kind, path, _ in use_items(stmt):
                target = resolve(mods, m, kind, path)
                if target is not None and target != m and not (target[: len(m)] == m and len(target) > len(m)):
                    graph[m].add(target)
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


def crate_name(c):
    try:
        text = open(os.path.join(c, "Cargo.toml"), encoding="utf-8").read()
        m = re.search(r'^name\s*=\s*"([^"]+)"', text, re.M)
        if m:
            return m.group(1)
    except OSError:
        pass
    return os.path.basename(os.path.abspath(c))


def name(m):
    return "::".join(m) or "(root)"


def main():
    args = sys.argv[1:]
    show = "--map" in args
    crates = [a for a in args if a != "--map"] or ["."] + sorted(
        d for d in ("transport", "engine", "gpu", "sim", "cli", "bench") if os.path.isdir(d)
    )
    bad = 0
    for c in crates:
        src = os.path.join(c, "src")
        mods = modules(src)
        REEXPORTS.clear()
        REEXPORTS.update(reexports(mods))
        graph = imports(mods)
        found = cycles(graph)
        label = crate_name(c)
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
