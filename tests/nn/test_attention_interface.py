"""One backend switch and one recorder of attention maps, for every model kind.

Each model kind (a tiny random Llama, GPT-2 and BERT saved by transformers) is
switched to a counting backend (a user-registered function that wraps "naive" and
counts its calls): the count proves the backend actually ran, once per layer per
forward pass. Switched to "flash", the outputs stay within the float64-grounded
budget of "naive" (oracle: naive in float32; truth: the model in float64).
`attnkit.record_attention` collects the maps of any model, which agree with
transformers' output_attentions, and asks a backend for weights only while open.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
from conftest import F32_EPS, assert_within_budget, optional

import attnkit
from attnkit import nn
from attnkit.functional import ATTENTION_BACKENDS, scaled_dot_product_attention
from attnkit.models import SentenceEncoder
from attnkit.models.auto import AutoCausalLM
from attnkit.models.bert import load_bert

transformers = optional("transformers")

VOCAB = 97
WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "##s", "big", ".", ",", "!", "?", "red"]
BERT_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS + [f"w{i}" for i in range(40)]
LAYERS = 3


@pytest.fixture
def counting(monkeypatch):
    """Register backend "counting" (naive underneath); yields the list of its calls'
    return_weights flags."""
    calls: list[bool] = []

    def counting_attention(query, key, value, *args, return_weights=False, **kwargs):
        calls.append(bool(return_weights))
        return scaled_dot_product_attention(query, key, value, *args, return_weights=return_weights, **kwargs)

    monkeypatch.setitem(ATTENTION_BACKENDS, "counting", counting_attention)
    return calls


def _decoder_folder(kind, folder, torch):
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=48, n_layer=LAYERS, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0
        )
        hf = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=LAYERS,
            num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128, rope_theta=5000.0,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
        )
        hf = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # larger-than-init weights so differences would show
        for p in hf.parameters():
            p.mul_(3.0)
    hf.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def decoder(request, tmp_path_factory, torch, transformers):
    """(kind, attnkit float32, attnkit float64, transformers eager float32, transformers float64)."""
    folder = _decoder_folder(request.param, tmp_path_factory.mktemp(request.param), torch)
    hf_class = transformers.GPT2LMHeadModel if request.param == "gpt2" else transformers.LlamaForCausalLM
    hf = hf_class.from_pretrained(folder, attn_implementation="eager").eval()
    ours = AutoCausalLM.from_pretrained(folder)
    ours64 = AutoCausalLM.from_pretrained(folder).astype(np.float64)
    return request.param, ours, ours64, hf, copy.deepcopy(hf).double()


@pytest.fixture(scope="module")
def bert_folder(tmp_path_factory, torch, transformers):
    folder = tmp_path_factory.mktemp("tiny_bert")
    config = transformers.BertConfig(
        vocab_size=len(BERT_VOCAB), hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
        intermediate_size=37, max_position_embeddings=40, type_vocab_size=2, layer_norm_eps=1e-7,
    )
    torch.manual_seed(0)
    transformers.BertModel(config).eval().save_pretrained(folder, safe_serialization=True)
    (folder / "vocab.txt").write_text("\n".join(BERT_VOCAB) + "\n")
    return folder


def _batch(rng, B=2, T=9):
    """Token ids (B, T) and a left-padding mask: row 1 has 3 padding tokens."""
    ids = rng.integers(3, VOCAB, size=(B, T))
    mask = np.ones((B, T), bool)
    mask[1, :3] = False
    return ids, mask


# ----------------------------------------------------------------------------- the switch


def test_decoder_backend_switch_counts_calls_and_flash_agrees(decoder, counting):
    kind, ours, ours64, _, _ = decoder
    ids, mask = _batch(np.random.default_rng(1))
    try:
        assert ours.set_attention_backend("counting") is ours
        assert all(layer.attn.backend == "counting" for layer in ours.layers)
        naive = ours(ids, attention_mask=mask)
        assert len(counting) == LAYERS, f"{kind}: one forward pass should call the backend once per layer"
        # generate: one prefill, then one decode step per new token after the first
        before = len(counting)
        out = ours.generate(ids[:1], max_new_tokens=4)
        assert out.shape[-1] == ids.shape[1] + 4
        assert len(counting) - before == LAYERS * 4
        ours.set_attention_backend("naive")
        reference = ours(ids, attention_mask=mask)
        ours.set_attention_backend("flash")
        flash = ours(ids, attention_mask=mask)
    finally:
        ours.set_attention_backend("naive")
    np.testing.assert_array_equal(naive, reference)  # "counting" is naive underneath
    truth = ours64(ids, attention_mask=mask)
    assert_within_budget(flash, reference, truth, what=f"{kind} logits with the flash backend")


def test_encoder_backend_switch_counts_calls_and_flash_agrees(bert_folder, counting):
    model = load_bert(bert_folder)
    model64 = load_bert(bert_folder).astype(np.float64)
    rng = np.random.default_rng(2)
    ids = rng.integers(5, len(BERT_VOCAB), size=(2, 11))
    mask = np.ones_like(ids, dtype=bool)
    mask[1, 7:] = False
    assert model.set_attention_backend("counting") is model
    counted = model(ids, mask).last_hidden_state
    assert len(counting) == LAYERS
    reference = model.set_attention_backend("naive")(ids, mask).last_hidden_state
    np.testing.assert_array_equal(counted, reference)
    flash = model.set_attention_backend("flash")(ids, mask).last_hidden_state
    truth = model64(ids, mask).last_hidden_state
    assert_within_budget(flash[mask], reference[mask], truth[mask], what="BERT hidden states with the flash backend")


def test_sentence_encoder_backend_switch_reaches_the_packed_path(bert_folder, counting):
    encoder = SentenceEncoder.from_pretrained(bert_folder, num_threads=1)
    texts = ["the cat sat on the mat .", "a big red dog ran !", "the dog"]
    naive = encoder.encode(texts)
    assert encoder.set_attention_backend("counting") is encoder
    # a backend varlen_attention does not know runs through `attend` on padded groups of
    # sentences: the same attention, summed in another order than varlen's per-sentence calls
    np.testing.assert_allclose(encoder.encode(texts), naive, rtol=0, atol=64 * F32_EPS)
    assert len(counting) == LAYERS  # 3 sentences: one attention group per layer
    encoder.set_attention_backend("flash")
    np.testing.assert_allclose(encoder.encode(texts), naive, rtol=0, atol=64 * F32_EPS)


@pytest.mark.parametrize(
    ("module", "calls"),
    [
        (nn.MultiHeadAttention(16, 4, seed=0), 1),
        (nn.SingleHeadSelfAttention(16, 8, seed=0), 1),
        (nn.PerHeadMultiHeadAttention(16, 4, seed=0), 1),  # its heads attend in one call
        (nn.TransformerBlock(16, 4, 32, seed=0), 1),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, nn.Module) else str(value),
)
def test_every_module_takes_the_switch(module, calls, counting):
    x = np.random.default_rng(3).standard_normal((2, 5, 16)).astype(np.float32)
    module.set_attention_backend("counting")
    with attnkit.record_attention(module) as recording:
        module(x)
    assert len(counting) == calls
    assert len(recording) == 1 and recording[0].shape[-2:] == (5, 5)  # one (B, H, L, S) map per module call
    module.set_attention_backend("naive")


# Every module class that attends, built the same way each time (seed 0).
MODULE_CLASSES = {
    "MultiHeadAttention": lambda: nn.MultiHeadAttention(16, 4, seed=0),
    "MultiHeadAttention-gqa": lambda: nn.MultiHeadAttention(16, 4, num_kv_heads=2, seed=0),
    "PerHeadMultiHeadAttention": lambda: nn.PerHeadMultiHeadAttention(16, 4, seed=0),
    "TransformerBlock": lambda: nn.TransformerBlock(16, 4, 32, seed=0),
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("backend", [*sorted(ATTENTION_BACKENDS), "counting"])
@pytest.mark.parametrize("name", sorted(MODULE_CLASSES))
def test_every_module_runs_on_every_backend(name, backend, causal, counting):
    """One route: each module class on each registered backend (a user's included), with
    key padding and causality passed as keywords, agrees with naive within the budget."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 9, 16)).astype(np.float32)
    key_mask = np.ones((3, 9), bool)
    key_mask[1, 6:] = False
    key_mask[2, :] = False  # a sequence with no real token: output 0 / bias, never NaN

    def run(module, inputs):
        out = module(inputs, key_mask=key_mask, is_causal=causal)
        return out.output if isinstance(out, tuple) else out

    reference = run(MODULE_CLASSES[name](), x)
    truth = run(MODULE_CLASSES[name]().astype(np.float64), x.astype(np.float64))
    module = MODULE_CLASSES[name]().set_attention_backend(backend)
    out = run(module, x)
    assert np.isfinite(out).all()
    assert_within_budget(out, reference, truth, what=f"{name} on backend {backend!r}")
    if backend == "counting":
        assert counting and not any(counting)  # called, and never asked for weights it does not need


def test_a_module_that_always_returns_weights_runs_naive_on_a_weightless_backend():
    """SingleHeadSelfAttention returns its weights on every call: on "flash" (which forms
    none) it computes them with "naive", as a recorded module does, instead of failing."""
    x = np.random.default_rng(5).standard_normal((2, 7, 16)).astype(np.float32)
    head = nn.SingleHeadSelfAttention(16, 8, seed=0)
    reference = head(x, is_causal=True)
    flash = head.set_attention_backend("flash")(x, is_causal=True)
    assert head.backend == "flash"
    np.testing.assert_array_equal(flash.output, reference.output)
    np.testing.assert_array_equal(flash.weights, reference.weights)


def test_the_old_attention_keyword_still_works_with_a_warning(bert_folder):
    """`attention=` (0.1.0) is now `backend=`; the old spelling works for one release."""
    from attnkit.nn import KVCache

    with pytest.warns(DeprecationWarning, match="attention= is deprecated, use backend="):
        encoder = SentenceEncoder.from_pretrained(bert_folder, attention="flash")
    assert {m.backend for _, m in encoder.model.named_modules() if isinstance(m, nn.AttentionModule)} == {"flash"}
    with pytest.raises(TypeError, match="got both backend= and its old spelling attention="):
        SentenceEncoder.from_pretrained(bert_folder, backend="flash", attention="naive")
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((1, 2, 3, 8)) for _ in range(3))
    new = KVCache(1, 1, 2, 8, 16, dtype=np.float64).attend(0, q, k, v, backend="naive")
    with pytest.warns(DeprecationWarning):
        old = KVCache(1, 1, 2, 8, 16, dtype=np.float64).attend(0, q, k, v, attention="naive")
    np.testing.assert_array_equal(old, new)


