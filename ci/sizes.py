#!/usr/bin/env python3
"""Function and file sizes outside tests (issue #30's "smaller rooms" figures).

Counts every Rust `fn` with a body in tracked files, except files under a `tests/`
directory, files named `tests.rs` (a module's tests in a file of their own) and
`#[cfg(test)] mod tests { ... }` blocks (the rest of a file after one; a
`mod tests;` declaration only names the file and ends nothing). A
function's length is its lines from `fn` to its closing brace, found by matching
braces outside strings, chars and `//` comments (good enough for this code base:
it does not use raw strings with braces in function bodies).

    python3 ci/sizes.py            # totals, functions over 150 lines, files over 1200
    python3 ci/sizes.py --list 70  # every function over 70 lines, longest first
    python3 ci/sizes.py --check    # exit 1 when a function is over 150 lines or a file over 1200
"""
import argparse
import re
import subprocess
import sys

FN = re.compile(r'\s*(pub(\([^)]*\))?\s+)?(const\s+)?(async\s+)?(unsafe\s+)?(extern\s+"C"\s+)?fn\s+(\w+)')
TEST_MOD = re.compile(r'\s*#\[cfg\(test\)\]')
MAX_FN, MAX_FILE = 150, 1200


def strip(line):
    s = re.sub(r'"(\\.|[^"\\])*"', '""', line)
    s = re.sub(r"'(\\.|[^'\\])'", "''", s)
    return s.split('//')[0]


def scan(path):
    """(non-test lines, [(length, line, name)]) of one file."""
    lines = open(path, errors='replace').read().split('\n')
    end = len(lines)
    for i, l in enumerate(lines):
        if TEST_MOD.match(l) and i + 1 < len(lines) and re.match(r'\s*mod tests\s*\{', lines[i + 1]):
            end = i
            break
    fns = []
    for i in range(end):
        m = FN.match(lines[i])
        if not m:
            continue
        depth, started, j = 0, False, i
        while j < end:
            s = strip(lines[j])
            for ch in s:
                if ch == '{':
                    depth += 1
                    started = True
                elif ch == '}':
                    depth -= 1
            if started and depth <= 0:
                break
            if not started and ';' in s:
                break
            j += 1
        if started:
            fns.append((j - i + 1, i + 1, m.group(7)))
    return end, fns


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--list', type=int, metavar='N', help='list every function over N lines')
    ap.add_argument('--check', action='store_true', help=f'fail on a function over {MAX_FN} lines or a file over {MAX_FILE}')
    a = ap.parse_args()
    files = subprocess.check_output(['git', 'ls-files', '*.rs'], text=True).split()
    fns, big_files = [], []
    for f in files:
        if '/tests/' in f or f.startswith('tests/') or f == 'tests.rs' or f.endswith('/tests.rs'):
            continue
        n, found = scan(f)
        if n > MAX_FILE:
            big_files.append((n, f))
        fns += [(length, f, line, name) for length, line, name in found]
    fns.sort(reverse=True)
    over = lambda k: sum(1 for x in fns if x[0] > k)
    print(f'{len(fns)} functions outside tests: {over(MAX_FN)} over {MAX_FN} lines, {over(70)} over 70')
    for length, f, line, name in fns:
        if length > (a.list if a.list is not None else MAX_FN):
            print(f'{length:5} {f}:{line} {name}')
    for n, f in big_files:
        print(f'file over {MAX_FILE} lines outside tests: {f} ({n})')
    if a.check and (over(MAX_FN) or big_files):
        sys.exit(1)


if __name__ == '__main__':
    main()
