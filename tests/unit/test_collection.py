"""Every test tier is collected by a plain ``pytest`` (what CI runs).

pytest's default ``norecursedirs`` contains ``dist``: without the override in
pyproject.toml the distributed tier (tests/dist) is skipped without a word.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent.parent


def test_no_test_directory_is_excluded_from_collection(request: pytest.FixtureRequest) -> None:
    patterns = request.config.getini("norecursedirs")
    tiers = sorted(p.name for p in TESTS.iterdir()
                   if p.is_dir() and any(p.glob("test_*.py")))
    assert {"unit", "proc", "dist", "cluster"} <= set(tiers)
    excluded = [t for t in tiers if any(fnmatch.fnmatch(t, pat) for pat in patterns)]
    assert excluded == [], f"norecursedirs {patterns} hides {excluded}"
