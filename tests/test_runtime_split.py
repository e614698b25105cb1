"""`attnkit.runtime` holds the machine only (CPUs, BLAS and worker threads, scratch memory):
optional packages are in `attnkit.extras`, deprecated spellings in `attnkit.deprecation`, and
the old `attnkit.runtime.<name>` spellings are the same objects until 0.3.0. The worker pool's
threads are named for what they do."""

from __future__ import annotations

import threading

import attnkit.deprecation as deprecation
import attnkit.extras as extras
import attnkit.runtime as runtime


def test_the_moved_names_are_aliases():
    for name in ("EXTRAS", "MissingExtraError", "require"):
        assert getattr(runtime, name) is getattr(extras, name)
    for name in ("REMOVED_IN", "keyword_only", "renamed_keyword"):
        assert getattr(runtime, name) is getattr(deprecation, name)


def test_runtime_exports_the_machine_only():
    assert not set(runtime.__all__) & {*extras.__all__, *deprecation.__all__}
    assert {"cpu_count", "worker_pool", "scratch_buffer", "blas_threads"} <= set(runtime.__all__)


def test_the_worker_pools_threads_say_they_are_workers():
    names = runtime.worker_pool(2).submit(lambda: threading.current_thread().name).result()
    assert names.startswith("attnkit-worker-2") and "flash" not in names
