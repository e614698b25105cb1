"""attnkit.interpret: the intervention mechanism, and every function against a float64
reference written from its definition (brute force, or from transformers' hidden states).

The TransformerLens comparisons are in test_interpret_tl.py; the real SmolLM2 at the end.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from conftest import assert_within_budget

from attnkit.interpret import (
    ablate,
    detect_heads,
    direct_logit_attribution,
    induction_scores,
    logit_lens,
    patch_heads,
    patch_residual,
    query_key_contributions,
    sink_scores,
    value_weighted,
)
from attnkit.models.gpt2 import GPT2Config, GPT2LMHeadModel
from attnkit.models.llama import LlamaConfig, LlamaForCausalLM
from attnkit.nn.interface import intervene, record_attention


def _gpt2(dtype=np.float32):
    config = GPT2Config(vocab_size=61, hidden_size=32, num_layers=3, num_heads=4, intermediate_size=48,
                        max_position_embeddings=64)
    model = GPT2LMHeadModel(config, seed=3)
    _sharpen(model)
    return model.astype(dtype)


def _llama(dtype=np.float32):
    config = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                         num_kv_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False)
    model = LlamaForCausalLM(config, seed=3)
    _sharpen(model)
    return model.astype(dtype)


def _sharpen(model):
    """Random norms and biases (not 1 and 0), so that every term of every formula counts."""
    rng = np.random.default_rng(7)
    state = {}
    for name, value in model.state_dict().items():
        if value.ndim == 1:
            value = (1.0 if name.endswith("norm.weight") else 0.0) + 0.3 * rng.standard_normal(value.shape)
        state[name] = value
    model.load_state_dict(state)


DECODERS = {"gpt2": _gpt2, "llama": _llama}
IDS = np.array([5, 17, 3, 40, 8, 5, 17, 3, 40, 22, 9, 1])
CORRUPT = np.array([5, 17, 3, 40, 8, 6, 17, 30, 40, 22, 9, 1])


def _metric(logits):
    return float(logits[-1, 40] - logits[-1, 22])


def _float64_pair(kind):
    return DECODERS[kind](np.float32), DECODERS[kind](np.float64)


# ----------------------------------------------------------------------------- the package


def test_interpret_and_every_name_load_nothing_heavy():
    import subprocess
    import sys

    code = ("import sys, attnkit.interpret as interpret\n"
            "names = [getattr(interpret, name) for name in interpret.__all__]\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'matplotlib', "
            "'scipy', 'gguf', 'numba', 'transformer_lens', 'networkx', 'tokenizers', 'safetensors'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
    import attnkit.interpret as interpret

    assert sorted(interpret.__all__) == sorted(interpret._LAZY) and set(interpret.__all__) <= set(dir(interpret))
    with pytest.raises(AttributeError, match="no attribute 'patch'"):
        interpret.patch


# ----------------------------------------------------------------------------- intervene


def test_intervene_edits_the_per_head_output_for_this_call_only():
    model = _gpt2(np.float64)
    attn = model.layers[1].attn
    plain = model(IDS)
    seen = []

    def zero_head_2(call):
        seen.append(call.output.shape)
        out = call.output.copy()
        out[:, 2] = 0.0
        return out

    with intervene({attn: zero_head_2}):
        edited = model(IDS)
    assert seen == [(1, 4, len(IDS), 8)]  # (B, H, T, E), once
    # the same change made to the weights: head 2's columns of the output projection zeroed
    twin = _gpt2(np.float64)
    weight = twin.layers[1].attn.out_proj.weight.copy()
    weight[:, 16:24] = 0.0
    twin.layers[1].attn.out_proj.weight = weight
    np.testing.assert_allclose(edited, twin(IDS), rtol=0, atol=1e-12)
    np.testing.assert_array_equal(model(IDS), plain)  # closed: nothing left behind


def test_intervene_is_invisible_to_other_threads():
    model = _gpt2(np.float64)
    plain = model(IDS)
    other = {}
    with ablate(model, [(0, 0), (1, 1), (2, 3)]):
        thread = threading.Thread(target=lambda: other.setdefault("logits", model(IDS)))
        thread.start()
        thread.join()
        inside = model(IDS)
    np.testing.assert_array_equal(other["logits"], plain)
    assert np.abs(inside - plain).max() > 1e-3


def test_intervene_refuses_what_is_not_an_attention_module():
    model = _gpt2()
    with pytest.raises(TypeError, match="AttentionModule"):
        with intervene({model.layers[0]: lambda call: None}):
            pass
    with pytest.raises(ValueError, match="shape"):
        with intervene({model.layers[0].attn: lambda call: call.output[:, :1]}):
            model(IDS)


# ----------------------------------------------------------------------------- ablation


@pytest.mark.parametrize("kind", DECODERS)
def test_mean_ablation_is_the_mean_output_written_into_the_bias(kind):
    model = DECODERS[kind](np.float64)
    reference = [IDS, CORRUPT[:7]]
    heads = [(0, 1), (2, 3)]
    with ablate(model, heads, "mean", reference=reference):
        ablated = model(IDS)
        generated = model.generate(IDS[:5], 4)
    twin = _with_attention_biases(model)
    E = twin.layers[0].attn.head_dim
    for layer, head in heads:
        # the head's mean output over every reference token, from a plain recording
        outputs = []
        with intervene({model.layers[layer].attn: lambda call: outputs.append(call.output[0, head])}):
            for ids in reference:
                model(ids)
        mean = np.concatenate(outputs).mean(axis=0)  # (E,)
        proj = twin.layers[layer].attn.out_proj
        columns = slice(head * E, (head + 1) * E)
        bias = proj.weight[:, columns] @ mean + (0 if proj.bias is None else proj.bias)
        weight = proj.weight.copy()
        weight[:, columns] = 0.0
        proj.weight, proj.bias = weight, bias
    np.testing.assert_allclose(ablated, twin(IDS), rtol=0, atol=1e-10)
    np.testing.assert_array_equal(generated, twin.generate(IDS[:5], 4))  # generation runs ablated too


def _with_attention_biases(model):
    """A copy of `model` whose attention projections have biases (zero where it has none)."""
    if isinstance(model, GPT2LMHeadModel):
        twin = GPT2LMHeadModel(model.config, seed=0)
    else:
        from dataclasses import replace

        twin = LlamaForCausalLM(replace(model.config, attention_bias=True), seed=0)
    state = {name: np.zeros_like(value) for name, value in twin.state_dict().items()}
    state.update(model.state_dict())
    twin.load_state_dict(state)
    return twin.astype(model.dtype)


def test_ablate_checks_its_arguments():
    model = _gpt2()
    with pytest.raises(ValueError, match="layer in \\[0, 3\\)"):
        with ablate(model, [(3, 0)]):
            pass
    with pytest.raises(ValueError, match="reference"):
        with ablate(model, [(0, 0)], "mean"):
            pass
    with pytest.raises(ValueError, match="how"):
        with ablate(model, [(0, 0)], "resample"):
            pass
    with pytest.raises(ValueError, match="no tokenizer"):
        detect_heads(model, "some text", "self")
    with pytest.raises(ValueError, match="token ids in \\[0, 61\\)"):
        detect_heads(model, [1, 61], "self")
    with pytest.raises(ValueError, match="epsilon"):
        sink_scores(model, IDS, epsilon=1.5)
    with pytest.raises(TypeError, match="attnkit model"):
        detect_heads(object(), IDS, "self")


# ----------------------------------------------------------------------------- detectors


def _maps(model, ids):
    with record_attention(model) as recording:
        model(ids)
    return np.stack([w[0] for w in recording.maps]).astype(np.float64)  # (L, H, T, T)


def test_detectors_follow_their_definitions():
    model = _llama(np.float64)
    A = _maps(model, IDS)
    T = len(IDS)
    previous = sum(A[:, :, i, i - 1] for i in range(1, T)) / T
    first = A[:, :, :, 0].sum(axis=-1) / T
    diagonal = np.einsum("lhii->lh", A) / T
    duplicate = sum(A[:, :, i, j] for i in range(T) for j in range(i) if IDS[i] == IDS[j]) / T
    induction = sum(A[:, :, i, j] for i in range(T) for j in range(1, i + 1) if IDS[j - 1] == IDS[i] and j - 1 < i) / T
    for pattern, expected in [("previous_token", previous), ("first_token", first), ("self", diagonal),
                              ("duplicate_token", duplicate), ("induction", induction)]:
        np.testing.assert_allclose(detect_heads(model, IDS, pattern), expected, rtol=1e-12, err_msg=pattern)
    custom = np.tril(np.ones((T, T)))
    np.testing.assert_allclose(detect_heads(model, IDS, custom), 1.0, rtol=1e-12)
    with pytest.raises(ValueError, match="previous_token"):
        detect_heads(model, IDS, "prev")


def test_induction_and_sink_scores_follow_their_definitions():
    model = _gpt2(np.float64)
    scores = induction_scores(model, length=6, seed=1)
    from attnkit.interpret.heads import repeated_random_tokens

    ids = repeated_random_tokens(model, 6, 1)
    assert np.array_equal(ids[:6], ids[6:])
    A = _maps(model, ids)
    np.testing.assert_allclose(scores, np.mean([A[:, :, i, i - 5] for i in range(6, 12)], axis=0), rtol=1e-12)
    sinks = sink_scores(model, IDS, epsilon=0.3, first=2)
    A = _maps(model, IDS)
    np.testing.assert_allclose(sinks.scores, A[..., :2].mean(axis=-2), rtol=1e-12)
    np.testing.assert_array_equal(sinks.sinks, A[..., 0].mean(axis=-1) > 0.3)
    assert sinks.ratio == sinks.sinks.mean()


def test_detectors_on_a_transformers_model_match_attnkit_on_the_same_weights(tmp_path, torch, transformers):
    config = transformers.GPT2Config(vocab_size=61, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(8.0)  # sharper attention than the 0.02 init gives
    hf.save_pretrained(tmp_path)
    from attnkit.models import AutoCausalLM

    ours = detect_heads(AutoCausalLM.from_pretrained(tmp_path), IDS, "previous_token")
    eager = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, attn_implementation="eager").eval()
    theirs = detect_heads(eager, IDS, "previous_token")
    truth = detect_heads(eager.double(), IDS, "previous_token")
    # A score is a mean of weights; a weight's float32 error is about eps * w * |s| where s are
    # the logits it came from (their rounding grows with their size: the weights were
    # sharpened x8). Their largest magnitude, from the float64 model (eager is float64 now):
    with torch.no_grad():
        hidden = eager(torch.as_tensor(np.asarray(IDS))[None], output_hidden_states=True).hidden_states
        largest = 0.0
        for layer, block in enumerate(eager.transformer.h):
            q, k, _ = block.attn.c_attn(block.ln_1(hidden[layer])).split(config.n_embd, dim=-1)
            q, k = (t.view(1, -1, config.n_head, config.n_embd // config.n_head).transpose(1, 2) for t in (q, k))
            logits = q @ k.transpose(-1, -2) / (config.n_embd // config.n_head) ** 0.5  # (1, H, T, T)
            largest = max(largest, float(logits.tril().abs().max()))
    scale = max(1.0, largest) * float(np.abs(truth).max())
    assert_within_budget(ours, theirs, truth, "previous-token scores, attnkit vs transformers", scale=scale)
    import attnkit.hf

    attnkit.hf.register()
    recorded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, attn_implementation="attnkit").eval()
    assert_within_budget(detect_heads(recorded, IDS, "previous_token"), theirs, truth,
                         "previous-token scores, transformers on attnkit's attention", scale=scale)


def test_detectors_on_an_encoder():
    from attnkit.models.bert import BertModel
    from attnkit.models.bert_config import BertConfig

    model = BertModel(BertConfig(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                 intermediate_size=48))
    rng = np.random.default_rng(0)
    model.load_state_dict({name: rng.standard_normal(value.shape) * 0.5 + (name.endswith("norm1.weight"))
                           for name, value in model.state_dict().items()})
    model.astype(np.float64)
    A = _maps(model, IDS[None])
    np.testing.assert_allclose(detect_heads(model, IDS, "self"), np.einsum("lhii->lh", A) / len(IDS), rtol=1e-12)
    packed = dict(cu_seqlens=np.array([0, len(IDS)]))
    with ablate(model, [(0, 2)]):  # the packed path goes through attend while edited
        off = model(IDS, **packed).last_hidden_state
        padded = model(IDS[None]).last_hidden_state[0]
    np.testing.assert_allclose(off, padded, rtol=0, atol=1e-12)
    assert np.abs(off - model(IDS, **packed).last_hidden_state).max() > 1e-6
    with pytest.raises(TypeError, match="decoder"):
        patch_heads(model, IDS, CORRUPT, _metric)
    # bidirectional: a query's scores over every key softmax to its recorded row
    scores = np.array([query_key_contributions(model, IDS, 1, 3, 4, key).score for key in range(len(IDS))])
    weights = np.exp(scores - scores.max())
    np.testing.assert_allclose(weights / weights.sum(), A[1, 3, 4], rtol=1e-10)
    maps = value_weighted(model, IDS)
    assert maps.heads.shape == (2, 4, len(IDS), len(IDS)) and (maps.heads[:, :, 4, 9] > 0).all()  # keys after the query count


def test_minilm_detects_and_ablates_through_encode(minilm_folder):
    from attnkit.models import SentenceEncoder

    encoder = SentenceEncoder.from_pretrained(minilm_folder)
    text = "The cat sat on the mat."
    tokens, weights = encoder.attention(text)
    # the same float32 weights, summed: a few float32 ulps per term at most
    np.testing.assert_allclose(detect_heads(encoder, text, "first_token"),
                               weights[..., 0].astype(np.float64).mean(axis=-1),
                               rtol=0, atol=8 * len(tokens) * np.finfo(np.float32).eps)
    plain = encoder.encode([text, "A second, longer sentence about a dog."])
    with ablate(encoder, [(layer, head) for layer in range(6) for head in range(12)]):
        off = encoder.encode([text, "A second, longer sentence about a dog."])  # packed batches
    assert np.abs(off - plain).max() > 1e-2
    np.testing.assert_array_equal(encoder.encode([text, "A second, longer sentence about a dog."]), plain)


# ----------------------------------------------------------------------------- patching


def _brute_patch_heads(model, clean, corrupt):
    """Every head patched in its own full run of the corrupt input."""
    captured = {}
    layers = [block.attn for block in model.layers]
    with intervene({m: (lambda l: lambda call: captured.__setitem__(l, call.output.copy()))(l)
                    for l, m in enumerate(layers)}):
        model(clean)
    out = np.empty((len(layers), layers[0].num_heads))
    for layer, module in enumerate(layers):
        for head in range(module.num_heads):
            def edit(call, layer=layer, head=head):
                patched = call.output.copy()
                patched[:, head] = captured[layer][:, head]
                return patched
            with intervene({module: edit}):
                out[layer, head] = _metric(model(corrupt))
    return out


def _brute_patch_residual(model, clean, corrupt):
    T = len(clean)
    where = np.arange(T)[None]

    def stream(ids, patch=None):
        x = model.embed_inputs(ids[None], where)
        cache = model.new_cache(1, T)
        for layer in range(len(model.layers)):
            if patch is not None and patch[0] == layer:
                x = x.copy()
                x[0, patch[1]] = patch[2][layer][0, patch[1]]
            x = model.run_layers(x, where, cache, layer, layer + 1)
            yield x

    clean_stream = [model.embed_inputs(clean[None], where)] + list(stream(clean))
    out = np.empty((len(model.layers), T))
    for layer in range(len(model.layers)):
        for position in range(T):
            *_, last = stream(corrupt, (layer, position, clean_stream))
            out[layer, position] = _metric(model.unembed(model.final_norm(last))[0])
    return out


@pytest.mark.parametrize("kind", DECODERS)
def test_patching_equals_the_brute_force_runs(kind):
    model = DECODERS[kind](np.float64)
    np.testing.assert_allclose(patch_heads(model, IDS, CORRUPT, _metric), _brute_patch_heads(model, IDS, CORRUPT),
                               rtol=0, atol=1e-10)
    np.testing.assert_allclose(patch_residual(model, IDS, CORRUPT, _metric),
                               _brute_patch_residual(model, IDS, CORRUPT), rtol=0, atol=1e-10)
    # patching the residual stream at layer 0 everywhere is the clean run; at the corrupt-only
    # positions it carries the whole difference at layer 0
    clean = _metric(model(IDS))
    assert patch_residual(model, IDS, IDS, _metric) == pytest.approx(np.full((3, len(IDS)), clean), abs=1e-10)
    with pytest.raises(ValueError, match="same length"):
        patch_heads(model, IDS, CORRUPT[:-1], _metric)


def test_patching_in_chunks_equals_one_batch(monkeypatch):
    model = _llama(np.float64)
    whole = patch_heads(model, IDS, CORRUPT, _metric), patch_residual(model, IDS, CORRUPT, _metric)
    import attnkit.interpret._stream as stream

    monkeypatch.setattr(stream, "LOGITS_BUDGET", 3 * len(IDS) * 61 * 4)  # three rows of logits at a time
    monkeypatch.setattr(stream, "ACTIVATION_BUDGET", 1)  # one row per layer call
    monkeypatch.setattr(stream, "STREAM_BUDGET", 1)  # one sweep per layer
    np.testing.assert_allclose(patch_heads(model, IDS, CORRUPT, _metric), whole[0], rtol=0, atol=1e-12)
    np.testing.assert_allclose(patch_residual(model, IDS, CORRUPT, _metric), whole[1], rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------- the residual stream


@pytest.mark.parametrize("kind", DECODERS)
def test_logit_lens_ends_at_the_logits_and_float32_is_within_budget(kind):
    model32, model64 = _float64_pair(kind)
    lens = logit_lens(model32, IDS)
    assert lens.shape == (4, len(IDS), 61)
    np.testing.assert_array_equal(lens[-1], model32(IDS))
    truth = logit_lens(model64, IDS)
    np.testing.assert_allclose(truth[-1], model64(IDS), rtol=0, atol=1e-12)
    # layer 0: the embeddings alone through the final norm and the head
    where = np.arange(len(IDS))[None]
    np.testing.assert_allclose(truth[0], model64.unembed(model64.final_norm(model64.embed_inputs(IDS[None], where)))[0],
                               rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", DECODERS)
def test_direct_logit_attribution_is_an_exact_decomposition(kind):
    model = DECODERS[kind](np.float64)
    logits = model(IDS)
    parts = direct_logit_attribution(model, IDS, 40, 22)
    assert parts.heads.shape == (3, 4) and parts.mlps.shape == (3,)
    whole = parts.heads.sum() + parts.mlps.sum() + parts.embeddings + parts.biases
    assert whole == pytest.approx(parts.total, abs=1e-12)
    assert parts.total == pytest.approx(logits[-1, 40] - logits[-1, 22], abs=1e-10 * np.abs(logits[-1]).max())
    single = direct_logit_attribution(model, IDS, 40)
    assert single.total == pytest.approx(logits[-1, 40], abs=1e-10 * np.abs(logits[-1]).max())
    # a head turned off contributes nothing directly
    with ablate(model, [(1, 2)]):
        assert direct_logit_attribution(model, IDS, 40, 22).heads[1, 2] == 0.0


# ----------------------------------------------------------------------------- maps


def _hf_gpt2_folder(tmp_path, torch, transformers):
    config = transformers.GPT2Config(vocab_size=61, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    torch.manual_seed(1)
    hf = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.randn(p.shape) * (0.3 if p.ndim > 1 else 0.2) + (1.0 if name.endswith("ln_1.weight") else 0))
    hf.save_pretrained(tmp_path)
    return tmp_path


def _kobayashi_from_transformers(model, torch, ids):
    """Value-weighted norms from transformers' own hidden states and attention weights."""
    with torch.no_grad():
        return _kobayashi_steps(model, torch, ids)


