# SPDX-License-Identifier: Apache-2.0
"""Every `SPEC §x.y` the code cites has a row in docs/spec-sections.md, and every link there resolves to a file
and heading of the repository (GitHub's anchor rule: lower case, punctuation dropped, spaces to hyphens)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INDEX = ROOT / "docs" / "spec-sections.md"


def _anchors(path: Path) -> set[str]:
    out = set()
    for line in path.read_text().splitlines():
        if line.startswith("#") and not line.startswith("#!"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", title)))
    return out


def test_every_cited_section_has_a_row():
    cited = set()
    for d in ("vllm_hysparse", "csrc_triton", "tests", "benchmarks", "scripts"):
        for path in (ROOT / d).rglob("*.py"):
            cited |= set(re.findall(r"SPEC §(\d+(?:\.\d+)?)", path.read_text(errors="replace")))
    rows = set(re.findall(r"^\| §(\d+(?:\.\d+)?) \|", INDEX.read_text(), re.M))
    assert len(cited) >= 10, cited  # the scan found the citations
    assert cited <= rows, f"cited in the code, not in docs/spec-sections.md: {sorted(cited - rows)}"


def test_every_link_resolves():
    links = re.findall(r"\]\(([^)]+)\)", INDEX.read_text())
    assert links
    for link in links:
        target, _, anchor = link.partition("#")
        path = (INDEX.parent / target).resolve()
        assert path.is_file(), link
        if anchor:
            assert anchor in _anchors(path), f"{link}: no such heading in {target}"
