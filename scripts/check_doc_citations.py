#!/usr/bin/env python3
"""Check that every citation of the project's docs points at a file and heading that exist.

Scans ``qconvert/``, ``scripts/``, ``tests/``, ``docs/`` and the top-level ``*.md`` files for:

* ``docs/NAME.md`` and ``docs/NAME.md#anchor`` anywhere (code, comments, error messages, docs);
* Markdown links ``[text](path.md#anchor)`` and ``[text](#anchor)`` in ``*.md`` files, relative to
  the file that holds them (links to web addresses are not checked);
* stale citations outside ``docs/``: a bare ``formats.md``, ``layouts.md``, ``reload.md``,
  ``baselines.md`` (research notes that are not part of the repository) or a ``§`` section mark.
  Cite ``docs/NAME.md#anchor`` instead.

An anchor is the GitHub slug of a Markdown heading of the target file (lower case, punctuation
dropped, spaces as hyphens, ``-1``, ``-2`` for repeats) or an ``<a id="...">`` / ``<a name="...">``.

Prints one line per broken citation, ``path:line: citation: why``, and exits 1 if there is any.

    python scripts/check_doc_citations.py [--root DIR]

``--apply TSV`` rewrites citations from a table with the columns ``file, line, old, new`` (tab
separated, header line first): each ``old`` text is replaced by ``new`` on
that line, or, when lines moved, at the file's only occurrence of ``old`` nearest to it. Rows it
cannot place are printed and make the exit status 1.
"""

from __future__ import annotations

import argparse
import re
import sys
import unicodedata
from pathlib import Path

SCAN_DIRS = ("qconvert", "scripts", "tests", "docs")
SCAN_SUFFIXES = {".py", ".md", ".sh", ".c", ".h", ".txt", ".toml", ".cfg", ".yaml", ".yml"}
#: this script (its docstring shows the forms it looks for) and its test (made-up citations)
SKIP_FILES = {"scripts/check_doc_citations.py", "tests/test_check_doc_citations.py"}
#: research notes that lived outside the repository; citing them bare is a broken citation
OUTSIDE_NOTES = ("formats", "layouts", "reload", "baselines", "field-2026-12")

DOCS_CITE = re.compile(r"(?<![\w/.-])docs/([\w./-]+?\.md)(#[\w-]*)?(?![\w-]|\.\w)")
MD_LINK = re.compile(r"\]\(([^)\s]+)\)")
STALE_NOTE = re.compile(
    r"(?<![\w/.-])(?:spec\s+)?("
    + "|".join(map(re.escape, OUTSIDE_NOTES))
    + r")\.md\b(?:\s*§[\d.]+(?:\s*[A-Z]\b)?(?:,\s*§[\d.]+)*)?"
)
SECTION_MARK = re.compile(r"(?:spec\s+)?§\s*[\d.]+(?:\s*[A-Z]\b)?(?:,\s*§[\d.]+)*")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)\s*=\s*[\"']([^\"']+)[\"']", re.I)


