"""Building the native library: emit the entries' objects, link them with the C runtime,
keep a digest beside the library, one process at a time.

`library_path(name)` is where a library lives (named by a digest of the kernels' sources,
numba's and llvmlite's versions and the CPU); `build_locked` builds it under a file lock
(a process that waited finds the library the other built, and says so: "loaded");
`load` opens it with ctypes after checking its SHA-256. Linux on x86-64 only
(`supported()`): elsewhere the entries run as numba's in-process callbacks.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import importlib.resources
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Callable

from attnkit import kernels

__all__ = ["Damaged", "build_locked", "compiler", "library_path", "load", "supported"]

SIGNATURE = "void(int64, int64)"
FASTMATH = {"reassoc", "contract", "nsz"}  # reorder sums; NaN and inf still propagate
_PROVIDED = {"NRT_MemInfo_alloc_aligned", "NRT_MemInfo_call_dtor", "NRT_Free", "NRT_Allocate",
             "numba_attempt_nocopy_reshape", "attnkit_yield"}
"""What runtime.c defines; every other numba_ / NRT_ symbol is linked to `attnkit_missing`."""
_PLATFORMS = {("linux", "x86_64")}
"""Where the library is built and tested (the ELF link leaves the Python C API's symbols to
the interpreter that loads it; the tests run there)."""


def supported() -> bool:
    """Whether this platform builds the library (else numba's in-process callbacks run)."""
    system = "linux" if sys.platform.startswith("linux") else sys.platform
    return (system, platform.machine().lower()) in _PLATFORMS


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


def _sources_digest() -> str:
    """The compiled code's sources: attnkit.kernels (this package included) and
    attnkit.quant, whose loops the entries call."""
    digest = hashlib.sha1(kernels._sources_digest().encode())
    root = Path(__file__).resolve().parents[2]
    for path in sorted([*(root / "quant").glob("*.py"), *Path(__file__).parent.glob("*.py"),
                        Path(__file__).with_name("runtime.c")]):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


@lru_cache(maxsize=None)
def library_path(name: str) -> Path:
    """Where this version's library `name` for this CPU is (or will be) kept."""
    digest = hashlib.sha1()
    digest.update(_sources_digest().encode())
    digest.update(f"{_version('numba')} {_version('llvmlite')} {sys.version_info[:2]}\n".encode())
    digest.update(_cpu().encode())
    return kernels._cache_folder().parent / "native" / digest.hexdigest()[:20] / f"libattnkit_{name}.so"


def compiler() -> str | None:
    """The C compiler that links the library, or None (an unsupported platform, or none found)."""
    if not supported():
        return None
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _object_code(callback, machine) -> tuple[bytes, set[str]]:
    """The machine code of one compiled callback and the symbols it leaves undefined.

    numba has no public call that gives a compiled function's linked LLVM module; its public
    `inspect_llvm()` gives that module's text (the function and every function it calls,
    optimized), which llvmlite parses back into a module to emit."""
    import llvmlite.binding as ll

    module = ll.parse_assembly(callback.inspect_llvm())
    module.verify()
    undefined = {f.name for f in module.functions if f.is_declaration and not f.name.startswith("llvm.")}
    return machine.emit_object(module), undefined


def build(target: Path, callbacks: dict, cc: str) -> None:
    """Emit the callbacks' objects and link them with runtime.c into `target` (written
    whole, then moved into place: a process never loads half a library)."""
    import llvmlite.binding as ll

    nb = kernels.numba()
    cpu = nb.config.CPU_NAME or ll.get_host_cpu_name()
    features = nb.config.CPU_FEATURES or ll.get_host_cpu_features().flatten()
    machine = ll.Target.from_default_triple().create_target_machine(cpu=cpu, features=features, opt=3, reloc="pic",
                                                                   codemodel="default")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        folder = Path(work)
        objects, names, undefined = [], {}, set()
        for name, callback in callbacks.items():
            code, missing = _object_code(callback, machine)
            path = folder / f"{name}.o"
            path.write_bytes(code)
            objects.append(str(path))
            names[name] = callback.native_name
            undefined |= missing
        stubs = sorted(s for s in undefined - _PROVIDED if s.startswith(("numba_", "NRT_")))
        runtime = importlib.resources.files("attnkit.kernels.native").joinpath("runtime.c")
        with importlib.resources.as_file(runtime) as runtime_c:
            built = folder / target.name
            result = subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(built), *objects, str(runtime_c), "-lm",
                                     *(f"-Wl,--defsym,{s}=attnkit_missing" for s in stubs)],
                                    capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"linking the native kernels with {cc} failed: {result.stderr.strip()[-2000:]}")
        digest = hashlib.sha256(built.read_bytes()).hexdigest()
        (folder / "names.json").write_text(json.dumps({"entries": names, "sha256": digest}))
        os.replace(built, target)
        os.replace(folder / "names.json", target.with_suffix(".json"))  # last: the pair is complete


class Damaged(Exception):
    """A library on disk that cannot be loaded as built (its bytes changed, a file missing)."""


def load(target: Path) -> tuple[ctypes.CDLL, dict[str, Callable[[int, int], None]]]:
    """The library and its entries by name; `Damaged` when its bytes are not the ones built
    (the digest beside it) or it does not load."""
    try:
        meta = json.loads(target.with_suffix(".json").read_text())
        if hashlib.sha256(target.read_bytes()).hexdigest() != meta["sha256"]:
            raise ValueError("its bytes are not the ones built")
        library = ctypes.CDLL(str(target))
        found = {}
        for name, symbol in meta["entries"].items():
            function = library[symbol]
            function.argtypes = (ctypes.c_int64, ctypes.c_int64)
            function.restype = None
            found[name] = function
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise Damaged(f"{target}: {error}") from error
    try:
        os.utime(target.parent)  # in use: `build_locked` removes the folders unused for a week
    except OSError:
        pass
    return library, found


def build_locked(target: Path, callbacks: Callable[[], dict], cc: str) -> str:
    """`build`, one process at a time; a damaged library is removed first. Returns "built",
    or "loaded" when another process built it while this one waited for the lock."""
    import fcntl  # POSIX: `supported()` platforms only

    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            try:
                load(target)  # another process may have built it (or rebuilt a damaged one) meanwhile
                return "loaded"
            except Damaged:
                for path in (target, target.with_suffix(".json")):
                    path.unlink(missing_ok=True)
            build(target, callbacks(), cc)
            kernels._remove_old_caches(target.parent)  # other versions' and CPUs', unused for a week
            return "built"
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
