"""The decode kernels as a native library: built once, then loaded without numba.

numba compiles a kernel when a process first calls it, and even from its on-disk cache it
starts LLVM to load the code: about 150 MB of memory (LLVM's shared library, numba's
modules) and a second, in every process, before the first token. The kernels a quantized
model's `generate` runs (the decode step, the decode products, the prefill's tile
dequantization) are therefore also built ahead of time as one shared library:

- each is an *entry* `entry(frame, part)`: `frame` the address of an int64 array holding
  the addresses and sizes of what it reads and writes (its layout is the entry's module's
  to define), `part` which share of the work this call does (the decode step runs as one
  call per thread, the threads meeting at barriers inside it; see `attnkit.kernels.decode`);
- numba compiles each entry as a C callback (`numba.cfunc`), llvmlite emits it as a
  position-independent object, and the system's C compiler links the objects with a few
  lines of C that give the code what it needs from numba's runtime (memory for its scratch
  arrays; the error paths, which the entries never take, abort with a message);
- the library is kept under the user's cache folder (`~/.cache/attnkit/native/`), named by
  a digest of the kernels' sources, numba's and llvmlite's versions and the CPU (its model
  and flags, read from /proc/cpuinfo), and later processes load it with ctypes: numba is
  not imported and LLVM never starts. A SHA-256 of the library is kept beside it: a
  library whose bytes changed, or that does not load, is rebuilt (one line says so). A
  build removes the folders no process loaded for a week (other versions, other CPUs).

`entries(name, sources)` gives a module's entries as ctypes functions (a library per module
that has entries: `attnkit.kernels.quant`'s products, `attnkit.kernels.decode`'s step); they
release the GIL while they run. Off Linux, when no C compiler is found, or with
ATTNKIT_KERNELS=numba, the same entries run as numba's in-process C callbacks
(`cfunc.ctypes`): same route, same arguments, numba in the process.
The NumPy reference stays what the kernels are tested against (tests/test_native.py holds
the library's results to the in-process callbacks' bit for bit).
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from functools import lru_cache
from pathlib import Path
from typing import Callable

from attnkit import kernels

__all__ = ["FASTMATH", "Entries", "entries", "helpers", "in_process", "library_path"]

# What the compiled code takes from numba's runtime, in C: its scratch arrays' memory (the
# layout of numba's MemInfo, numba/core/runtime/nrt.cpp), and the release of it.
_RUNTIME_C = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

typedef struct {
    size_t refct;
    void (*dtor)(void *, size_t, void *);
    void *dtor_info;
    void *data;
    size_t size;
    void *external_allocator;
} MemInfo;

static void fatal(const char *what) {
    fprintf(stderr, "attnkit native kernels: %s\n", what);
    abort();
}

MemInfo *NRT_MemInfo_alloc_aligned(size_t size, unsigned align) {
    char *base = malloc(sizeof(MemInfo) + size + 2 * (size_t)align);
    if (base == NULL) fatal("out of memory");
    uintptr_t data = (uintptr_t)(base + sizeof(MemInfo));
    if (align > 1 && data % align) data += align - data % align;
    MemInfo *mi = (MemInfo *)base;
    mi->refct = 1;
    mi->dtor = NULL;
    mi->dtor_info = NULL;
    mi->data = (void *)data;
    mi->size = size;
    mi->external_allocator = NULL;
    return mi;
}

void NRT_MemInfo_call_dtor(MemInfo *mi) {
    if (mi->dtor) mi->dtor(mi->data, mi->size, mi->dtor_info);
    free(mi);
}

void NRT_Free(void *ptr) { free(ptr); }

void *NRT_Allocate(size_t size) {
    void *ptr = malloc(size);
    if (ptr == NULL) fatal("out of memory");
    return ptr;
}

/* A reshape without a copy (numba calls it for arrays not known to be contiguous): the
   new strides, or 0 when the data cannot be viewed so. Dimensions of length 1 are dropped;
   then each run of old dimensions whose product matches a run of new ones must be
   contiguous in the given order, and the new run takes its strides from it. */
int numba_attempt_nocopy_reshape(intptr_t nd, const intptr_t *dims, const intptr_t *strides, intptr_t newnd,
                                 const intptr_t *newdims, intptr_t *newstrides, intptr_t itemsize, int is_f_order) {
    intptr_t od[64], os[64], n = 0;
    if (nd > 64) return 0;
    for (intptr_t i = 0; i < nd; i++) {
        if (dims[i] != 1) { od[n] = dims[i]; os[n] = strides[i]; n++; }
    }
    intptr_t oi = 0, oj = 1, ni = 0, nj = 1;
    while (ni < newnd && oi < n) {
        intptr_t a = newdims[ni], b = od[oi];
        while (a != b) {
            if (a < b) { if (nj >= newnd) return 0; a *= newdims[nj++]; }
            else { if (oj >= n) return 0; b *= od[oj++]; }
        }
        for (intptr_t k = oi; k < oj - 1; k++) {
            if (is_f_order ? os[k + 1] != od[k] * os[k] : os[k] != od[k + 1] * os[k + 1]) return 0;
        }
        if (is_f_order) {
            newstrides[ni] = os[oi];
            for (intptr_t k = ni + 1; k < nj; k++) newstrides[k] = newstrides[k - 1] * newdims[k - 1];
        } else {
            newstrides[nj - 1] = os[oj - 1];
            for (intptr_t k = nj - 1; k > ni; k--) newstrides[k - 1] = newstrides[k] * newdims[k];
        }
        ni = nj++;
        oi = oj++;
    }
    intptr_t last = itemsize;
    if (ni > 0) last = is_f_order ? newstrides[ni - 1] * newdims[ni - 1] : newstrides[ni - 1];
    for (intptr_t k = ni; k < newnd; k++) newstrides[k] = last;
    return 1;
}
"""
_PROVIDED = {"NRT_MemInfo_alloc_aligned", "NRT_MemInfo_call_dtor", "NRT_Free", "NRT_Allocate",
             "numba_attempt_nocopy_reshape"}
