#!/usr/bin/env python3
"""Assertion density of the engine core (issue #30: "at least 1 assertion per function").

Counts, in engine/src outside tests, the functions with a body and the assertion
macros: assert!, assert_eq!, assert_ne! and their debug_ forms (`unreachable!`
is not an assertion). Outside tests means: not in an item under `#[cfg(test)]`
(a `mod tests` block, a test-only helper), not in a `tests.rs` file (a module's
tests in a file of their own), and not in the simulator (sim.rs or a
sim/ directory, which is a test harness of its own). Comments and strings are
ignored, so a doc example's `assert!` is not counted. Functions are found as
ci/sizes.py finds them.

    python3 ci/assert-density.py            # the figure
    python3 ci/assert-density.py --files    # and every file's, least dense first
    python3 ci/assert-density.py --check    # exit 1 under 1.0 assertion per function
"""
import argparse
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, '..', 'engine', 'src')
sys.path.insert(0, HERE)
from sizes import FN, strip  # noqa: E402  (one function scanner for both figures)
CFG_TEST = re.compile(r'\s*#\[cfg\(test\)\]')
ASSERT = re.compile(r'\b(debug_)?assert(_eq|_ne)?!')
MIN = 1.0


def item_end(lines, i):
    """The index of the last line of the item starting at line i (braces matched, or a `;`)."""
    depth, started, j = 0, False, i
    while j < len(lines):
        s = lines[j]
        for ch in s:
            if ch == '{':
                depth += 1
                started = True
            elif ch == '}':
                depth -= 1
        if started and depth <= 0:
            return j
        if not started and ';' in s:
            return j
        j += 1
    return len(lines) - 1


def scan(path):
    """(functions, assertions) of one file, outside `#[cfg(test)]` items."""
    raw = open(path, errors='replace').read().split('\n')
    lines = [strip(l) for l in raw]
    live = [True] * len(lines)
    i = 0
    while i < len(lines):
        if CFG_TEST.match(lines[i]):
            end = item_end(lines, i + 1)
            for k in range(i, end + 1):
                live[k] = False
            i = end + 1
            continue
        i += 1
    fns = asserts = 0
    for i, s in enumerate(lines):
        if not live[i]:
            continue
        asserts += len(ASSERT.findall(s))
        if FN.match(s):
            end = item_end(lines, i)
            if any('{' in lines[k] for k in range(i, end + 1)):
                fns += 1
    return fns, asserts


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--files', action='store_true', help="every file's assertions and functions")
    ap.add_argument('--check', action='store_true', help=f'fail under {MIN} assertion per function')
    a = ap.parse_args()
    rows = []
    for dirpath, dirs, files in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if d != 'sim')
        for f in sorted(files):
            # A module's tests in a file of their own (`tests.rs`) are tests, as in ci/sizes.py.
            if not f.endswith('.rs') or f == 'tests.rs' or (f == 'sim.rs' and dirpath == ROOT):
                continue
            path = os.path.join(dirpath, f)
            fns, asserts = scan(path)
            rows.append((os.path.relpath(path, os.path.join(ROOT, '..', '..')), fns, asserts))
    fns = sum(r[1] for r in rows)
    asserts = sum(r[2] for r in rows)
    density = asserts / fns if fns else 0.0
    if a.files:
        for path, f, n in sorted(rows, key=lambda r: (r[2] / r[1] if r[1] else 9, r[0])):
            print(f'{n:5} / {f:<4} {path}')
    print(f'engine: {asserts} assertions in {fns} functions outside tests: {density:.2f} per function (at least {MIN})')
    if a.check and density < MIN:
        print(f'under {MIN}: assert the invariants the code relies on (see --files)')
        sys.exit(1)


if __name__ == '__main__':
    main()
