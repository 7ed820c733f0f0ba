"""The user guide builds with `mkdocs build --strict` (a broken link, a missing anchor or a page
left out of the nav fails), and the README stays a front page."""

from __future__ import annotations

import os
import subprocess
import sys

import yaml

from backend.paths import REPO_ROOT

MAX_README_LINES = 300


def mkdocs_build(config_file, site_dir) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config_file),
                           "--site-dir", str(site_dir)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


def test_the_guide_builds_strict(tmp_path):
    result = mkdocs_build(REPO_ROOT / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "site" / "parameters" / "index.html").is_file()
    assert (tmp_path / "site" / "results" / "index.html").is_file()  # perf/RESULTS.md, linked into docs/


def test_a_broken_link_fails_the_build(tmp_path):
    """The same configuration on a page with a link to nothing: the strict build must refuse it."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\nSee [the parameters](parameters.md).\n")
    config = yaml.safe_load((REPO_ROOT / "mkdocs.yml").read_text())
    config.update(docs_dir=str(docs), nav=[{"Home": "index.md"}], theme={"name": "mkdocs"})
    config_file = tmp_path / "mkdocs.yml"
    config_file.write_text(yaml.safe_dump(config))
    result = mkdocs_build(config_file, tmp_path / "site")
    assert result.returncode != 0 and "parameters.md" in result.stderr, result.stderr[-2000:]


def test_the_readme_is_a_front_page():
    lines = (REPO_ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, len(lines)
