"""The documentation site builds with warnings as errors (broken cross-references fail) and has no broken link.

CI installs the ``docs`` extra (scripts/dev.sh), so the test runs there; ``importorskip`` only spares a local
environment without mkdocs.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from docs_links import broken_links

ROOT = Path(__file__).resolve().parent.parent


def test_docs_build_strict_without_broken_links(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    site = tmp_path / "site"
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (site / "index.html").is_file() and (site / "api" / "tt.html").is_file()
    assert broken_links(site) == []
    assert "enable_find_max_batch_size" in (site / "api" / "strategies.html").read_text(encoding="utf-8")
