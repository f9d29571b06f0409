#!/usr/bin/env python3
"""Checks the links of the README and the book (docs/): no broken relative link, no dead anchor.

    python3 ci/check-links.py                 # README.md, python/README.md, docs/src/**/*.md
    python3 ci/check-links.py FILE.md ...     # those files instead
    python3 ci/check-links.py --html DIR      # also the book as built by `mdbook build` into DIR
    python3 ci/check-links.py -v              # also list the external links it skipped

In the Markdown sources (outside code blocks and code spans), every link and image, inline
`[text](target)`, reference definitions `[label]: target` and HTML `href=`/`src=`, must
- if relative, name a file or directory that exists inside the repository, resolved from the
  linking file's directory as GitHub resolves it (so `docs/src/x.md` reaches the repository
  root with `../../`);
- if it has an `#anchor` into a Markdown file (or the same file), match one of that file's
  headings by the slug rule GitHub and mdBook share: the heading's text as rendered, lower
  case, letters, digits, `_` and `-` kept, whitespace turned into `-`, everything else
  dropped, and `-1`, `-2`, ... appended to repeats; or an explicit `<a id=...>`/`name=`;
- an anchor into another kind of file may only be a GitHub line anchor (`#L10`, `#L10-L20`).
Links with a scheme (http, https, mailto) are not fetched (CI has no internet): they are
counted as skipped, and listed with -v. Absolute paths (`/x`) are refused: they mean
different things on GitHub and in the built book.

With --html DIR it also reads the built book: every relative href/src of its pages that stays
inside DIR must name a file there, and its fragment an id in that file. Links that leave DIR
point into the repository (`../../bench/...`) and were checked in the sources above.

Exits 1 if any link is broken, listing each as FILE:LINE: target: reason.
"""
import argparse
import html.parser
import os
import re
import sys
import unicodedata
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parent.parent
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
ATX = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
SETEXT = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
LINE_ANCHOR = re.compile(r"^L\d+(?:-L\d+)?$")
HTML_ID = re.compile(r"""<a\s[^>]*?\b(?:id|name)\s*=\s*["']([^"']+)["']""", re.I)
HTML_LINK = re.compile(r"""\b(?:href|src)\s*=\s*["']([^"']+)["']""", re.I)
REF_DEF = re.compile(r"^ {0,3}\[([^\]]+)\]:\s*<?([^\s>]+)>?")


def code_spans(line):
    """Splits a line into (is_code, text) pieces by backtick code spans (CommonMark's rule:
    a run of N backticks closes at the next run of exactly N)."""
    out, i, n = [], 0, len(line)
    plain = ""
    while i < n:
        if line[i] == "`":
            j = i
            while j < n and line[j] == "`":
                j += 1
            ticks = line[i:j]
            close = re.compile(r"(?<!`)" + ticks + r"(?!`)")
            m = close.search(line, j)
            if m:
                if plain:
                    out.append((False, plain))
                    plain = ""
                out.append((True, line[j:m.start()]))
                i = m.end()
                continue
            plain += ticks
            i = j
            continue
        plain += line[i]
        i += 1
    if plain:
        out.append((False, plain))
    return out


def markdown_lines(text):
    """Yields (line number, line) outside fenced code blocks."""
    fence = None
    for no, line in enumerate(text.split("\n"), 1):
        m = FENCE.match(line)
        if fence:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) \
                    and not line.strip()[len(m.group(1)):].strip():
                fence = None
            continue
        if m:
            fence = m.group(1)
            continue
        yield no, line


def rendered_text(md):
    """The text of a heading's Markdown as it renders: code spans verbatim, link and image
    text kept, emphasis markers and HTML tags dropped."""
    out = []
    for is_code, piece in code_spans(md):
        if is_code:
            out.append(piece.strip() if piece.strip() else piece)
            continue
        piece = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", piece)   # links and images: their text
        piece = re.sub(r"!?\[([^\]]*)\]\[[^\]]*\]", r"\1", piece)  # reference links
        piece = re.sub(r"<[^>]+>", "", piece)                        # inline HTML
        piece = re.sub(r"\\(.)", r"\1", piece)                       # escapes
        piece = piece.replace("*", "").replace("~~", "")
        piece = re.sub(r"(?<![A-Za-z0-9])_+|_+(?![A-Za-z0-9])", "", piece)  # _emphasis_
        out.append(piece)
    return "".join(out)


def slug(text):
    """GitHub's and mdBook's heading id (mdbook-html's id_from_content)."""
    out = []
    for ch in text.strip().lower():
        if ch.isalnum() or ch in "_-":
            out.append(ch)
        elif ch.isspace():
            out.append("-")
    return unicodedata.normalize("NFC", "".join(out))


def anchors_of(path, cache={}):
    """Every anchor a Markdown file defines: heading slugs (deduplicated) and HTML ids."""
    if path in cache:
        return cache[path]
    text = path.read_text(encoding="utf-8")
    seen, anchors = {}, set()
    prev = None
    for no, line in markdown_lines(text):
        heading = None
        m = ATX.match(line)
        if m:
            heading = m.group(2) or ""
        elif prev is not None and prev.strip() and SETEXT.match(line) \
                and not ATX.match(prev) and not prev.lstrip().startswith(("-", "*", "|", ">")):
            heading = prev.strip()
        if heading is not None:
            base = slug(rendered_text(heading))
            s, k = base, seen.get(base, 0)
            while s in anchors:  # GitHub and mdBook: -1, -2, ... on repeats
                k += 1
                s = f"{base}-{k}"
            seen[base] = k
            anchors.add(s)
        for is_code, piece in code_spans(line):
            if not is_code:
                anchors.update(HTML_ID.findall(piece))
        prev = line
    cache[path] = anchors
    return anchors