_SIGNATURE = "void(int64, int64)"

Entry = Callable[[int, int], None]
Sources = Callable[[], dict]  # () -> {entry name: Python function}, its globals bound for numba


class Entries(dict):
    """name -> entry(frame address, part), and where they come from (`route`)."""

    route: str = ""


def _cpu() -> str:
    """The CPU as the compiled code depends on it: machine, model and instruction flags."""
    parts = [platform.machine(), os.environ.get("NUMBA_CPU_NAME", ""), os.environ.get("NUMBA_CPU_FEATURES", "")]
    try:
        with open("/proc/cpuinfo") as handle:
            seen = set()
            for line in handle:
                key = line.split(":", 1)[0].strip()
                if key in ("model name", "flags", "Features", "CPU part") and key not in seen:
                    seen.add(key)
                    parts.append(line.strip())
    except OSError:
        parts.append(platform.processor())
    return "\n".join(parts)


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "-"


@lru_cache(maxsize=None)
def library_path(name: str) -> Path:
    """Where this version's library `name` for this CPU is (or will be) kept."""
    digest = hashlib.sha1()
    digest.update(kernels._sources_digest().encode())
    digest.update(f"{_version('numba')} {_version('llvmlite')} {sys.version_info[:2]}\n".encode())
    digest.update(_cpu().encode())
    return kernels._cache_folder().parent / "native" / digest.hexdigest()[:20] / f"libattnkit_{name}.so"


FASTMATH = {"reassoc", "contract", "nsz"}  # reorder sums; NaN and inf still propagate


def _callbacks(sources: Sources, cache: bool) -> dict:
    """The entries compiled by numba as C callbacks (`sources()` binds their loops first)."""
    nb = kernels.numba()
    return {name: nb.cfunc(_SIGNATURE, cache=cache, fastmath=FASTMATH, error_model="numpy")(fn)
            for name, fn in sources().items()}


