"""The native kernels (`attnkit.kernels.native`): the library built once and loaded without
numba gives the same bits as numba's in-process callbacks; the decode step gives the same
bits on any number of parts; a process on the library never imports numba; without a C
compiler the callbacks run; the library's reshape helper views exactly what NumPy views."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from attnkit import kernels

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: the shared helpers

pytestmark = pytest.mark.skipif(not kernels.enabled(), reason="the native kernels are built by numba")

IDS = [1, 5, 40, 80, 120, 160, 200, 7, 9, 11, 13]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, gguf):
    from tiny_checkpoints import write_tiny_llama_gguf

    path = tmp_path_factory.mktemp("native") / "tiny.gguf"
    write_tiny_llama_gguf(path)
    return path


def _steps(model, ids, parts=1):
    """Logits (T, V) of `ids` a token a step through the compiled step at `parts` threads."""
    from attnkit.models.llama import step as decode
    from attnkit.models.llama import fused

    cache = model.new_cache(1, len(ids) + 1)
    rows = []
    for slot, token in enumerate(ids):
        frame = fused._prepared(model).frame
        cos, sin = model.rotary.cos_sin(np.array([slot]))
        keys, values = cache.stores
        rows.append(decode.decode_step(token, slot, frame, np.ascontiguousarray(cos[0], np.float32),
                                       np.ascontiguousarray(sin[0], np.float32), keys[:, 0], values[:, 0],
                                       parts=parts))
        cache.advance(1)
    return np.array(rows)


def test_parts_give_the_same_bits(tiny_gguf):
    """Rows and heads split in 2, 3 or 5 parts meeting at barriers: the bits of one part."""
    from attnkit.models.llama import LlamaForCausalLM

    model = LlamaForCausalLM.from_gguf(tiny_gguf, quantized=True)
    one = _steps(model, IDS)
    assert np.isfinite(one).all()
    for parts in (2, 3, 5):
        np.testing.assert_array_equal(_steps(model, IDS, parts), one)


def test_library_and_in_process_callbacks_agree(tiny_gguf, monkeypatch):
    """The library's entries (emitted by llvmlite, linked by the C compiler) compute what
    numba's in-process callbacks compute, bit for bit: the decode step and the products."""
    from attnkit.kernels import native
    from attnkit import quant
    from attnkit.quant import compiled as quant_compiled
    from attnkit.models.llama import step as decode
    from attnkit.models.llama import LlamaForCausalLM

    if native.compiler() is None:
        assert quant_compiled.entries().route == "in-process"
        pytest.skip("no C compiler here: the callbacks are all there is to compare")
    assert quant_compiled.entries().route == "library" and decode._entries().route == "library"
    model = LlamaForCausalLM.from_gguf(tiny_gguf, quantized=True)
    on_library = _steps(model, IDS, parts=2)
    tensor = model.layers[0].mlp.gate_proj.quantized
    x = np.random.default_rng(0).standard_normal((3, tensor.columns)).astype(np.float32)
    product_library = quant.matmul(x, tensor.raw, tensor.kind, tensor.columns)
    prefill_library = quant.matmul(np.repeat(x, 4, axis=0), tensor.raw, tensor.kind, tensor.columns)

    callbacks = native.in_process(lambda: quant_compiled.compiled().entries), native.in_process(decode._entry_sources)
    assert callbacks[0].route == callbacks[1].route == "in-process"
    monkeypatch.setattr(quant_compiled, "entries", lambda: callbacks[0])
    monkeypatch.setattr(decode, "_entries", lambda: callbacks[1])
    np.testing.assert_array_equal(_steps(model, IDS, parts=2), on_library)
    np.testing.assert_array_equal(quant.matmul(x, tensor.raw, tensor.kind, tensor.columns), product_library)
    np.testing.assert_array_equal(quant.matmul(np.repeat(x, 4, axis=0), tensor.raw, tensor.kind, tensor.columns),
                                  prefill_library)


_CHILD = r"""
import json, sys, traceback
first_import = []


class Watch:  # where numba is first imported, for the assertion's message
    def find_spec(self, name, path=None, target=None):
        if name == "numba" and not first_import:
            first_import.append("".join(traceback.format_stack(limit=14)))


sys.meta_path.insert(0, Watch())
import numpy as np
from attnkit.kernels import native
from attnkit.quant import compiled as quant_compiled
from attnkit.models.llama import step as decode
from attnkit.models.llama import LlamaForCausalLM


def report(event):  # what the command line shows of a build
    print(f"{event.stage} the native kernels ({event.library})", file=sys.stderr)


model = LlamaForCausalLM.from_gguf(sys.argv[1], quantized=True)
with native.reporting(report):
    tokens = model.generate(np.array([1, 5, 40]), 6, stop=())
routes = {quant_compiled.entries().route, decode._entries().route}
print(json.dumps({"route": " ".join(sorted(routes)), "numba": "numba" in sys.modules, "llvmlite": "llvmlite" in sys.modules,
                  "tokens": np.asarray(tokens).tolist(), "where": first_import}))
"""