def links_of(text):
    """Yields (line number, target) for every link outside code."""
    for no, line in markdown_lines(text):
        m = REF_DEF.match(line)
        if m:
            yield no, m.group(2)
            continue
        for is_code, piece in code_spans(line):
            if is_code:
                continue
            for m in re.finditer(r"\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)", piece):
                yield no, m.group(1)
            for m in HTML_LINK.finditer(piece):
                yield no, m.group(1)
            for m in re.finditer(r"<(https?://[^>\s]+)>", piece):
                yield no, m.group(1)


def check_target(src, target):
    """None if the link from src resolves, else why not."""
    if not target:
        return "empty link"
    path_part, _, anchor = target.partition("#")
    path_part = unquote(path_part.split("?", 1)[0])
    anchor = unquote(anchor)
    if path_part.startswith("/"):
        return "absolute path (use one relative to the linking file)"
    dest = (src.parent / path_part).resolve() if path_part else src
    try:
        dest.relative_to(ROOT)
    except ValueError:
        return f"leaves the repository ({dest})"
    if not dest.exists():
        return f"no such file or directory: {os.path.relpath(dest, ROOT)}"
    if not anchor:
        return None
    if dest.is_dir():
        return "an anchor into a directory"
    if dest.suffix.lower() in (".md", ".markdown"):
        if anchor in anchors_of(dest):
            return None
        near = sorted(a for a in anchors_of(dest) if a[:6] == anchor[:6])
        hint = f" (close: {', '.join(near[:3])})" if near else ""
        return f"no heading with anchor #{anchor} in {os.path.relpath(dest, ROOT)}{hint}"
    if LINE_ANCHOR.match(anchor):
        return None
    return f"anchor #{anchor} into a file that is not Markdown"


class Page(html.parser.HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.ids, self.links = set(), []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for key in ("id", "name"):
            if a.get(key) and (key == "id" or tag == "a"):
                self.ids.add(a[key])
        for key in ("href", "src"):
            if a.get(key) and tag in ("a", "img", "link", "script", "source"):
                self.links.append((self.getpos()[0], a[key]))


def check_html(book, broken):
    """Links of the built book that stay inside it. Returns (checked, left the book)."""
    book = book.resolve()
    pages = {}
    for p in sorted(book.rglob("*.html")):
        parser = Page()
        parser.feed(p.read_text(encoding="utf-8", errors="replace"))
        pages[p] = parser
    checked = left = 0
    for p, parser in pages.items():
        for line, target in parser.links:
            if SCHEME.match(target) or target.startswith("//"):
                continue
            path_part, _, frag = target.partition("#")
            path_part = unquote(path_part.split("?", 1)[0])
            dest = (p.parent / path_part).resolve() if path_part else p
            try:
                dest.relative_to(book)
            except ValueError:
                left += 1
                continue
            checked += 1
            where = f"{os.path.relpath(p, book)} (built):{line}: {target}"
            if dest.is_dir():
                dest = dest / "index.html"
            if not dest.exists():
                broken.append(f"{where}: no such file in the book")
            elif frag and dest.suffix == ".html":
                ids = pages[dest].ids if dest in pages else set()
                if unquote(frag) not in ids:
                    broken.append(f"{where}: no id {frag!r} in {os.path.relpath(dest, book)}")
    return checked, left


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", type=Path)
    ap.add_argument("--html", type=Path, help="the built book's directory")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    files = [f.resolve() for f in args.files] or (
        [ROOT / "README.md", ROOT / "python" / "README.md"] + sorted((ROOT / "docs" / "src").rglob("*.md")))
    broken, external = [], []
    local = 0
    for f in files:
        if not f.exists():
            broken.append(f"{f}: no such file")
            continue
        rel = os.path.relpath(f, ROOT)
        for no, target in links_of(f.read_text(encoding="utf-8")):
            if SCHEME.match(target) or target.startswith("//"):
                external.append(f"{rel}:{no}: {target}")
                continue
            local += 1
            why = check_target(f, target)
            if why:
                broken.append(f"{rel}:{no}: {target}: {why}")
    if args.verbose:
        for e in external:
            print(f"skipped (external, not fetched): {e}")
    print(f"{len(files)} Markdown files: {local} relative links and anchors checked, "
          f"{len(external)} external links skipped (not fetched)")
    if args.html:
        if not args.html.is_dir():
            broken.append(f"{args.html}: the built book is missing (run mdbook build first)")
        else:
            checked, left = check_html(args.html, broken)
            print(f"the built book ({args.html}): {checked} links inside it checked, "
                  f"{left} into the repository (checked in the sources)")
    for b in broken:
        print(f"BROKEN {b}")
    if broken:
        print(f"{len(broken)} broken links")
        return 1
    print("no broken links")
    return 0


if __name__ == "__main__":
    sys.exit(main())