def _compiler() -> str | None:
    """The C compiler that links the library, or None: Linux only (the library leaves the
    Python C API's symbols to the interpreter that loads it, as ELF allows)."""
    if not sys.platform.startswith("linux"):
        return None
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _build(target: Path, sources: Sources, compiler: str) -> None:
    """Compile the entries, emit their objects, link them with the runtime's C into `target`
    (written whole, then moved into place: a process never loads half a library)."""
    import llvmlite.binding as ll

    nb = kernels.numba()
    callbacks = _callbacks(sources, cache=False)
    cpu = nb.config.CPU_NAME or ll.get_host_cpu_name()
    features = nb.config.CPU_FEATURES or ll.get_host_cpu_features().flatten()
    machine = ll.Target.from_default_triple().create_target_machine(cpu=cpu, features=features, opt=3, reloc="pic",
                                                                   codemodel="default")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        folder = Path(work)
        objects, names, undefined = [], {}, set()
        for name, callback in callbacks.items():
            module = callback._library._final_module
            path = folder / f"{name}.o"
            path.write_bytes(machine.emit_object(module))
            objects.append(str(path))
            names[name] = callback.native_name
            undefined |= {f.name for f in module.functions if f.is_declaration and not f.name.startswith("llvm.")}
        stubs = sorted(s for s in undefined - _PROVIDED if s.startswith(("numba_", "NRT_")))
        runtime = _RUNTIME_C + "".join(f'void {s}(void) {{ fatal("{s} was called"); }}\n' for s in stubs)
        (folder / "runtime.c").write_text(runtime)
        built = folder / target.name
        result = subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(built), *objects,
                                 str(folder / "runtime.c"), "-lm"], capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"linking the native kernels with {compiler} failed: {result.stderr.strip()[-2000:]}")
        digest = hashlib.sha256(built.read_bytes()).hexdigest()
        (folder / "names.json").write_text(json.dumps({"entries": names, "sha256": digest}))
        os.replace(built, target)
        os.replace(folder / "names.json", target.with_suffix(".json"))  # last: the pair is complete


class _Damaged(Exception):
    """A library on disk that cannot be loaded as built (its bytes changed, a file missing)."""


def _load(target: Path) -> Entries:
    """The library's entries; `_Damaged` when its bytes are not the ones built (the digest
    beside it) or it does not load."""
    try:
        meta = json.loads(target.with_suffix(".json").read_text())
        if hashlib.sha256(target.read_bytes()).hexdigest() != meta["sha256"]:
            raise ValueError("its bytes are not the ones built")
        library = ctypes.CDLL(str(target))
        found = Entries()
        for name, symbol in meta["entries"].items():
            function = library[symbol]
            function.argtypes = (ctypes.c_int64, ctypes.c_int64)
            function.restype = None
            found[name] = function
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise _Damaged(f"{target}: {error}") from error
    try:
        os.utime(target.parent)  # in use: `_build_locked` removes the folders unused for a week
    except OSError:
        pass
    found.route = "library"
    found.library = library  # kept alive with the functions
    return found


def in_process(sources: Sources) -> Entries:
    """The entries as numba's in-process C callbacks (cached on disk by numba)."""
    found = Entries()
    for name, callback in _callbacks(sources, cache=True).items():
        function = callback.ctypes
        found[name] = function
    found.route = "in-process"
    return found


_loaded: dict[str, Entries] = {}
_loading = threading.Lock()


def entries(name: str, sources: Sources) -> Entries:
    """The entries of library `name` (see the module docstring): the library when it was
    built for this version and CPU (built now, once, when a C compiler is found), else
    numba's in-process callbacks. `sources` gives the entries' Python functions (only
    called to compile them). Only call when `attnkit.kernels.enabled()`."""
    found = _loaded.get(name)
    if found is not None:
        return found
    with _loading:
        if name not in _loaded:
            _loaded[name] = _entries(name, sources)
        return _loaded[name]


