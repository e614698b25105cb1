"""`attnkit.quant.activations("int8")` is scoped to the calling thread (a ContextVar): a
thread generating on 8-bit activations never changes what another thread running the same
model in float32 computes."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: the shared helpers

IDS = np.array([[1, 5, 40, 80, 120]])


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, gguf):
    from tiny_checkpoints import write_tiny_llama_gguf

    from attnkit.models.llama import LlamaForCausalLM

    path = tmp_path_factory.mktemp("activations") / "tiny.gguf"
    write_tiny_llama_gguf(path)
    return LlamaForCausalLM.from_gguf(path, quantized=True)


def test_int8_in_one_thread_leaves_another_threads_float32_alone(tiny_model):
    """Thread 1 holds `activations("int8")` open (and runs int8 products) for the whole time
    thread 2 runs the model in float32: thread 2's logits are its solo float32 logits, bit
    for bit, and thread 1 sees "int8" throughout."""
    from attnkit import kernels, quant

    solo = tiny_model(IDS)  # (1, T, V): T <= DECODE_ROWS, the decode products (int8 applies)
    with quant.activations("int8"):
        solo_int8 = tiny_model(IDS)
    if kernels.enabled():
        assert not np.array_equal(solo, solo_int8), "int8 products should change the logits here"
    inside, finished = threading.Event(), threading.Event()
    seen, results, errors = [], [], []

    def int8_thread() -> None:
        try:
            with quant.activations("int8"):
                inside.set()
                while not finished.is_set():
                    seen.append(quant.current_activations())
                    tiny_model(IDS)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)
            inside.set()

    def float32_thread() -> None:
        try:
            inside.wait(30)
            for _ in range(5):
                results.append((quant.current_activations(), tiny_model(IDS)))
        except Exception as error:  # noqa: BLE001
            errors.append(error)
        finally:
            finished.set()

    threads = [threading.Thread(target=int8_thread), threading.Thread(target=float32_thread)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    assert seen and set(seen) == {"int8"}
    assert len(results) == 5
    for _, logits in results:
        np.testing.assert_array_equal(logits, solo)
    assert [kind for kind, _ in results] == ["float32"] * 5
    assert quant.current_activations() == "float32"


def test_activations_rejects_other_kinds():
    from attnkit import quant

    with pytest.raises(ValueError, match='expected activations "int8" or "float32", got \'int4\''):
        with quant.activations("int4"):
            pass
