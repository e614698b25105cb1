"""Gemma 3 on the compiled decode step (`attnkit.models.llama.step` with Gemma's flags)
against its module path.

A tiny random quantized Gemma 3 (Q8_0 embedding and tied head, Q5_0 / Q4_K / Q6_K / Q8_0
matrices, QK-norm, post-sublayer norms, tanh-GELU, one KV head, a window of 4 on local
layers, two rope bases, soft-capped logits): the compiled steps' logits within the
project's rule of a float64 run (twice the float32 module path's error plus a few ulps),
the module path's greedy tokens past the window, the same bits on 1 and 2 threads. The
embedded Gemma 3 270M (slow): 32 greedy tokens equal to the module path's.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from attnkit import kernels, quant
from attnkit.models.gemma3 import Gemma3Config, Gemma3ForCausalLM
from attnkit.models.llama import compiled_step_reason
from attnkit.nn.interface import intervene
from attnkit.quant.layers import QuantizedTensor
from attnkit.runtime import blas_threads

U = float(np.finfo(np.float32).eps) / 2
IDS = [2, 5, 40, 80, 17, 60, 9, 11, 13, 90, 19, 23, 29, 31]  # past the window of 4

pytestmark = pytest.mark.skipif(not kernels.enabled(), reason="the compiled step needs the kernels (numba)")

TYPES = {"attn.q_proj": "Q5_0", "attn.k_proj": "Q8_0", "attn.v_proj": "Q6_K", "attn.out_proj": "Q4_K",
         "mlp.gate_proj": "Q4_K", "mlp.up_proj": "Q5_0", "mlp.down_proj": "Q6_K"}


def _blocks(kind: str, weight: np.ndarray, rng) -> np.ndarray:
    """(rows, bytes) blocks of `kind`: gguf's quantizer where it has one, else random blocks
    (K-quants: random bits, small float16 scales)."""
    import gguf

    member = gguf.GGMLQuantizationType[kind]
    if kind in ("Q8_0", "Q5_0"):
        return gguf.quants.quantize(weight, member)
    rows, columns = weight.shape
    raw = rng.integers(0, 256, (rows, quant.row_bytes(kind, columns)), dtype=np.uint8)
    blocks = raw.reshape(rows, -1, quant.GGMLType[kind].type_size)
    for at in {"Q4_K": (0, 2), "Q6_K": (208,)}[kind]:
        scales = np.asarray(rng.standard_normal(blocks.shape[:2]) * 2e-4, np.float16)
        blocks[..., at:at + 2] = scales.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return raw


def _dequantized(raw: np.ndarray, kind: str, columns: int) -> np.ndarray:
    import gguf

    values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])
    return np.asarray(values, np.float32).reshape(raw.shape[0], columns)


@pytest.fixture(scope="module")
def tiny(gguf):
    """(quantized model, the same weights as float32 matrices, the quantized weights) of a tiny
    random Gemma 3."""
    config = Gemma3Config(vocab_size=96, hidden_size=256, intermediate_size=512, num_layers=7, num_heads=4,
                          num_kv_heads=1, head_dim=64, sliding_window=4, query_pre_attn_scalar=48.0,
                          max_position_embeddings=256, final_logit_softcapping=8.0)
    rng = np.random.default_rng(5)
    state = Gemma3ForCausalLM(config, seed=4).state_dict()
    blocks, floats = {}, {}
    for name, weight in state.items():
        weight = np.asarray(weight, np.float32)
        short = name.split(".", 2)[-1].rsplit(".", 1)[0]
        kind = "Q8_0" if name == "embed.weight" else TYPES.get(short)
        if kind is None:  # a norm
            blocks[name] = floats[name] = weight
            continue
        raw = _blocks(kind, weight, rng)
        blocks[name] = QuantizedTensor(raw, kind, weight.shape[1])
        floats[name] = _dequantized(raw, kind, weight.shape[1])
    return Gemma3ForCausalLM(config, weights=blocks), Gemma3ForCausalLM(config, weights=floats), blocks


@pytest.fixture
def calls(monkeypatch):
    """How many decode steps ran compiled."""
    from attnkit.models.llama import step

    count = [0]
    original = step.batch_step

    def counted(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(step, "batch_step", counted)
    return count


def stepwise(model, ids, *, watched=False):
    """Logits (T, V) of feeding `ids` a token a step through one cache (modules when watched)."""
    cache = model.new_cache(1, len(ids) + 1)
    rows = []
    for token in ids:
        if watched:
            with intervene({}):  # an open intervention: the layers run as modules
                rows.append(model(np.array([[token]]), cache=cache)[0, -1])
        else:
            rows.append(model(np.array([[token]]), cache=cache)[0, -1])
    return np.array(rows)


def test_gemma3_steps_within_the_rule_of_the_float64_model(tiny, calls):
    blocks, floats, _ = tiny
    assert compiled_step_reason(blocks) is None
    assert "GGUF's blocks" in compiled_step_reason(floats)
    truth = stepwise(Gemma3ForCausalLM(floats.config, weights=floats.state_dict()).astype(np.float64), IDS)
    fused = stepwise(blocks, IDS)
    assert calls[0] == len(IDS)
    modules = stepwise(blocks, IDS, watched=True)
    assert calls[0] == len(IDS), "an open intervention must run the modules"
    reference_error = np.abs(stepwise(floats, IDS) - truth).max()
    budget = 2 * reference_error + U * np.abs(truth).max() * 64
    for name, got in (("compiled", fused), ("modules", modules)):
        error = np.abs(got - truth).max()
        print(f"{name}: {error:.3g} (float32 reference {reference_error:.3g})")
        assert got.dtype == np.float32 and error <= budget, (name, error, reference_error)
    assert np.abs(fused).max() <= 8.0  # soft-capped


def test_gemma3_greedy_past_the_window_and_threads(tiny, calls):
    """The module path's greedy tokens (past the window: the local layers' band binds), and
    the same bits on 2 threads as on 1."""
    blocks, _, _ = tiny
    fused = blocks.generate(np.array(IDS[:3]), 24, stop=())
    assert calls[0] == 23
    with intervene({}):
        modules = blocks.generate(np.array(IDS[:3]), 24, stop=())
    np.testing.assert_array_equal(fused, modules)
    blocks.single_thread_decode = False
    with blas_threads(1):
        one = stepwise(blocks, IDS)
    with blas_threads(2):
        two = stepwise(blocks, IDS)
    np.testing.assert_array_equal(one, two)


def test_gemma3_window_binds_on_the_compiled_step(tiny, calls):
    """A wider window changes the compiled logits past the window (the band is applied, not
    the whole cache), and the step with the wider window still follows its module path."""
    blocks, _, weights = tiny
    narrow = stepwise(blocks, IDS)
    wide = Gemma3ForCausalLM(dataclasses.replace(blocks.config, sliding_window=64), weights=weights)
    wider = stepwise(wide, IDS)
    np.testing.assert_array_equal(narrow[:4], wider[:4])  # within the window: the same keys
    assert np.abs(narrow[6:] - wider[6:]).max() > 1e-3
    np.testing.assert_allclose(wider, stepwise(wide, IDS, watched=True), rtol=0, atol=1e-4 * np.abs(wider).max())


def test_gemma3_int8_steps_follow_the_int8_products(tiny, calls):
    """With `activations("int8")` the Q8_0 products (the key projections, the embedding's
    tied head) run on 8-bit activations in the step as in the modules: the compiled error
    from the float64 model within 2x the module path's int8 error (plus the float32 rule's),
    and above the float32 path's (the setting reached it)."""
    blocks, floats, _ = tiny
    truth = stepwise(Gemma3ForCausalLM(floats.config, weights=floats.state_dict()).astype(np.float64), IDS)
    float32_error = np.abs(stepwise(blocks, IDS) - truth).max()
    with quant.activations("int8"):
        fused = np.abs(stepwise(blocks, IDS) - truth).max()
        modules = np.abs(stepwise(blocks, IDS, watched=True) - truth).max()
    print(f"int8 error: compiled {fused:.3g}, modules {modules:.3g}; float32 {float32_error:.3g}")
    assert calls[0] == 2 * len(IDS)
    assert fused <= 2 * modules + 2 * float32_error
    assert fused > 4 * float32_error