def _entries(name: str, sources: Sources) -> Entries:
    if not kernels.enabled():
        raise RuntimeError(f"compiled kernels are off: {kernels.reason_disabled()}")
    target = library_path(name)
    if os.environ.get(kernels._FORCE_VARIABLE, "").strip().lower() != "numba":
        damaged = ""
        if target.exists() or target.with_suffix(".json").exists():
            try:
                return _load(target)
            except _Damaged as error:
                damaged = str(error)
        compiler = _compiler()
        if compiler is not None:
            started = time.perf_counter()
            try:
                _build_locked(target, sources, compiler)
                found = _load(target)
            except (OSError, RuntimeError, _Damaged) as error:
                print(f"attnkit: the native kernels could not be built ({error}); numba runs them in-process",
                      file=sys.stderr)
            else:
                why = f"the library was damaged ({damaged}): rebuilt it" if damaged else "built the native kernels"
                print(f"attnkit: {why} ({name}) once for this CPU in {time.perf_counter() - started:.1f} s "
                      f"({target.parent})", file=sys.stderr)
                return found
        elif damaged:
            print(f"attnkit: the native kernels' library is damaged ({damaged}) and no C compiler rebuilds it; "
                  "numba runs them in-process", file=sys.stderr)
    return in_process(sources)


def _build_locked(target: Path, sources: Sources, compiler: str) -> None:
    """`_build`, one process at a time (another waiting for it then finds the library); a
    damaged library is removed first."""
    import fcntl

    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            try:
                _load(target)  # another process may have built it (or rebuilt a damaged one) meanwhile
                return
            except _Damaged:
                for path in (target, target.with_suffix(".json")):
                    path.unlink(missing_ok=True)
            _build(target, sources, compiler)
            kernels._remove_old_caches(target.parent)  # other versions' and CPUs', unused for a week
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


# ----------------------------------------------------------------------------- compiled helpers
# Intrinsics the entries use to reach their arrays (numba typing and LLVM IR).


def _pointer_intrinsic(dtype_name: str):
    """`ptr(address)` -> a typed C pointer to the array at `address` (for `numba.carray`)."""
    from numba import types
    from numba.extending import intrinsic

    element = getattr(types, dtype_name)

    def typing(typingctx, address):
        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(types.CPointer(element)))

        return types.CPointer(element)(types.int64), codegen

    return intrinsic(typing)


def _atomic_intrinsics() -> dict:
    """`_atomic_add(address, value)` -> the int64 before (sequentially consistent),
    `_atomic_load(address)` -> the int64 there (acquire), `_pause()` (x86's spin hint)."""
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    i64 = ir.IntType(64)

    def add_typing(typingctx, address, value):
        def codegen(context, builder, signature, args):
            pointer = builder.inttoptr(args[0], i64.as_pointer())
            return builder.atomic_rmw("add", pointer, args[1], "seq_cst")

        return types.int64(types.int64, types.int64), codegen

    def load_typing(typingctx, address):
        def codegen(context, builder, signature, args):
            pointer = builder.inttoptr(args[0], i64.as_pointer())
            return builder.load_atomic(pointer, "acquire", 8)

        return types.int64(types.int64), codegen

    def pause_typing(typingctx):
        def codegen(context, builder, signature, args):
            if platform.machine().lower() in ("x86_64", "amd64", "i686", "x86"):
                from numba.core import cgutils

                pause = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                       "llvm.x86.sse2.pause")
                builder.call(pause, [])
            return context.get_dummy_value()

        return types.none(), codegen

    return {"_atomic_add": intrinsic(add_typing), "_atomic_load": intrinsic(load_typing),
            "_pause": intrinsic(pause_typing)}


@lru_cache(maxsize=1)
def helpers() -> dict:
    """The intrinsics above by name (`_u8`, `_i8`, `_i32`, `_i64`, `_f32`, `_f64` pointers;
    atomics), bound into a kernel module's globals before it compiles."""
    found = {f"_{short}": _pointer_intrinsic(name) for short, name in
             (("u8", "uint8"), ("i8", "int8"), ("i32", "int32"), ("i64", "int64"), ("f32", "float32"),
              ("f64", "float64"))}
    found.update(_atomic_intrinsics())
    from numba import types
    from numba.core.types import ExternalFunction

    found["_sched_yield"] = ExternalFunction("sched_yield", types.int32())
    return found
