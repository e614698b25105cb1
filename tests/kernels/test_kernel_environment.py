"""The kernels' environment: ATTNKIT_KERNELS checked once, at start, for every command (a
usage error naming the allowed values and what arrived, never an internal error found
halfway through the work), a clear ValueError where the library reads it, and numba
installed but broken (its import fails): the NumPy reference runs, with the reason.

Each case runs in a child process: the setting is read once per process, and a broken
numba is a folder with numba/__init__.py raising ImportError put first on PYTHONPATH.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _env(extra_path: str | None = None, **variables) -> dict:
    path = [p for p in (extra_path, SRC, os.environ.get("PYTHONPATH")) if p]
    env = {k: v for k, v in os.environ.items() if k != "ATTNKIT_KERNELS"}
    return {**env, "PYTHONPATH": os.pathsep.join(path), **variables}


def _attnkit(args: list[str], tmp_path: Path, **variables) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "attnkit", *args], capture_output=True, text=True, cwd=tmp_path,
                          env=_env(**variables), timeout=120)


def _python(code: str, extra_path: str | None = None, **variables) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=_env(extra_path, **variables), timeout=300)


@pytest.mark.parametrize("args", [["version"], ["embed", "one sentence"], ["generate", "Hello", "--max-tokens", "2"],
                                  ["embed", "--file", "lines.txt"]])
def test_a_wrong_setting_is_a_usage_error_before_any_command_runs(tmp_path, args):
    (tmp_path / "lines.txt").write_text("a sentence to embed\n" * 3000)
    done = _attnkit(args, tmp_path, ATTNKIT_KERNELS="bogus")
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert done.stdout == ""  # (embed once left cut-off JSON after 4 s of work)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "internal error" not in lines[0], done.stderr
    assert "ATTNKIT_KERNELS" in lines[0] and "'bogus'" in lines[0]
    assert all(value in lines[0] for value in ("auto", "numba", "numpy")), lines[0]


@pytest.mark.parametrize("value", ["numpy", " NumPy ", "numba", "auto", ""])
def test_allowed_settings_pass_the_check(tmp_path, value):
    done = _attnkit(["version"], tmp_path, ATTNKIT_KERNELS=value)
    assert done.returncode == 0 and done.stdout.startswith("attnkit "), done.stderr


def test_the_library_raises_a_clear_value_error_where_it_reads_the_setting():
    done = _python("""
        from attnkit import kernels
        for ask in (kernels.setting, kernels.enabled, kernels.reason_disabled):
            try:
                ask()
            except ValueError as error:
                print(type(error).__name__, error)
            else:
                print("no error")
    """, ATTNKIT_KERNELS="Bogus")
    assert done.returncode == 0, done.stderr
    expected = "ValueError expected ATTNKIT_KERNELS to be one of auto, numba, numpy or unset, got 'Bogus'"
    assert done.stdout.splitlines() == [expected] * 3


@pytest.fixture
def broken_numba(tmp_path) -> str:
    """A folder holding a numba whose import fails, as a numba built for another NumPy does."""
    package = tmp_path / "broken" / "numba"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text('raise ImportError("Numba needs NumPy 1.x (a broken install)")\n')
    return str(tmp_path / "broken")


def test_a_broken_numba_falls_back_to_the_numpy_reference(broken_numba):
    """The loops' first use tries the import: it fails, the NumPy reference runs, and from
    then on enabled() is False with the reason; nothing raises."""
    done = _python("""
        import numpy as np
        from attnkit import kernels
        from attnkit.kernels import elementwise, flash
        import attnkit
        from attnkit.nn import layers

        print("enabled before", kernels.enabled())  # (answered without importing numba)
        print("load", flash.load(), elementwise.load())
        print("enabled after", kernels.enabled(), kernels.loadable())
        print("reason", kernels.reason_disabled())
        print("notice", kernels.notice("the encoder"))
        rng = np.random.default_rng(0)
        x = rng.standard_normal((2000, 600), dtype=np.float32)  # enough work to start the loops
        print("usable", elementwise.usable(x), flash.usable(x), flash.wants(10**9))
        y = layers.gelu(x)
        q, k, v = (rng.standard_normal((1, 2, 300, 16), dtype=np.float32) for _ in range(3))
        out = attnkit.flash_attention(q, k, v, is_causal=True)
        ref = attnkit.scaled_dot_product_attention(*(t.astype(np.float64) for t in (q, k, v)), is_causal=True)
        print("flash error", float(np.abs(out - ref).max()) < 1e-5, np.isfinite(y).all())
        try:
            kernels.numba()
        except RuntimeError as error:
            print("numba()", error)
    """, broken_numba)
    assert done.returncode == 0, done.stderr
    out = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert out["load"] == "False False"
    assert "enabled before True" in done.stdout or "enabled before False" in done.stdout
    assert "enabled after False False" in done.stdout
    assert out["reason"].startswith("numba does not import (ImportError: Numba needs NumPy 1.x")
    assert "the encoder runs on the NumPy reference (numba does not import" in out["notice"]
    assert out["usable"] == "False False False"
    assert out["flash"] == "error True True"
    assert "compiled kernels are off: numba does not import" in out["numba()"]
