"""The extras a user installs declare ranges; only the test extra pins exact versions.

`pip install 'torch==2.14.1' 'attnkit[torch]'` failed with ResolutionImpossible while the
torch extra pinned torch==2.13.0. The ranges must hold the pinned versions the tests run.
"""

from __future__ import annotations

import sys
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
    hf_torch = _requirements(extras["hf"])["torch"]
    assert _lower(hf_torch) >= _lower(torch_range) and hf_torch.contains("2.14.1")
    assert not _requirements(extras["hf"])["transformers"].contains("5.0.0")  # lacks the globals attnkit.hf sets


def _lower(specifier):
    from packaging.version import Version

    return Version(next(spec.version for spec in specifier if spec.operator == ">="))


def test_hf_extra_asks_for_the_torch_its_lowest_transformers_accepts(transformers):
    """transformers declares the torch it works with (and reports torch unavailable below it):
    the hf extra's torch range starts there, not lower."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.version import Version

    hf_extra = _requirements(_extras()["hf"])
    lowest = _lower(hf_extra["transformers"])
    assert Version(metadata.version("transformers")) == lowest  # the test extra pins the lower end
    wanted = [Requirement(r) for r in metadata.requires("transformers") if r.startswith("torch")]
    floors = {_lower(r.specifier) for r in wanted if any(spec.operator == ">=" for spec in r.specifier)}
    assert floors, "transformers declares no torch range"
    assert _lower(hf_extra["torch"]) >= max(floors), \
        f"hf extra torch {hf_extra['torch']}, transformers wants >= {max(floors)}"


def test_the_ends_script_installs_the_declared_bounds(monkeypatch):
    """scripts/test-dependency-ends.py reads its ends from pyproject.toml: the lower bounds
    exactly, and the ranges themselves for the highest end."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("dependency_ends", ROOT / "scripts" / "test-dependency-ends.py")
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "dependency_ends", script)  # dataclasses look their module up
    spec.loader.exec_module(script)
    extras = _extras()
    torch_extra, hf_extra = _requirements(extras["torch"]), _requirements(extras["hf"])
    numba_range = _requirements(extras["fast"])["numba"]
    ends = script.ends()
    assert set(ends) == {"lowest-numba", "lowest-torch", "lowest-hf", "highest"}
    assert ends["lowest-numba"].requirements == [".[fast,gguf]", f"numba=={_lower(numba_range)}"]
    assert ends["lowest-torch"].requirements == [".[torch]", f"torch=={_lower(torch_extra['torch'])}"]
    assert ends["lowest-hf"].requirements == [
        ".[hf]", f"torch=={_lower(hf_extra['torch'])}", f"transformers=={_lower(hf_extra['transformers'])}",
    ]
    assert ends["highest"].requirements == [".[fast,gguf,torch,hf]", f"numba{numba_range}",
                                            f"torch{hf_extra['torch']}", f"transformers{hf_extra['transformers']}"]
    tested = {path.name for end in ends.values() for pattern in end.tests for path in ROOT.glob(pattern)}
    assert {"test_torch_modules.py", "test_hf.py", "test_hf_views.py", "test_dependency_ranges.py",
            "test_flash_kernels.py", "test_quant_kernels.py", "test_native.py"} <= tested
    numba_tested = {path.name for pattern in ends["lowest-numba"].tests for path in ROOT.glob(pattern)}
    assert {"test_elementwise_kernels.py", "test_flash_kernels.py", "test_native.py"} <= numba_tested


def test_numba_is_one_tested_range_in_every_extra_that_brings_it():
    """numba>=A,<B wherever an extra brings it (A: the lowest release the lowest-numba end of
    scripts/test-dependency-ends.py runs; B: the next minor release, not yet tested), and the
    test extra pins a release inside it."""
    extras = _extras()
    ranges = {extra: _requirements(lines)["numba"] for extra, lines in extras.items()
              if "numba" in _requirements(lines)}
    assert {"fast", "gguf", "all", "test"} <= set(ranges)
    pinned = next(iter(ranges.pop("test")))
    assert pinned.operator == "==", f"the test extra pins numba, got {pinned}"
    assert len({str(r) for r in ranges.values()}) == 1, f"one numba range, got {ranges}"
    numba_range = ranges["fast"]
    assert {spec.operator for spec in numba_range} == {">=", "<"}, f"numba needs both ends, got {numba_range}"
    assert numba_range.contains(pinned.version) and numba_range.contains("0.61.0")
    assert not numba_range.contains("0.60.0") and not numba_range.contains("0.69.0")  # 0.60: see pyproject.toml
