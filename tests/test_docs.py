"""The reference docs (``docs/``, ``mkdocs.yml``) build, and every relative link in them resolves.

``mkdocs build --strict`` fails on any warning: a page missing from the nav's files, a broken anchor,
a docstring that mkdocstrings cannot render (``docs/api.md``). The site goes to a temporary folder,
never into the checkout. Links to repository files outside ``docs/`` (``../results/README.md``) are
not site pages, so mkdocs only notes them; :func:`test_relative_links_resolve` checks that they exist.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
#: the README and every markdown page of docs/, dated notes included
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def test_mkdocs_build_strict(tmp_path):
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (site / "index.html").is_file() and (site / "api" / "index.html").is_file()


def nav_files(nav) -> set[str]:
    """The files a mkdocs nav lists (nested sections included)."""
    if isinstance(nav, str):
        return {nav}
    if isinstance(nav, list):
        return set().union(*(nav_files(x) for x in nav))
    if isinstance(nav, dict):
        return set().union(*(nav_files(x) for x in nav.values()))
    return set()


def test_every_reference_page_is_in_the_nav():
    nav = nav_files(yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"])
    pages = {p.name for p in (REPO / "docs").glob("*.md")}
    assert pages <= nav, f"docs pages missing from mkdocs.yml's nav: {sorted(pages - nav)}"


def links(text: str) -> list[str]:
    """Targets of the markdown links outside code (fenced blocks and inline code removed)."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"\]\(([^)\s]+)\)", text)


def test_relative_links_resolve():
    broken = []
    for page in PAGES:
        for target in links(page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = target.split("#", 1)[0]
            if not (page.parent / path).exists():
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert not broken, broken


def test_training_page_names_row_m_settings():
    """docs/training.md names the soft ranks and the direction that row M's experiment sets (a
    changed row M must change the page that explains it)."""
    row_m = yaml.safe_load((REPO / "configs/experiment/shapes_consistency.yaml").read_text())["loss"]
    text = (REPO / "docs/training.md").read_text()
    sentence = text[text.index("Row M of the ShapesWorld experiments"):]
    sentence = sentence[: sentence.index("The paper's form")]
    for key in ("soft_rank", "direction"):
        assert f"`{row_m[key]}`" in sentence, f"docs/training.md's row M sentence does not name loss.{key}={row_m[key]}"
