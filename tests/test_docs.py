"""The front door and the docs: the README stays short and its links lead somewhere; docs/ builds
as a site with MkDocs in strict mode, so a link to a missing page or heading fails (issue 46)."""

import re
import subprocess
import sys
from pathlib import Path

from markdown.extensions.toc import slugify

ROOT = Path(__file__).parent.parent
README = ROOT / "README.md"
MAX_README_LINES = 300
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """The heading ids MkDocs gives a page (its `toc` extension's default slugs)."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), re.M)
    return {slugify(re.sub(r"[`*]", "", heading), "-") for heading in headings}


def test_the_readme_is_short_and_its_links_resolve():
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_README_LINES
    links = [link for link in LINK.findall(text) if not link.startswith(("http://", "https://"))]
    assert any(link.startswith("docs/") for link in links)
    for link in links:
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.exists(), f"README.md links to {link}, which does not exist"
        if anchor:
            assert anchor in _anchors(target), f"README.md links to {link}: {path} has no heading #{anchor}"


def test_the_docs_build_with_no_broken_link(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    built = {p.relative_to(tmp_path).parent.as_posix() for p in tmp_path.rglob("index.html")}
    pages = {p.stem for p in (ROOT / "docs").glob("*.md")} - {"index"}
    assert pages <= built, pages - built


def test_a_broken_link_fails_the_build(tmp_path):
    """The check above can fail: a page with a link to a missing heading does not build."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n[the engine](engine.md#no-such-heading)\n")
    (docs / "engine.md").write_text("# The engine\n")
    config = (ROOT / "mkdocs.yml").read_text()
    config = re.sub(r"(?ms)^nav:.*", "nav:\n  - Home: index.md\n  - Engine: engine.md\n", config)
    (tmp_path / "mkdocs.yml").write_text(config)
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(tmp_path / "mkdocs.yml")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and "no-such-heading" in done.stderr