def test_an_unknown_backend_is_refused_by_name(decoder, bert_folder):
    _, ours, _, _, _ = decoder
    encoder = SentenceEncoder.from_pretrained(bert_folder, num_threads=1)
    for target in (ours, encoder, encoder.model, nn.MultiHeadAttention(8, 2)):
        with pytest.raises(ValueError, match=r"unknown attention backend 'nope'.*'flash'.*'naive'"):
            target.set_attention_backend("nope")
    mha = nn.MultiHeadAttention(8, 2)
    with pytest.raises(ValueError, match="unknown attention backend"):
        mha.backend = "nope"
    assert mha.backend == "naive"
    assert all(layer.attn.backend == "naive" for layer in ours.layers)


def test_the_decoder_class_has_no_backend_of_its_own(decoder):
    _, ours, _, _, _ = decoder
    assert not hasattr(type(ours), "attention_backend")


# ----------------------------------------------------------------------------- the recorder


def test_recorded_decoder_maps_match_transformers(decoder, torch):
    kind, ours, _, hf, hf64 = decoder
    ids = np.random.default_rng(4).integers(3, VOCAB, size=(1, 12))
    with attnkit.record_attention(ours) as recording:
        ours(ids)
    assert len(recording) == LAYERS
    with torch.no_grad():
        theirs = hf(torch.from_numpy(ids), output_attentions=True).attentions
        truth = hf64(torch.from_numpy(ids), output_attentions=True).attentions
    for layer, (w, t, t64) in enumerate(zip(recording.maps, theirs, truth)):
        assert_within_budget(w, t.numpy(), t64.numpy(), what=f"{kind} layer {layer} attention")
    # the model's own helper is the recorder
    helper = ours.attention(ids[0])
    np.testing.assert_array_equal(helper.weights, np.stack([w[0] for w in recording.maps]))


