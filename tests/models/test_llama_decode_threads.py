"""Quantized Llama models decoding at once, each step on three threads, finish with their solo
tokens (greedy, bit for bit).

A compiled decode step (`attnkit.models.llama.step`) runs as parts that meet at barriers, so
all of a step's parts must run at the same time. Two models stepping at once must never wait
for each other's threads: with one shared pool of workers, one step could hold the last free
worker while its parts spin for another step's, for ever. The scenario runs in a child process
with a time limit, so a deadlock is a failure, not a hung test run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from attnkit import kernels

pytestmark = [pytest.mark.skipif(not kernels.enabled(), reason="the compiled step needs the kernels (numba)"),
              pytest.mark.slow]

TESTS = Path(__file__).parents[1]  # tests/: the shared helpers

_CHILD = r"""
import hashlib, json, sys, threading
import numpy as np
sys.path.insert(0, sys.argv[3])
import attnkit.runtime
from attnkit.models.llama import LlamaForCausalLM, compiled_step_reason
from attnkit.runtime import blas_threads

attnkit.runtime.cpu_count = lambda: 8  # three parts a step on any machine (the step caps parts at the CPUs)
sys.setswitchinterval(1e-5)  # the threads take turns often: submissions of two steps interleave
PROMPTS = [[1, 5, 40, 80, 120, 9], [7, 9, 11, 13], [200, 160, 3, 17, 19, 23, 29]]
NEW = 12


def load(path):
    model = LlamaForCausalLM.from_gguf(path, quantized=True)
    model.single_thread_decode = False  # every step on the BLAS limit's threads: 3 parts
    assert compiled_step_reason(model) is None, compiled_step_reason(model)
    return model


def greedy(model, prompt):
    # greedy tokens and a digest of every step's logits, the prompt fed a token a step too
    # (every step one compiled call)
    cache = model.new_cache(1, len(prompt) + NEW)
    digest, tokens = hashlib.sha1(), []
    for token in prompt:
        logits = model(np.array([[token]]), cache=cache)
    for _ in range(NEW):
        digest.update(logits.tobytes())
        tokens.append(int(np.argmax(logits[0, -1])))
        logits = model(np.array([[tokens[-1]]]), cache=cache)
    return [tokens, digest.hexdigest()]


with blas_threads(3):
    models = [load(sys.argv[1]), load(sys.argv[2])]
    solo = [[greedy(model, p) for p in PROMPTS] for model in models]
    together = {}

    def run(m, t):
        # three threads a model, each its own prompt, twice round
        together[m, t] = [greedy(models[m], PROMPTS[(t + r) % 3]) for r in range(2)]

    threads = [threading.Thread(target=run, args=(m, t)) for m in range(2) for t in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
print(json.dumps({"solo": solo, "together": {f"{m} {t}": v for (m, t), v in together.items()}}))
"""


@pytest.fixture(scope="module")
def two_models(tmp_path_factory, gguf):
    """Two different tiny Llama GGUFs (Q8_0, Q4_1, F16 and F32 matrices)."""
    sys.path.insert(0, str(TESTS))
    from tiny_checkpoints import tiny_llama, write_tiny_llama_gguf

    folder = tmp_path_factory.mktemp("llama_threads")
    paths = []
    for seed in (0, 1):
        path = folder / f"tiny{seed}.gguf"
        write_tiny_llama_gguf(path, tiny_llama(seed))
        paths.append(path)
    return paths


def test_two_models_on_three_threads_each_keep_their_solo_tokens(two_models):
    """Two models, three caller threads each (every step split in three parts): every
    sequence's greedy tokens and every step's logits are the bits it gets alone, and nothing
    waits for ever."""
    command = [sys.executable, "-c", _CHILD, *map(str, two_models), str(TESTS)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=dict(os.environ))
    except subprocess.TimeoutExpired:
        pytest.fail("two models' threaded decode steps never finished (their parts waited for each other's workers)")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    solo = report["solo"]
    assert solo[0][0][1] != solo[1][0][1], "the two models should differ (else the test proves less)"
    for key, runs in report["together"].items():
        m, t = map(int, key.split())
        for r, tokens in enumerate(runs):
            assert tokens == solo[m][(t + r) % 3], (m, t, r)


def test_a_step_does_not_wait_for_the_shared_workers(two_models, monkeypatch):
    """A threaded step runs its parts on threads of its own: while every worker of the
    process's shared pools is busy (another model's work, a flash attention), the step still
    finishes, with the bits of a step taken while they are free."""
    import threading

    import numpy as np

    import attnkit.runtime
    from attnkit.models.llama import LlamaForCausalLM
    from attnkit.runtime import blas_threads, worker_pool

    monkeypatch.setattr(attnkit.runtime, "cpu_count", lambda: 8)
    model = LlamaForCausalLM.from_gguf(two_models[0], quantized=True)
    model.single_thread_decode = False

    def step():
        return model(np.array([[5]]), cache=model.new_cache(1, 1))

    with blas_threads(3):
        free = step()
        release = threading.Event()
        busy = [worker_pool(n).submit(release.wait, 120) for n in (1, 2, 3) for _ in range(n)]
        got = []
        runner = threading.Thread(target=lambda: got.append(step()), daemon=True)
        try:
            runner.start()
            runner.join(timeout=30)
            finished = not runner.is_alive()
        finally:
            release.set()
            runner.join(timeout=120)
            for task in busy:
                task.result(timeout=120)
    assert finished, "the step waited for the shared pool's workers"
    np.testing.assert_array_equal(got[0], free)