def _child(path, **env) -> tuple[dict, str]:
    result = subprocess.run([sys.executable, "-c", _CHILD, str(path)], capture_output=True, text=True, timeout=600,
                            env={**os.environ, **env})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


def test_a_process_on_the_library_never_imports_numba(tiny_gguf):
    """Once built, the library is all a quantized model's generate needs: numba and llvmlite
    stay out of the process (no LLVM, no compiler), and the tokens are the callbacks'."""
    from attnkit.quant import compiled as quant_compiled
    from attnkit.models.llama import step as decode

    if quant_compiled.entries().route != "library" or decode._entries().route != "library":  # built here if not yet
        pytest.skip("no C compiler here: no library to load")
    report, _ = _child(tiny_gguf)
    assert report["route"] == "library"
    assert not report["numba"] and not report["llvmlite"], report["where"]
    in_process, _ = _child(tiny_gguf, ATTNKIT_KERNELS="numba")
    assert in_process["route"] == "in-process" and in_process["numba"]
    assert report["tokens"] == in_process["tokens"]


@pytest.mark.slow  # measured > 2 s in the quick loop
def test_without_a_compiler_the_callbacks_run(tiny_gguf, tmp_path):
    """A failed build (no working C compiler) says so in one line and runs numba's
    callbacks: same tokens."""
    numba_cache = os.environ.get("NUMBA_CACHE_DIR") or kernels.numba().config.CACHE_DIR
    report, err = _child(tiny_gguf, XDG_CACHE_HOME=str(tmp_path), NUMBA_CACHE_DIR=numba_cache, CC="false")
    assert report["route"] == "in-process"
    assert "native kernels could not be built" in err and "numba runs them in-process" in err
    reference, _ = _child(tiny_gguf, ATTNKIT_KERNELS="numba")
    assert report["tokens"] == reference["tokens"]


def test_the_reshape_helper_views_what_numpy_views():
    """`numba_attempt_nocopy_reshape` of the library's C runtime: for sliced (non-contiguous)
    arrays and every way of regrouping their dimensions, it succeeds exactly when NumPy can
    view the data in the new shape, with NumPy's strides."""
    from attnkit.kernels import native
    from attnkit.quant import compiled as quant_compiled

    if quant_compiled.entries().route != "library":
        pytest.skip("no C compiler here: the helper is numba's own")
    helper = ctypes.CDLL(str(native.library_path("quant"))).numba_attempt_nocopy_reshape
    helper.restype = ctypes.c_int
    rng = np.random.default_rng(1)
    array = ctypes.c_ssize_t * 8
    checked = viewed = 0
    for _ in range(400):
        shape = tuple(int(s) for s in rng.choice([1, 2, 3, 4, 6], size=rng.integers(1, 5)))
        base = np.zeros(tuple(s * 2 for s in shape), np.float32)
        slices = tuple(slice(0, s * int(rng.integers(1, 3)), int(rng.integers(1, 3))) for s in shape)
        a = base[slices][tuple(slice(0, s) for s in shape)]
        size = a.size
        factors = [f for f in (1, 2, 3, 4, 6, 8, 12) if size % f == 0]
        new = []
        left = size
        while left > 1 and len(new) < 4:
            f = int(rng.choice([f for f in factors if left % f == 0]))
            new.append(f)
            left //= f
        new.append(left)
        try:
            view = a.view()
            view.shape = tuple(new)
            expected = view.strides
        except AttributeError:
            expected = None
        strides = array()
        ok = helper(ctypes.c_ssize_t(a.ndim), array(*a.shape), array(*a.strides), ctypes.c_ssize_t(len(new)),
                    array(*new), strides, ctypes.c_ssize_t(4), ctypes.c_int(0))
        checked += 1
        if expected is None:
            assert ok == 0, (a.shape, a.strides, new)
        else:
            viewed += 1
            assert ok == 1, (a.shape, a.strides, new)
            got = tuple(strides[i] for i in range(len(new)))
            assert all(g == e for g, e, n in zip(got, expected, new) if n != 1), (a.shape, a.strides, new, got,
                                                                                expected)
    assert viewed > 50 and checked - viewed > 50


