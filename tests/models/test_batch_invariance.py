"""Batch invariance of `attnkit.models.llama.batch.BatchStep`, bit for bit.

The promise (docs/batching.md): on the compiled path a row's logits are the same bits
whatever else is in the step (other sequences, their number and order, the row's position
in the batch), however its sequence's earlier tokens were fed (one by one, in chunks of any
size, or attached from the prefix cache by `match_prefix`), and on any thread count. Each
scenario below draws arrival orders, batch mixes, chunk sizes and thread counts at random
and compares every row with the same sequence fed alone, one token a step, through the same
kind of step (np.array_equal: no tolerance).

The module fallback (kernels off) keeps what it can: a sequence fed one token a step gives
the same bits whatever else is in the step (each sequence runs alone through the modules).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from attnkit.models.llama.batch import BatchStep, StepRow, new_cache

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: the shared helpers

SHARED = [1, 5, 40, 80, 120, 160, 200, 7, 9]  # a "system prompt": two full blocks of 4 and one token
PROMPTS = [SHARED + [11, 13, 17], SHARED + [19, 23], [29, 31, 37, 41, 43, 47, 53], SHARED + [59, 61, 67, 71, 73],
           [2, 3], [79, 83, 89, 97, 101, 103, 107, 109, 113, 127, 131, 137]]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, gguf):
    from tiny_checkpoints import write_tiny_llama_gguf

    path = tmp_path_factory.mktemp("invariance") / "tiny.gguf"
    write_tiny_llama_gguf(path)
    return path


def solo(model, prompt, block_size):
    """(T, V) logits of `prompt` fed alone, one token a step, through a fresh cache."""
    cache = new_cache(model, tokens=len(prompt) + block_size, block_size=block_size)
    step = BatchStep(model, cache, threads=1)
    seq = cache.add_sequence()
    rows = []
    for token in prompt:
        cache.reserve(seq, 1)
        rows.append(step.run([StepRow(seq, token, True)])[0])
    return np.array(rows), step.compiled


def scenario(model, prompts, rng, *, block_size, threads, chunks, share):
    """Feed `prompts` through one cache as a scheduler might: sequences arrive at random
    steps; each step takes every running sequence in a random order, each a chunk of 1 ..
    `chunks` tokens; `share`: an earlier request computed SHARED, and each sequence first
    attaches what the prefix cache holds.
    Returns {prompt index: {position: logits}}."""
    cache = new_cache(model, tokens=sum(map(len, prompts)) + 8 * block_size, block_size=block_size)
    step = BatchStep(model, cache, threads=threads)
    if share:  # an earlier request left the shared prefix's blocks in the cache
        earlier = cache.add_sequence()
        cache.reserve(earlier, len(SHARED))
        step.run([StepRow(earlier, t, False) for t in SHARED])
        cache.free(earlier)
    arrival = {i: int(rng.integers(0, 4)) for i in range(len(prompts))}
    running, done, got = {}, {}, {i: {} for i in range(len(prompts))}
    tick = 0
    while len(done) < len(prompts):
        for i in [i for i, at in arrival.items() if at == tick]:
            seq = cache.add_sequence()
            start = cache.match_prefix(seq, prompts[i]) if share else 0
            running[i] = (seq, start)
        order = list(running)
        rng.shuffle(order)
        rows, owners = [], []
        for i in order:
            seq, at = running[i]
            take = int(rng.integers(1, chunks + 1))
            part = prompts[i][at:at + take]
            cache.reserve(seq, len(part))
            rows += [StepRow(seq, t, True) for t in part]
            owners += [(i, at + k) for k in range(len(part))]
            running[i] = (seq, at + len(part))
        if rows:
            for (i, position), logits in zip(owners, step.run(rows)):
                got[i][position] = logits
        for i in [i for i, (seq, at) in running.items() if at == len(prompts[i])]:
            cache.free(running.pop(i)[0])
            done[i] = True
        tick += 1
    return got, step


@pytest.mark.parametrize("model_name", ["tiny", pytest.param("smollm2", marks=pytest.mark.slow)])
def test_rows_are_the_same_bits_as_alone(model_name, request, tiny_gguf):
    from attnkit.models.llama import LlamaForCausalLM

    if model_name == "tiny":
        model = LlamaForCausalLM.from_gguf(tiny_gguf, quantized=True)
        block_size = 4
    else:
        from attnkit.models import AutoCausalLM

        request.getfixturevalue("smollm2_file")
        model = AutoCausalLM.from_pretrained("smollm2")
        block_size = 4
    alone = {}
    for i, prompt in enumerate(PROMPTS):
        alone[i], compiled = solo(model, prompt, block_size)
    if not compiled:
        pytest.skip("the compiled step does not run here (kernels off): its bit-for-bit promise is not tested")
    rng = np.random.default_rng(43)
    for trial in range(6):
        threads = [1, 2][trial % 2]
        chunks = [1, 3, 8][trial % 3]
        share = trial >= 2
        got, step = scenario(model, PROMPTS, rng, block_size=block_size, threads=threads, chunks=chunks, share=share)
        assert step.compiled
        checked = 0
        for i, rows in got.items():
            for position, logits in rows.items():
                assert np.array_equal(logits, alone[i][position]), (
                    f"trial {trial} (threads {threads}, chunks <= {chunks}, prefix cache {share}): prompt {i} "
                    f"position {position} differs by {np.abs(logits - alone[i][position]).max():.3g}")
                checked += 1
        expected = sum(map(len, PROMPTS))
        assert checked <= expected and (share or checked == expected)
        if share:
            assert checked < expected  # the shared prefix was attached, not computed


def test_module_fallback_keeps_each_sequence_alone(tiny_gguf):
    """Kernels off or on: a float model runs the modules; fed one token a step, a sequence's
    rows are the same bits whatever else is in the step (each sequence runs alone)."""
    from attnkit.models.llama import LlamaForCausalLM

    model = LlamaForCausalLM.from_gguf(tiny_gguf, quantized=False)
    alone = {i: solo(model, prompt, 4)[0] for i, prompt in enumerate(PROMPTS[:4])}
    got, step = scenario(model, PROMPTS[:4], np.random.default_rng(7), block_size=4, threads=1, chunks=1,
                         share=False)
    assert not step.compiled
    for i, rows in got.items():
        for position, logits in rows.items():
            assert np.array_equal(logits, alone[i][position]), (i, position)
