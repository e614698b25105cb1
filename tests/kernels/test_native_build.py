"""The native build as a user meets it (issues 45 and 46): a first `attnkit generate` in an
empty cache says what it builds before it starts, on its own line on stderr; two processes
building into one empty cache tell "built" from "loaded"; numba installed but broken falls
back to the NumPy reference with one line."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from attnkit import kernels

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: the shared helpers

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, gguf):
    from tiny_checkpoints import write_tiny_llama_gguf

    path = tmp_path_factory.mktemp("native_build") / "tiny.gguf"
    write_tiny_llama_gguf(path)
    return path


def _env(**extra) -> dict:
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (extra.get("PYTHONPATH"), str(ROOT / "src")) if p)
    return env


def _warm_numba_cache() -> str:
    return os.environ.get("NUMBA_CACHE_DIR") or kernels.numba().config.CACHE_DIR


_TOY = r"""
import sys, time
from attnkit.kernels import native


def _entry(frame, part):  # pragma: no cover - compiled
    pass


def sources():
    time.sleep(3)  # a slow build: the other process meets the lock
    return {"toy": _entry}


with native.reporting(lambda event: print(event.stage, flush=True)):
    entries = native.entries("toy", sources)
print("route", entries.route, flush=True)
"""


@pytest.mark.slow
def test_two_processes_building_one_cache_tell_built_from_loaded(tmp_path):
    """Both find the cache empty and start; one builds, the other waits for the lock and
    loads what the first built: it says "loaded", not "built"."""
    from attnkit.kernels import native

    if not kernels.enabled() or native.compiler() is None:
        pytest.skip("no native library on this platform")
    env = _env(XDG_CACHE_HOME=str(tmp_path), NUMBA_CACHE_DIR=_warm_numba_cache())
    children = [subprocess.Popen([sys.executable, "-c", _TOY], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, env=env) for _ in range(2)]
    outputs = [child.communicate(timeout=300) for child in children]
    for child, (out, err) in zip(children, outputs):
        assert child.returncode == 0, err
    stages = sorted(tuple(out.split()) for out, _ in outputs)
    assert stages == [("start", "built", "route", "library"), ("start", "loaded", "route", "library")], outputs


def test_broken_numba_falls_back_to_the_reference_with_one_line(tiny_gguf, tmp_path):
    """numba installed but failing to import, empty cache: `attnkit generate` runs on the
    NumPy reference, says so in one line, and exits 0 (no internal error)."""
    fake = tmp_path / "fake"
    (fake / "numba").mkdir(parents=True)
    (fake / "numba" / "__init__.py").write_text('raise ImportError("numba is broken here (a test)")\n')
    env = _env(PYTHONPATH=str(fake), XDG_CACHE_HOME=str(tmp_path / "cache"))
    env.pop("NUMBA_CACHE_DIR", None)
    env.pop("ATTNKIT_KERNELS", None)
    result = subprocess.run([sys.executable, "-m", "attnkit", "generate", "The capital", "-n", "3", "--model",
                             str(tiny_gguf)], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    usual = ("tokens/s", "stopped at the limit")  # what every generate says
    lines = [line for line in result.stderr.splitlines() if line.strip() and not any(u in line for u in usual)]
    assert len(lines) == 1, result.stderr
    assert "numba does not import" in lines[0] and "NumPy reference" in lines[0], lines
    assert "internal error" not in result.stderr and "built" not in result.stderr


_ONE_TOKEN = r"""
import json, sys, warnings
import numpy as np
from attnkit.models.llama import LlamaForCausalLM
warnings.simplefilter("ignore")
model = LlamaForCausalLM.from_gguf(sys.argv[1], quantized=True)
print(json.dumps(np.asarray(model.generate(np.array([1]), 4, stop=())).tolist()))
"""


def test_broken_numba_a_one_token_prompt_from_the_library_runs_on_the_reference(tiny_gguf, tmp_path):
    """numba failing to import, empty cache, the library called directly (no command line to
    try numba first) on a one-token prompt, whose first forward is a decode step: the step
    falls back to the modules and the tokens are those of the NumPy reference."""
    fake = tmp_path / "fake"
    (fake / "numba").mkdir(parents=True)
    (fake / "numba" / "__init__.py").write_text('raise ImportError("numba is broken here (a test)")\n')
    runs = {}
    for name, extra in (("broken", dict(PYTHONPATH=str(fake))), ("numpy", dict(ATTNKIT_KERNELS="numpy"))):
        env = _env(XDG_CACHE_HOME=str(tmp_path / f"cache-{name}"), **extra)
        env.pop("NUMBA_CACHE_DIR", None)
        if name == "broken":
            env.pop("ATTNKIT_KERNELS", None)
        result = subprocess.run([sys.executable, "-c", _ONE_TOKEN, str(tiny_gguf)], capture_output=True, text=True,
                                timeout=300, env=env)
        assert result.returncode == 0, result.stderr
        runs[name] = result.stdout
    assert runs["broken"] == runs["numpy"]


@pytest.mark.slow
def test_a_first_generate_says_what_it_builds_before_it_starts(tiny_gguf, tmp_path):
    """An empty cache: the first stderr line says the native kernels are about to be built
    and about how long, and it comes before the build is done (read line by line as the
    process writes them); the generated text on stdout carries no notice."""
    from attnkit.kernels import native

    if not kernels.enabled() or native.compiler() is None:
        pytest.skip("no native library on this platform")
    env = _env(XDG_CACHE_HOME=str(tmp_path), NUMBA_CACHE_DIR=_warm_numba_cache())
    started = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "attnkit", "generate", "The capital", "-n", "3", "--model",
                              str(tiny_gguf)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[tuple[float, str]] = []

    def read() -> None:
        for line in child.stderr:
            lines.append((time.perf_counter() - started, line.rstrip("\n")))

    reader = threading.Thread(target=read)
    reader.start()
    out = child.stdout.read()  # stderr is the reader's alone (communicate would read it too)
    child.wait(timeout=600)
    reader.join(10)
    assert child.returncode == 0, lines
    assert lines, "nothing on stderr"
    first_at, first = lines[0]
    assert first.startswith("building the native kernels") and "about" in first and " s" in first, lines
    built = [at for at, line in lines if line.startswith("built the native kernels")]
    assert built and first_at < built[0], lines
    print(f"notice after {first_at:.1f} s, first build done after {built[0]:.1f} s")
    assert "native kernels" not in out and out.startswith("The capital")
    assert any("tokens/s" in line for _, line in lines)