def test_gemma3_batched_step_over_a_paged_cache(tiny):
    """`BatchStep` runs Gemma 3 compiled over a paged cache: a sequence fed as a prompt chunk,
    then a token a step, beside another sequence, gives the bits of its one-by-one steps on
    a contiguous cache (the batch invariance promise, windows and two rope tables included)."""
    from attnkit.models.llama import BatchStep, StepRow, new_cache

    blocks, _, _ = tiny
    cache = new_cache(blocks, tokens=64, block_size=4)
    batch = BatchStep(blocks, cache)
    assert batch.compiled, batch.reason
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.reserve(a, 5)
    cache.reserve(b, 3)
    got = [batch.run([StepRow(a, t, i == 4) for i, t in enumerate(IDS[:5])]
                     + [StepRow(b, t, i == 2) for i, t in enumerate(IDS[7:10])])[0]]
    for t, other in zip(IDS[5:], IDS[10:] * 3):
        cache.reserve(b, 1)
        cache.reserve(a, 1)
        got.append(batch.run([StepRow(b, other, True), StepRow(a, t, True)])[1])
    np.testing.assert_array_equal(np.array(got), stepwise(blocks, IDS)[4:])


@pytest.fixture(scope="module")
def gemma3_model(gemma3_file):
    from attnkit.models import AutoCausalLM

    return AutoCausalLM.from_pretrained("gemma3")


@pytest.mark.slow
def test_embedded_gemma3_32_greedy_tokens_equal_the_module_path(gemma3_model, calls):
    model = gemma3_model
    assert compiled_step_reason(model) is None, compiled_step_reason(model)
    ids = np.array(model.tokenizer.encode("The capital of France is"))
    fused = model.generate(ids, 32, stop=())
    assert calls[0] == 31
    with intervene({}):
        modules = model.generate(ids, 32, stop=())
    np.testing.assert_array_equal(fused, modules)
