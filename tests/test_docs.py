"""The README stays a guide (at most README_LINES lines; the depth is in docs/) and every relative link in it and in
docs/*.md resolves: the file exists, and a #anchor names a heading of the file it points into."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Set

ROOT = Path(__file__).resolve().parents[1]
README_LINES = 250
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE = re.compile(r"`[^`\n]*`")


def documents(root: Path = ROOT) -> List[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but hyphens and underscores dropped, spaces to hyphens."""
    text = CODE.sub(lambda m: m.group(0).strip("`"), heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path, cache: Dict[Path, Set[str]]) -> Set[str]:
    if path not in cache:
        seen: Dict[str, int] = {}
        out = set()
        for line in FENCE.sub("", path.read_text()).splitlines():
            if line.startswith("#"):
                base = slug(line.lstrip("#"))
                n = seen.get(base, 0)
                seen[base] = n + 1
                out.add(base if n == 0 else f"{base}-{n}")
        cache[path] = out
    return cache[path]


def broken_links(docs: List[Path]) -> List[str]:
    out, cache = [], {}
    for doc in docs:
        text = CODE.sub("", FENCE.sub("", doc.read_text()))
        for target in LINK.findall(text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
                continue
            file, _, anchor = target.partition("#")
            dest = (doc.parent / file).resolve() if file else doc
            if not dest.exists():
                out.append(f"{doc.name}: {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest, cache):
                out.append(f"{doc.name}: {target}: no such heading in {dest.name}")
    return out


def test_the_readme_is_a_guide_not_a_log() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_LINES, f"README.md has {len(lines)} lines; move the depth to docs/"


def test_every_relative_link_resolves() -> None:
    assert broken_links(documents()) == []


def test_a_broken_link_or_anchor_is_found(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## Read `this` first: now\n\ntext\n")
    (tmp_path / "README.md").write_text(
        "[ok](docs/a.md#read-this-first-now) [ok](docs/a.md) [web](https://example.org/x) `[not](a-link.md)`\n"
        "[gone](docs/b.md) [bad anchor](docs/a.md#nothing) [here](#nor-here)\n```\n[code](c.md)\n```\n")
    assert broken_links(documents(tmp_path)) == ["README.md: docs/b.md: no such file",
                                                 "README.md: docs/a.md#nothing: no such heading in a.md",
                                                 "README.md: #nor-here: no such heading in README.md"]


def test_the_perf_log_is_newest_first_and_dated() -> None:
    """Each entry of docs/perf-log.md is headed `## YYYY-MM-DD, <commit>: ...`, the dates never increasing."""
    heads = [line for line in (ROOT / "docs" / "perf-log.md").read_text().splitlines() if line.startswith("## ")]
    dated = [re.match(r"## (\d{4}-\d{2}-\d{2}), ([0-9a-f]{7,40}): \S", h) for h in heads]
    assert heads and all(dated), [h for h, m in zip(heads, dated) if not m]
    dates = [m.group(1) for m in dated]
    assert dates == sorted(dates, reverse=True)