def slug(text: str) -> str:
    """GitHub's anchor for a heading's text (as github-slugger computes it)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    out = []
    for ch in text.lower():
        cat = unicodedata.category(ch)
        if ch in " -_" or cat[0] in "LN" or cat[0] == "M":
            out.append(ch)
    return "".join(out).replace(" ", "-")


def anchors(md: Path, cache: dict[Path, set[str]]) -> set[str]:
    """Every anchor a Markdown file defines."""
    if md in cache:
        return cache[md]
    seen: dict[str, int] = {}
    found: set[str] = set()
    fence = None
    for line in md.read_text(encoding="utf-8").splitlines():
        stripped = line.lstrip()
        if stripped.startswith(("```", "~~~")):
            mark = stripped[:3]
            fence = None if fence == mark else (fence or mark)
            continue
        found.update(HTML_ANCHOR.findall(line))
        if fence:
            continue
        m = HEADING.match(line)
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    cache[md] = found
    return found


def files_to_scan(root: Path) -> list[Path]:
    out = sorted(p for p in root.glob("*.md") if p.is_file())
    for d in SCAN_DIRS:
        base = root / d
        if base.is_dir():
            out += sorted(
                p for p in base.rglob("*") if p.is_file() and p.suffix in SCAN_SUFFIXES and "__pycache__" not in p.parts
            )
    return out


def _check_target(root: Path, target: Path, anchor: str | None, cache) -> str | None:
    try:
        target.resolve().relative_to(root.resolve())
    except ValueError:
        return "points outside the repository"
    if not target.is_file():
        return "no such file"
    if anchor and target.suffix == ".md" and anchor not in anchors(target, cache):
        return f"no heading with anchor #{anchor} in {target.relative_to(root).as_posix()}"
    return None


def check(root: Path) -> list[str]:
    """One message per broken citation under ``root``."""
    problems: list[str] = []
    cache: dict[Path, set[str]] = {}
    for path in files_to_scan(root):
        rel = path.relative_to(root).as_posix()
        if rel in SKIP_FILES:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        in_docs = rel.startswith("docs/")
        is_md = path.suffix == ".md"
        for no, line in enumerate(text.splitlines(), 1):
            spans: list[tuple[int, int]] = []
            for m in DOCS_CITE.finditer(line):
                spans.append(m.span())
                why = _check_target(root, root / "docs" / m.group(1), (m.group(2) or "#")[1:] or None, cache)
                if why:
                    problems.append(f"{rel}:{no}: {m.group(0)}: {why}")
            if is_md:
                for m in MD_LINK.finditer(line):
                    link = m.group(1)
                    if re.match(r"^[a-z][a-z0-9+.-]*:", link, re.I) or any(a <= m.start(1) < b for a, b in spans):
                        continue  # a web address, or already checked as docs/...
                    ref, _, anchor = link.partition("#")
                    if ref and not ref.endswith(".md"):
                        if not (path.parent / ref).exists():
                            problems.append(f"{rel}:{no}: {link}: no such file")
                        continue
                    target = (path.parent / ref) if ref else path
                    why = _check_target(root, target, anchor or None, cache)
                    if why:
                        problems.append(f"{rel}:{no}: {link}: {why}")
            if in_docs:
                continue
            for m in STALE_NOTE.finditer(line):
                if any(a <= m.start() < b for a, b in spans):
                    continue
                problems.append(
                    f"{rel}:{no}: {m.group(0)}: cites a note outside the repository; cite docs/{m.group(1)}.md#<anchor>"
                )
            for m in SECTION_MARK.finditer(line):
                if any(a <= m.start() < b for a, b in spans) or any(
                    a <= m.start() < b for a, b in (x.span() for x in STALE_NOTE.finditer(line))
                ):
                    continue
                problems.append(
                    f"{rel}:{no}: {m.group(0)}: a section mark of notes outside the repository; "
                    "cite docs/NAME.md#<anchor>"
                )
    return problems


def apply_table(root: Path, table: Path) -> list[str]:
    """Rewrite citations from ``table``; returns the rows that could not be placed."""
    failed: list[str] = []
    edits: dict[str, list[tuple[int, str, str]]] = {}
    for i, row in enumerate(table.read_text(encoding="utf-8").splitlines()[1:], 2):
        if not row.strip():
            continue
        cols = row.split("\t")
        if len(cols) < 4:
            failed.append(f"{table}:{i}: needs 4 tab-separated columns")
            continue
        edits.setdefault(cols[0], []).append((int(cols[1]), cols[2], cols[3]))
    for rel, rows in edits.items():
        path = root / rel
        if not path.is_file():
            failed.extend(f"{rel}:{ln}: {old}: file not found" for ln, old, _ in rows)
            continue
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        for ln, old, new in rows:
            if 0 < ln <= len(lines) and lines[ln - 1].count(old) == 1:
                lines[ln - 1] = lines[ln - 1].replace(old, new)
                continue
            hits = [k for k, text in enumerate(lines) if old in text]
            if len(hits) == 1 and lines[hits[0]].count(old) == 1:
                lines[hits[0]] = lines[hits[0]].replace(old, new)
            else:
                failed.append(f"{rel}:{ln}: {old}: found {len(hits)} lines holding it; edit by hand")
        path.write_text("".join(lines), encoding="utf-8")
    return failed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=str(Path(__file__).resolve().parent.parent), help="repository root")
    ap.add_argument("--apply", metavar="TSV", help="rewrite citations from this table first")
    a = ap.parse_args(argv)
    root = Path(a.root)
    bad: list[str] = []
    if a.apply:
        bad += apply_table(root, Path(a.apply))
    bad += check(root)
    for line in bad:
        print(line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
