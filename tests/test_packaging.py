"""The package metadata: an SPDX license string with its LICENSE file, read by setuptools without
its ``project.license`` deprecation warning (what `pip install -e .` used to print)."""

from __future__ import annotations

import tomllib
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_license_is_an_spdx_string_with_its_file():
    doc = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert doc["project"]["license"] == "MIT"
    assert doc["project"]["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License") and "Copyright (c) 2026 the vsekit authors" in text
    assert 'THE SOFTWARE IS PROVIDED "AS IS"' in text
    # SPDX strings and license-files need setuptools 77; the build must not pick an older one
    assert "setuptools>=77" in doc["build-system"]["requires"]


def test_setuptools_reads_the_metadata_without_a_license_warning(monkeypatch):
    pytest.importorskip("setuptools", minversion="77")
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    monkeypatch.chdir(ROOT)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), ROOT / "pyproject.toml")
    assert [str(w.message) for w in caught if "license" in str(w.message).lower()] == []
    assert dist.metadata.license_expression == "MIT"
    assert [Path(p).name for p in dist.metadata.license_files] == ["LICENSE"]