def _kobayashi_steps(model, torch, ids):
    out = model(torch.as_tensor(ids)[None], output_hidden_states=True, output_attentions=True)
    heads, layers = [], []
    for index, block in enumerate(model.transformer.h):
        x = block.ln_1(out.hidden_states[index])[0]  # (T, d)
        d = x.shape[-1]
        H = model.config.n_head
        E = d // H
        value = (x @ block.attn.c_attn.weight[:, 2 * d:] + block.attn.c_attn.bias[2 * d:]).reshape(-1, H, E)
        W_O = block.attn.c_proj.weight.reshape(H, E, d)  # Conv1D: (in, out)
        f = torch.einsum("jhe,hed->hjd", value, W_O)  # (H, T, d)
        alpha = out.attentions[index][0]  # (H, T, T)
        heads.append((alpha[:, :, :, None] * f[:, None]).norm(dim=-1))
        layers.append(torch.einsum("hij,hjd->ijd", alpha, f).norm(dim=-1))
    return torch.stack(heads).double().numpy(), torch.stack(layers).double().numpy()


def test_value_weighted_against_transformers_hidden_states(tmp_path, torch, transformers):
    from attnkit.models import AutoCausalLM

    folder = _hf_gpt2_folder(tmp_path, torch, transformers)
    ours = value_weighted(AutoCausalLM.from_pretrained(folder), IDS)
    hf = transformers.GPT2LMHeadModel.from_pretrained(folder, attn_implementation="eager").eval()
    theirs = _kobayashi_from_transformers(hf, torch, IDS)
    truth = _kobayashi_from_transformers(hf.double(), torch, IDS)
    assert ours.heads.shape == (2, 4, len(IDS), len(IDS)) and ours.layers.shape == (2, len(IDS), len(IDS))
    assert_within_budget(ours.heads, theirs[0], truth[0], "value-weighted heads")
    assert_within_budget(ours.layers, theirs[1], truth[1], "value-weighted layers")