def test_two_threads_stepping_one_model(tiny_gguf):
    """Two threads decoding with one model (each its own cache) get what each gets alone:
    the model's one frame takes one step at a time."""
    import threading

    from attnkit.models.llama import LlamaForCausalLM

    model = LlamaForCausalLM.from_gguf(tiny_gguf, quantized=True)
    prompts = [IDS, IDS[::-1]]
    alone = [_steps(model, ids, parts=2) for ids in prompts]
    together = [None, None]

    def run(i):
        together[i] = [_steps(model, prompts[i], parts=2) for _ in range(3)]

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
        assert not t.is_alive(), "the steps of two threads never finished (their barriers mixed)"
    for i in range(2):
        for got in together[i]:
            np.testing.assert_array_equal(got, alone[i])


def test_the_step_refuses_what_it_cannot_read(tiny_gguf):
    """A token outside the embedding, a slot past the cache, caches or rotary tables of
    another shape: a clear error before the compiled code reads anything."""
    from attnkit.models.llama import step as decode
    from attnkit.models.llama import fused
    from attnkit.models.llama import LlamaForCausalLM

    model = LlamaForCausalLM.from_gguf(tiny_gguf, quantized=True)
    frame = fused._prepared(model).frame
    cache = model.new_cache(1, 4)
    keys, values = (s[:, 0] for s in cache.stores)
    cos, sin = (np.ascontiguousarray(t[0], np.float32) for t in model.rotary.cos_sin(np.array([0])))
    vocab = model.config.vocab_size
    for token, slot, match in ((vocab, 0, "token in"), (-1, 0, "token in"), (1, 4, "slot in")):
        with pytest.raises(ValueError, match=match):
            decode.decode_step(token, slot, frame, cos, sin, keys, values)
    with pytest.raises(ValueError, match="caches of shape"):
        decode.decode_step(1, 0, frame, cos, sin, keys[:, :, :, :-1].copy(), values[:, :, :, :-1].copy())
    with pytest.raises(ValueError, match="cos and sin"):
        decode.decode_step(1, 0, frame, cos[:-1].copy(), sin, keys, values)
    assert np.isfinite(decode.decode_step(1, 0, frame, cos, sin, keys, values)).all()


@pytest.mark.slow  # measured > 2 s in the quick loop
def test_a_build_removes_libraries_unused_for_a_week(tiny_gguf, tmp_path):
    """Building this version's library removes the other folders under the cache's native/
    that no process loaded for a week, and keeps the recent ones."""
    from attnkit.kernels import native

    if native.compiler() is None:
        pytest.skip("no C compiler here: nothing is built")
    base = tmp_path / "attnkit" / "native"
    old, recent = base / "old-version", base / "recent-version"
    for folder in (old, recent):
        folder.mkdir(parents=True)
        (folder / "libattnkit_quant.so").write_bytes(b"")
    week_ago = os.stat(old).st_mtime - 8 * 86400
    os.utime(old, (week_ago, week_ago))
    numba_cache = os.environ.get("NUMBA_CACHE_DIR") or kernels.numba().config.CACHE_DIR
    report, err = _child(tiny_gguf, XDG_CACHE_HOME=str(tmp_path), NUMBA_CACHE_DIR=numba_cache)
    assert report["route"] == "library" and "built the native kernels" in err
    assert not old.exists() and recent.exists()


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "digest file lost", "digest file garbage"])
@pytest.mark.slow  # measured > 2 s in the quick loop
def test_a_damaged_library_is_rebuilt(tiny_gguf, tmp_path, damage):
    """A library whose bytes are not the ones built (a flipped byte, a truncated file), or
    whose digest file is lost or unreadable, is rebuilt with one line saying why; the
    process runs on the rebuilt library with the same tokens."""
    from attnkit.kernels import native
    from attnkit.quant import compiled as quant_compiled

    if native.compiler() is None or quant_compiled.entries().route != "library":
        pytest.skip("no C compiler here: nothing is built")
    numba_cache = os.environ.get("NUMBA_CACHE_DIR") or kernels.numba().config.CACHE_DIR
    env = dict(XDG_CACHE_HOME=str(tmp_path), NUMBA_CACHE_DIR=numba_cache)
    first, _ = _child(tiny_gguf, **env)  # builds into tmp_path
    library = next((tmp_path / "attnkit" / "native").glob("*/libattnkit_quant.so"))
    data = bytearray(library.read_bytes())
    if damage == "flipped byte":
        data[len(data) // 2] ^= 0xFF
        library.write_bytes(bytes(data))
    elif damage == "truncated":
        library.write_bytes(bytes(data[: len(data) // 3]))
    elif damage == "digest file lost":
        library.with_suffix(".json").unlink()
    else:
        library.with_suffix(".json").write_text("{not json")
    report, err = _child(tiny_gguf, **env)
    assert report["route"] == "library" and report["tokens"] == first["tokens"]
    if damage != "digest file lost":
        assert "damaged" in err and "rebuilt" in err, err
    again, err = _child(tiny_gguf, **env)
    assert again["route"] == "library" and "built" not in err  # the rebuilt library loads as it is