def test_recorded_decoder_rows_are_distributions_over_real_tokens(decoder):
    kind, ours, _, _, _ = decoder
    ids, mask = _batch(np.random.default_rng(5))
    cache = ours.new_cache(2, ids.shape[1] + 3)
    with attnkit.record_attention(ours) as recording:
        ours(ids, attention_mask=mask, cache=cache)
        for _ in range(3):  # decode steps: one query over the growing cache
            ours(np.array([[4], [5]]), cache=cache)
    assert len(recording.maps) == LAYERS * 4
    T = ids.shape[1]
    for index, weights in enumerate(recording.maps):
        step = index // LAYERS
        L, S = (T, T) if step == 0 else (1, T + step)
        assert weights.shape == (2, ours.config.num_heads, L, S)
        assert np.all(weights[1, ..., :3] == 0), "padded keys get weight exactly 0"
        # rows of real queries: every decode step's; in the prompt, row 1's from position 3 on
        real_rows = weights.reshape(-1, S) if step else np.concatenate(
            [weights[0].reshape(-1, S), weights[1][:, 3:].reshape(-1, S)]
        )
        np.testing.assert_allclose(real_rows.sum(-1, dtype=np.float64), 1.0, rtol=0, atol=4 * S * F32_EPS)


def test_recorded_bert_maps_match_transformers(bert_folder, torch, transformers):
    model = load_bert(bert_folder)
    hf = transformers.BertModel.from_pretrained(bert_folder, attn_implementation="eager").eval()
    hf64 = copy.deepcopy(hf).double()
    ids = np.random.default_rng(6).integers(5, len(BERT_VOCAB), size=(2, 10))
    mask = np.ones_like(ids, dtype=bool)
    mask[1, 6:] = False
    with attnkit.record_attention(model) as recording:
        model(ids, mask)
    with torch.no_grad():
        inputs = dict(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask.astype(np.int64)))
        theirs = hf(**inputs, output_attentions=True).attentions
        truth = hf64(**inputs, output_attentions=True).attentions
    assert len(recording) == LAYERS
    for layer, (w, t, t64) in enumerate(zip(recording, theirs, truth)):
        assert w.shape == (2, 4, 10, 10)
        assert_within_budget(w, t.numpy(), t64.numpy(), what=f"BERT layer {layer} attention")
        np.testing.assert_allclose(w.sum(-1, dtype=np.float64), 1.0, rtol=0, atol=4 * 10 * F32_EPS)
        assert np.all(w[1, ..., 6:] == 0)
    # output_attentions is the recorder too
    attentions = model(ids, mask, output_attentions=True).attentions
    for a, w in zip(attentions, recording.maps):
        np.testing.assert_array_equal(a, w)


