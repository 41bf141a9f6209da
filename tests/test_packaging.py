"""What the distribution ships: the PyPI page without relative links or images, no test
suite in the sdist, py.typed in the package. (.ci/sdist-smoke builds the sdist itself.)"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "pyproject.toml"
RELATIVE_LINK = re.compile(r"\]\((?!https?://|#)([^)]+)\)|<img[^>]+src=\"(?!https?://)")


def test_the_long_description_has_no_relative_links_or_images():
    (readme,) = re.findall(r'^readme = "([^"]+)"', PYPROJECT.read_text(), re.MULTILINE)
    description = (ROOT / readme).read_text()
    assert readme != "README.md"  # README.md links docs/ relatively
    assert RELATIVE_LINK.findall(description) == []
    assert RELATIVE_LINK.findall((ROOT / "README.md").read_text())  # the check can fail


def test_the_sdist_ships_no_partial_test_suite_and_the_package_is_typed():
    manifest = (ROOT / "MANIFEST.in").read_text().splitlines()
    assert "prune tests" in manifest
    assert (ROOT / "django_pglock" / "py.typed").is_file()
    (package_data,) = re.findall(r"^django_pglock = \[(.*)\]$", PYPROJECT.read_text(), re.MULTILINE)
    assert '"py.typed"' in package_data