@pytest.mark.parametrize("kind", DECODERS)
def test_query_key_products_give_the_attention_weights(kind):
    """The scores of one query over keys 0..i, from the products, softmax to the recorded row."""
    model = DECODERS[kind](np.float64)
    A = _maps(model, IDS)
    layer, head, query = 2, 3, 9
    scores = np.array([query_key_contributions(model, IDS, layer, head, query, key).score for key in range(query + 1)])
    weights = np.exp(scores - scores.max())
    np.testing.assert_allclose(weights / weights.sum(), A[layer, head, query, : query + 1], rtol=1e-10)
    one = query_key_contributions(model, IDS, layer, head, query, 4)
    assert one.products.shape == (8,) and one.products.sum() == pytest.approx(one.score, abs=1e-14)


# ----------------------------------------------------------------------------- SmolLM2


@pytest.fixture(scope="module")
def smollm2(smollm2_file):
    from attnkit.models import AutoCausalLM

    return AutoCausalLM.from_pretrained()


def _repeated_half_loss(model, ids):
    logits = model(ids).astype(np.float64)
    n = len(ids) // 2
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    return float(-np.mean([logp[i, ids[i + 1]] for i in range(n, len(ids) - 1)]))


@pytest.mark.slow
def test_smollm2_induction_heads_are_found_and_matter(smollm2):
    from attnkit.interpret.heads import repeated_random_tokens

    scores = induction_scores(smollm2, length=24, seed=0)
    assert scores.shape == (30, 9)
    top = [tuple(int(v) for v in np.unravel_index(i, scores.shape)) for i in np.argsort(scores, axis=None)[::-1][:6]]
    print("top induction heads", [(l, h, round(float(scores[l, h]), 3)) for l, h in top])
    assert (18, 6) in top[:2] and scores[18, 6] > 0.5
    assert {(17, 3), (17, 4), (17, 5)} <= set(top)
    ids = repeated_random_tokens(smollm2, 24, 0)
    plain = _repeated_half_loss(smollm2, ids)
    with ablate(smollm2, top):
        induction_off = _repeated_half_loss(smollm2, ids)
    rng = np.random.default_rng(0)
    others = [(int(l), int(h)) for l, h in zip(rng.integers(0, 30, 6), rng.integers(0, 9, 6))]
    with ablate(smollm2, others):
        random_off = _repeated_half_loss(smollm2, ids)
    print(f"loss on the repeated half: {plain:.3f}; induction heads off {induction_off:.3f}; "
          f"random heads off {random_off:.3f}")
    assert induction_off - plain > 4 * abs(random_off - plain)