def test_sentence_encoder_attention_is_recorded(bert_folder):
    encoder = SentenceEncoder.from_pretrained(bert_folder, num_threads=1)
    text = "the cat sat on the mat ."
    with attnkit.record_attention(encoder) as recording:
        tokens, weights = encoder.attention(text)
    assert len(recording) == LAYERS and weights.shape == (LAYERS, 4, len(tokens), len(tokens))
    np.testing.assert_array_equal(weights, np.stack([w[0] for w in recording.maps]))
    # the flash backend never forms weights: recording falls back to naive for those calls
    encoder.set_attention_backend("flash")
    np.testing.assert_array_equal(encoder.attention(text)[1], weights)


def test_recording_off_costs_nothing(decoder, bert_folder, counting):
    kind, ours, _, _, _ = decoder
    ids, mask = _batch(np.random.default_rng(7))
    model = load_bert(bert_folder)
    try:
        for target, run in ((ours, lambda: ours(ids, attention_mask=mask)), (model, lambda: model(ids % 50, mask))):
            target.set_attention_backend("counting")
            counting.clear()
            run()
            assert counting == [False] * LAYERS, "no weights asked for when not recording"
            with attnkit.record_attention(target) as recording:
                run()
            assert counting[LAYERS:] == [True] * LAYERS and len(recording) == LAYERS
            run()
            assert counting[2 * LAYERS :] == [False] * LAYERS, "recording stops when the context closes"
    finally:
        ours.set_attention_backend("naive")


def test_recordings_nest_and_reject_non_models():
    block = nn.TransformerBlock(16, 4, 32, seed=0)
    x = np.random.default_rng(8).standard_normal((1, 4, 16)).astype(np.float32)
    with attnkit.record_attention(block) as outer:
        block(x)
        with attnkit.record_attention(block.attn) as inner:
            block(x)
    assert len(outer) == 2 and len(inner) == 1
    assert inner[0] is outer[1]
    with pytest.raises(TypeError, match="expected a model or module"):
        with attnkit.record_attention(object()):
            pass
    with pytest.raises(ValueError, match="no attention module"):
        with attnkit.record_attention(nn.Linear(3, 3)):
            pass
