"""The compiled decode step (`attnkit.models.llama.step`) against the module path.

A quantized Llama model's decode steps run in one compiled call when nothing watches the
layers (`attnkit.models.llama.compiled_step_reason` says when not). Its logits are held to the float64 model by the
project's rule (at most twice the float32 reference's error, plus the block kernels'
rounding), the same greedy tokens as the module path, the same bits at 1 and 2 threads,
and every case it must leave to the modules (recording, interventions, padding after a real token,
a replaced buffer, a replaced weight, a custom backend) is checked to run there.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from attnkit import kernels
from attnkit.nn.interface import intervene, record_attention
from attnkit.runtime import blas_threads

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: the shared helpers

U = float(np.finfo(np.float32).eps) / 2
IDS = [1, 5, 40, 80, 120, 160, 200, 7, 9, 11, 13, 17, 19, 23, 29]

pytestmark = pytest.mark.skipif(not kernels.enabled(), reason="the compiled step needs the kernels (numba)")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, gguf):
    from tiny_checkpoints import write_tiny_llama_gguf

    path = tmp_path_factory.mktemp("fused") / "tiny.gguf"
    write_tiny_llama_gguf(path)
    return path


@pytest.fixture
def calls(monkeypatch):
    """How many decode steps ran compiled (every one is a `batch_step`, one sequence's too)."""
    from attnkit.models.llama import step

    count = [0]
    original = step.batch_step

    def counted(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(step, "batch_step", counted)
    return count


def stepwise(model, ids, *, watched=False):
    """Logits (T, V) of feeding `ids` a token a step through one cache (module path when watched)."""
    cache = model.new_cache(1, len(ids) + 1)
    rows = []
    for token in ids:
        if watched:
            with intervene({}):  # an open intervention: the layers run as modules
                rows.append(model(np.array([[token]]), cache=cache)[0, -1])
        else:
            rows.append(model(np.array([[token]]), cache=cache)[0, -1])
    return np.array(rows)


def test_steps_within_the_rule_of_the_float64_model(tiny_gguf, calls):
    """Q8_0, Q4_1, F16 and F32 matrices, permuted query/key rows: the compiled steps' logits
    within 2x the float32 reference's error of the float64 model (plus the block kernels'
    rounding), as the module path on the same blocks."""
    from attnkit.models.llama import LlamaForCausalLM

    blocks = LlamaForCausalLM.from_gguf(tiny_gguf, quantized=True)
    reference = LlamaForCausalLM.from_gguf(tiny_gguf, quantized=False)
    truth = stepwise(LlamaForCausalLM.from_gguf(tiny_gguf, quantized=False).astype(np.float64), IDS)
    fused = stepwise(blocks, IDS)
    assert calls[0] == len(IDS)
    modules = stepwise(blocks, IDS, watched=True)
    assert calls[0] == len(IDS), "an open intervention must run the modules"
    reference_error = np.abs(stepwise(reference, IDS) - truth).max()
    budget = 2 * reference_error + U * np.abs(truth).max() * 64
    for name, got in (("compiled", fused), ("modules", modules)):
        error = np.abs(got - truth).max()
        print(f"{name}: {error:.3g} (float32 reference {reference_error:.3g})")
        assert got.dtype == np.float32 and error <= budget, (name, error, reference_error)


def test_greedy_tokens_and_threads(tiny_gguf, calls):
    """`generate` through the compiled steps gives the module path's tokens; 2 threads give
    the bits of 1 (every output row is computed whole by one thread)."""
    from attnkit.models.llama import LlamaForCausalLM

    model = LlamaForCausalLM.from_gguf(tiny_gguf, quantized=True)
    fused = model.generate(np.array(IDS), 24, stop=())
    assert calls[0] == 23
    with intervene({}):
        modules = model.generate(np.array(IDS), 24, stop=())
    np.testing.assert_array_equal(fused, modules)
    model.single_thread_decode = False
    with blas_threads(1):
        one = stepwise(model, IDS)
    with blas_threads(2):
        two = stepwise(model, IDS)
    np.testing.assert_array_equal(one, two)


def test_what_the_modules_must_run(tiny_gguf, calls):
    """Recording, interventions, a replaced cache buffer and a custom backend run the
    modules; the results are the modules' own. A batch and left padding run compiled."""
    from attnkit.models.llama import LlamaForCausalLM

    model = LlamaForCausalLM.from_gguf(tiny_gguf, quantized=True)
    layers = model.config.num_layers
    cache = model.new_cache(1, 8)
    model(np.array([IDS[:3]]), cache=cache)
    with record_attention(model) as maps:
        model(np.array([[IDS[3]]]), cache=cache)
    assert calls[0] == 0 and len(maps) == layers and maps[0].shape[-1] == 4
    # an edit changes the step's output: it must have run
    head = model.layers[0].attn
    baseline = model(np.array([[IDS[4]]]), cache=model.new_cache(1, 2))
    with intervene({head: lambda call: np.zeros_like(call.output)}):
        edited = model(np.array([[IDS[4]]]), cache=model.new_cache(1, 2))
    assert calls[0] == 1 and not np.array_equal(edited, baseline)
    # two sequences (left-padded), then a left-padded one: compiled
    model.generate([IDS[:4], IDS[:6]], 3, stop=())
    assert calls[0] == 1 + 2
    before = calls[0]
    cache = model.new_cache(1, 8)
    model(np.array([[0, IDS[0], IDS[1]]]), attention_mask=np.array([[0, 1, 1]]), cache=cache)
    model(np.array([[IDS[2]]]), cache=cache)
    assert calls[0] == before + 1, "a left-padded cache runs compiled"
    before = calls[0]
    cache = model.new_cache(1, 8)
    model(np.array([IDS[:2]]), cache=cache)
    cache.keys[0] = cache.keys[0].copy()
    model(np.array([[IDS[2]]]), cache=cache)
    assert calls[0] == before
    model.layers[1].attn.backend = "flash"  # a built-in exact backend: still compiled
    model(np.array([[IDS[0]]]), cache=model.new_cache(1, 1))
    assert calls[0] == before + 1


def test_a_replaced_weight_is_used(tiny_gguf, calls):
    """Replacing a norm's weight reaches the compiled step (parameters are read-only arrays,
    so a replacement is the only change there is)."""
    from attnkit.models.llama import LlamaForCausalLM

    model = LlamaForCausalLM.from_gguf(tiny_gguf, quantized=True)
    first = stepwise(model, IDS[:4])
    model.layers[0].mlp_norm.weight = model.layers[0].mlp_norm.weight * 2
    stepwise(model, IDS[:4])
    model.layers[1].attn_norm.weight = model.layers[1].attn_norm.weight * 0.5  # after a step read the arrays
    fused = stepwise(model, IDS[:4])
    modules = stepwise(model, IDS[:4], watched=True)
    assert not np.allclose(first, fused)
    np.testing.assert_allclose(fused, modules, rtol=0, atol=1e-4 * np.abs(modules).max())
    # written into the mappings directly, not through an attribute
    norm = model.layers[1].mlp_norm
    norm._parameters["weight"] = np.full_like(norm.weight, 3.0)
    fused = stepwise(model, IDS[:4])
    np.testing.assert_allclose(fused, stepwise(model, IDS[:4], watched=True), rtol=0, atol=1e-4 * np.abs(fused).max())
    swapped = LlamaForCausalLM.from_gguf(tiny_gguf, quantized=True)
    swapped.layers._modules["1"] = model.layers[1]  # a block of the changed model
    fused = stepwise(swapped, IDS[:4])
    np.testing.assert_allclose(fused, stepwise(swapped, IDS[:4], watched=True), rtol=0, atol=1e-4 * np.abs(fused).max())
    assert not np.allclose(fused, stepwise(LlamaForCausalLM.from_gguf(tiny_gguf, quantized=True), IDS[:4]))


def test_steps_do_not_walk_the_modules_again(tiny_gguf, monkeypatch):
    """While no module changes (`structure_version()` stays put), a step takes the frame
    without reading its links again; after any change it reads them once; a model found not
    eligible is asked again only after a change (a custom backend set back to "naive")."""
    from attnkit.functional import ATTENTION_BACKENDS, get_attention, register_attention
    from attnkit.models.llama import LlamaForCausalLM, compiled_step_reason, fused

    walks = {"links": 0, "sources": 0}
    unchanged, walk = fused._Prepared.unchanged, fused._walk

    def counted_unchanged(*args):
        walks["links"] += 1
        return unchanged(*args)

    def counted_walk(*args):
        walks["sources"] += 1
        return walk(*args)

    monkeypatch.setattr(fused._Prepared, "unchanged", counted_unchanged)
    monkeypatch.setattr(fused, "_walk", counted_walk)
    model = LlamaForCausalLM.from_gguf(tiny_gguf, quantized=True)
    model.generate(np.array(IDS), 12, stop=())
    assert walks == {"links": 0, "sources": 1}
    model.layers[0].attn.note = "a change somewhere"
    model.generate(np.array(IDS), 12, stop=())
    assert walks == {"links": 1, "sources": 1}
    naive = get_attention("naive")
    register_attention("custom_for_walks", lambda q, k, v, **options: naive(q, k, v, **options))
    try:
        model.layers[1].attn.backend = "custom_for_walks"
        model.generate(np.array(IDS), 12, stop=())
        assert walks["sources"] == 2 and walks["links"] == 2  # walked once, found not eligible, kept
        assert "custom_for_walks" in compiled_step_reason(model)
        model.layers[1].attn.backend = "naive"
        model.generate(np.array(IDS), 12, stop=())
        assert walks["sources"] == 3
        assert compiled_step_reason(model) is None
    finally:
        ATTENTION_BACKENDS.pop("custom_for_walks", None)


def test_int8_steps_follow_the_int8_products(tiny_gguf, calls):
    """With `activations("int8")` the compiled step runs the 8-bit products: its error from
    the float64 model is of the module path's int8 size (within 2x of it, plus the float32
    rule), and far above the float32 path's on this model (so the setting reached it)."""
    from attnkit import quant
    from attnkit.models.llama import LlamaForCausalLM

    model = LlamaForCausalLM.from_gguf(tiny_gguf, quantized=True)
    truth = stepwise(LlamaForCausalLM.from_gguf(tiny_gguf, quantized=False).astype(np.float64), IDS)
    float32_error = np.abs(stepwise(model, IDS) - truth).max()
    with quant.activations("int8"):
        fused = np.abs(stepwise(model, IDS) - truth).max()
        modules = np.abs(stepwise(model, IDS, watched=True) - truth).max()
    print(f"int8 error: compiled {fused:.3g}, modules {modules:.3g}; float32 {float32_error:.3g}")
    assert calls[0] == 3 * len(IDS) - len(IDS)
    assert fused <= 2 * modules + 2 * float32_error
    assert fused > 10 * float32_error


def test_cli_generate_int8(tiny_gguf, monkeypatch):
    """`attnkit generate --int8` decodes with the 8-bit products (its text is what `generate`
    gives under `activations("int8")`); without the kernels it says so and runs float32."""
    from typer.testing import CliRunner

    from attnkit import kernels as kernels_module
    from attnkit.cli import app
    from attnkit import quant
    from attnkit.models.llama import LlamaForCausalLM

    model = LlamaForCausalLM.from_gguf(tiny_gguf)
    prompt = model.tokenizer.decode(IDS[1:8])
    ids = model.tokenizer.encode(prompt)
    with quant.activations("int8"):
        expected = model.tokenizer.decode(model.generate(ids, 6, stop=())[len(ids):])
    result = CliRunner().invoke(app, ["generate", prompt, "--model", str(tiny_gguf), "-n", "6", "--int8"])
    assert result.exit_code == 0, result.output
    assert expected.strip() and expected.strip() in result.stdout
    assert quant.current_activations() == "float32"  # the setting ends with the command
    monkeypatch.setattr(kernels_module, "reason_disabled", lambda: "numba is not installed")
    result = CliRunner().invoke(app, ["generate", prompt, "--model", str(tiny_gguf), "-n", "2", "--int8"])
    assert result.exit_code == 0 and "--int8 has no effect: numba is not installed" in result.stderr


def test_compiled_step_reason_names_what_sends_a_step_to_the_modules(tiny_gguf):
    """One function answers whether a step runs compiled, and says why not."""
    from attnkit.models.llama import LlamaForCausalLM, compiled_step_reason

    model = LlamaForCausalLM.from_gguf(tiny_gguf, quantized=True)
    one, at0 = np.array([[IDS[0]]]), np.array([[0]])
    assert compiled_step_reason(model, one, at0, model.new_cache(1, 4)) is None
    assert compiled_step_reason(model, np.array([[1], [2]]), np.array([[0], [0]]), model.new_cache(2, 4)) is None
    assert "one token of each sequence" in compiled_step_reason(model, np.array([[1, 2]]), at0)
    assert "holds 2 sequences, the step 1" in compiled_step_reason(model, one, at0, model.new_cache(2, 4))
    padded = model.new_cache(1, 4)
    padded.add_padding(np.array([[False]]))
    assert "not left padding" in compiled_step_reason(model, one, at0, padded)
    replaced = model.new_cache(1, 4)
    replaced.values[1] = replaced.values[1].copy()
    assert "KVCache.stores" in compiled_step_reason(model, one, at0, replaced)
    assert "positions [3]" in compiled_step_reason(model, one, np.array([[3]]), model.new_cache(1, 4))
    with record_attention(model):
        assert "watches the layers" in compiled_step_reason(model, one, at0)
    assert "GGUF's blocks" in compiled_step_reason(LlamaForCausalLM.from_gguf(tiny_gguf, quantized=False))


# ----------------------------------------------------------------------------- sliding windows

WINDOW = 4  # shorter than IDS (15 tokens): the band drops keys on the later steps


def with_windows(model, layer_types):
    """`model` (quantized) with a sliding window of WINDOW on the layers `layer_types` names
    "sliding_attention" (a tiny Mistral, or a Qwen2 with sliding layers, on the same blocks)."""
    from dataclasses import replace

    from attnkit.models.llama import QuantizedSlidingWindowSelfAttention

    for block, kind in zip(model.layers, layer_types):
        if kind == "sliding_attention":
            a = block.attn
            block.attn = QuantizedSlidingWindowSelfAttention(
                a.q_proj, a.k_proj, a.v_proj, a.out_proj, num_heads=a.num_heads, num_kv_heads=a.num_kv_heads,
                head_dim=a.head_dim, window=WINDOW)
    model.config = replace(model.config, sliding_window=WINDOW, layer_types=tuple(layer_types))
    return model


@pytest.mark.parametrize("layer_types", [("sliding_attention", "sliding_attention"),
                                         ("sliding_attention", "full_attention")], ids=["mistral", "per-layer"])
def test_sliding_windows_run_compiled(tiny_gguf, calls, layer_types):
    """A model with sliding windows (every layer, as Mistral; or some, as Qwen2) decodes on
    the compiled step: its logits within the float32 rule of the float64 windowed model, as
    the module path's on the same blocks, and far from the same model without windows."""
    from attnkit.models.llama import LlamaForCausalLM, compiled_step_reason

    model = with_windows(LlamaForCausalLM.from_gguf(tiny_gguf, quantized=True), layer_types)
    assert compiled_step_reason(model, np.array([[IDS[0]]]), np.array([[0]]), model.new_cache(1, 4)) is None
    float32 = LlamaForCausalLM.from_gguf(tiny_gguf, quantized=False)
    windowed = LlamaForCausalLM(model.config, seed=0)
    windowed.load_state_dict(float32.state_dict())
    assert type(windowed.layers[0].attn).__name__ == "SlidingWindowSelfAttention"
    truth = stepwise(windowed.astype(np.float64), IDS)
    fused = stepwise(model, IDS)
    assert calls[0] == len(IDS)
    modules = stepwise(model, IDS, watched=True)
    assert calls[0] == len(IDS)
    reference_error = np.abs(stepwise(windowed, IDS) - truth).max()
    budget = 2 * reference_error + U * np.abs(truth).max() * 64
    for name, got in (("compiled", fused), ("modules", modules)):
        error = np.abs(got - truth).max()
        print(f"{name}: {error:.3g} (float32 reference {reference_error:.3g})")
        assert error <= budget, (name, error, reference_error)
    np.testing.assert_allclose(fused[:WINDOW], stepwise(LlamaForCausalLM.from_gguf(tiny_gguf, quantized=True),
                                                        IDS[:WINDOW]), rtol=0, atol=budget)
    unwindowed = stepwise(LlamaForCausalLM.from_gguf(tiny_gguf, quantized=True), IDS)
    assert np.abs(unwindowed[WINDOW:] - fused[WINDOW:]).max() > 100 * budget  # the window was applied


def test_sliding_windows_greedy_and_threads(tiny_gguf, calls):
    """`generate` past the window on the compiled step gives the module path's tokens, and
    2 threads the bits of 1."""
    from attnkit.models.llama import LlamaForCausalLM

    model = with_windows(LlamaForCausalLM.from_gguf(tiny_gguf, quantized=True), ("sliding_attention",) * 2)
    fused = model.generate(np.array(IDS), 12, stop=())
    assert calls[0] == 11
    with intervene({}):
        modules = model.generate(np.array(IDS), 12, stop=())
    np.testing.assert_array_equal(fused, modules)
    model.single_thread_decode = False
    with blas_threads(1):
        one = stepwise(model, IDS)
    with blas_threads(2):
        two = stepwise(model, IDS)
    np.testing.assert_array_equal(one, two)


def test_a_changed_window_is_used(tiny_gguf, calls):
    """Setting a layer's `window` reaches the compiled step (the frame is built again)."""
    from attnkit.models.llama import LlamaForCausalLM

    model = with_windows(LlamaForCausalLM.from_gguf(tiny_gguf, quantized=True), ("sliding_attention",) * 2)
    before = stepwise(model, IDS)
    for block in model.layers:
        block.attn.window = 7
    after = stepwise(model, IDS)
    assert calls[0] == 2 * len(IDS)
    np.testing.assert_allclose(after, stepwise(model, IDS, watched=True), rtol=0, atol=1e-4 * np.abs(after).max())
    assert not np.allclose(before[7:], after[7:])
