"""Every relative link in the README and docs/ names a file that exists (the kernels' record moved
from the README to docs/cpu_kernels.md; a link left behind by such a move fails here)."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_name_existing_files(page):
    missing = []
    for target in LINK.findall(page.read_text()):
        path = target.split("#", 1)[0]
        if not path or re.match(r"[a-z]+:", path):        # an anchor on the page itself, or a URL
            continue
        if not (page.parent / path).exists():
            missing.append(target)
    assert not missing, f"{page.name}: {missing}"
