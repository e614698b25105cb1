"""The extras a user installs declare ranges; only the test extra pins exact versions.

`pip install 'torch==2.14.1' 'attnkit[torch]'` failed with ResolutionImpossible while the
torch extra pinned torch==2.13.0. The ranges must hold the pinned versions the tests run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _extras() -> dict[str, list[str]]:
    tomllib = pytest.importorskip("tomllib", reason="Python 3.10 has no tomllib")
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]


def _requirements(extra: list[str]) -> dict:
    from packaging.requirements import Requirement

    return {Requirement(r).name: Requirement(r).specifier for r in extra}


def test_torch_and_hf_extras_are_ranges_that_hold_the_tested_pins():
    extras = _extras()
    tested = _requirements(extras["test"])
    assert str(tested["torch"]) == "==2.13.0" and str(tested["transformers"]) == "==5.24.0"
    for extra in ("torch", "hf"):
        for name, specifier in _requirements(extras[extra]).items():
            if name not in ("torch", "transformers"):
                continue
            assert all(spec.operator in (">=", "<") for spec in specifier), (extra, name, str(specifier))
            assert {spec.operator for spec in specifier} == {">=", "<"}, f"{extra}: {name} needs both ends"
            pinned = next(iter(tested[name])).version
            assert specifier.contains(pinned), f"{extra}: {name}{specifier} excludes the tested {pinned}"
    torch_range = _requirements(extras["torch"])["torch"]
    assert torch_range.contains("2.14.1") and torch_range.contains("2.5.0") and not torch_range.contains("2.4.1")
    assert _requirements(extras["hf"])["torch"] == torch_range
    assert not _requirements(extras["hf"])["transformers"].contains("5.0.0")  # lacks the globals attnkit.hf sets
