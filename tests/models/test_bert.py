"""all-MiniLM-L6-v2 on attnkit against transformers' BertModel (eager) and sentence-transformers.

Goals checked here: last hidden states, every layer's hidden states and the attention
probabilities, and sentence embeddings on 50+ varied sentences (one of them a 300-token
text that must be truncated), each within 2x the float32 error of transformers /
sentence-transformers against the same model in float64 (FlashAttention's rule, see
docs/conventions.md); attnkit's float64 path equals transformers' float64 to 1e-10.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
from conftest import F32_EPS, assert_within_budget, max_abs_err

from attnkit.models import SentenceEncoder
from attnkit.models.bert import gelu_inplace, load_bert

LONG_TEXT = " ".join(
    f"word{i} and, in the year {1900 + i}, café number {i} opened its doors again." for i in range(40)
)  # well over 256 word pieces

SENTENCES = [
    "",
    "Hello, world!",
    "The cat sat on the mat.",
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.",
    "What?!... Really??? Yes!!!",
    "(parentheses) [brackets] {braces} <angles>",
    "e-mail: someone@example.com, web: https://example.org/path?q=1&r=2",
    "Prices rose 3.5% to $1,234.56 on 2024-01-31 at 09:45.",
    "π ≈ 3.14159, e ≈ 2.71828, and √2 ≈ 1.41421",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15",
    "Café, naïve, résumé, coöperate, façade, jalapeño.",
    "Zürich, Kraków, São Paulo, Reykjavík, Ålesund.",
    "Ünïcödé ïs fün wïth äccënts.",
    "東京は日本の首都です。",
    "北京欢迎你",
    "Привет, как дела?",
    "Γειά σου Κόσμε",
    "مرحبا بالعالم",
    "שלום עולם",
    "नमस्ते दुनिया",
    "안녕하세요 세계",
    "I ❤️ NumPy 🚀🔥",
    "tab\tseparated\tvalues",
    "line one\nline two\nline three",
    "   leading and trailing spaces   ",
    "ALL CAPS SENTENCE SHOUTING LOUDLY",
    "mIxEd CaSe TeXt",
    "antidisestablishmentarianism supercalifragilisticexpialidocious",
    "The quick brown fox jumps over the lazy dog.",
    "Attention is all you need.",
    "Transformers use self-attention to weigh tokens against each other.",
    "def f(x): return x ** 2  # python code",
    "SELECT * FROM users WHERE id = 42;",
    "x_1 + x_2 = y^2",
    "He said: \"don't\" — she replied: 'won't'…",
    "a",
    ".",
    "?",
    "[CLS] [SEP] [PAD] [MASK] [UNK]",
    "The Eiffel Tower is in Paris, France.",
    "Water boils at 100 °C at sea level.",
    "Mitochondria are the powerhouse of the cell.",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "El rápido zorro marrón salta sobre el perro perezoso.",
    LONG_TEXT,
]


@pytest.fixture(scope="module")
def encoder(minilm_folder):
    return SentenceEncoder.from_pretrained(minilm_folder)


@pytest.fixture(scope="module")
def torch_one_thread(torch):
    """torch on one thread while this module's oracles run: on a busy 2-core machine its
    2-thread runs of these small inputs are 10-100x slower. Yields torch."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield torch
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def hf_models(minilm_folder, torch_one_thread, transformers):
    """transformers' BertModel (eager attention, so it returns probabilities) in float32 (the
    oracle) and the same weights cast to float64 (the truth; float64 throughout)."""
    model = transformers.BertModel.from_pretrained(str(minilm_folder), attn_implementation="eager").eval()
    return model, copy.deepcopy(model).double()


@pytest.fixture(scope="module")
def hf_tokenizer(minilm_folder, transformers):
    return transformers.AutoTokenizer.from_pretrained(str(minilm_folder))


@pytest.fixture(scope="module")
def st_embeddings(minilm_folder, torch_one_thread, sentence_transformers):
    """sentence-transformers' embeddings of SENTENCES in float32 (the oracle) and with the
    model cast to float64 (the truth): one float64 run shared by the tests below."""
    model = sentence_transformers.SentenceTransformer(str(minilm_folder), device="cpu")
    oracle = model.encode(SENTENCES, batch_size=16, convert_to_numpy=True)
    truth = model.double().encode(SENTENCES, batch_size=16, convert_to_numpy=True)
    assert oracle.dtype == np.float32 and truth.dtype == np.float64
    return oracle, truth


def _hf_run(model, torch, batch, **options):
    with torch.no_grad():
        return model(**{k: torch.from_numpy(v) for k, v in batch.items()}, **options)


@pytest.mark.slow
def test_sentence_set_is_varied_and_long_text_truncates(encoder, minilm_folder):
    assert len(SENTENCES) >= 50
    from tokenizers import Tokenizer

    untruncated = Tokenizer.from_file(str(minilm_folder / "tokenizer.json"))
    untruncated.no_truncation()
    assert len(untruncated.encode(LONG_TEXT).ids) >= 300
    assert len(encoder.tokens(LONG_TEXT)) == 256 == encoder.max_seq_length
    assert encoder.tokens("") == ["[CLS]", "[SEP]"]


@pytest.mark.slow
def test_tokenizer_matches_transformers(encoder, hf_tokenizer):
    ours = encoder.tokenizer.encode(SENTENCES)
    theirs = hf_tokenizer(SENTENCES, truncation=True, max_length=256)
    for text, mine, ids, types in zip(SENTENCES, ours, theirs["input_ids"], theirs["token_type_ids"]):
        assert mine.ids == ids, text
        assert mine.type_ids == types, text
    # the model's path (no character offsets) gives the same numbers, truncation included
    fast_ids, fast_types = encoder.tokenizer.encode_ids(SENTENCES + [LONG_TEXT])
    for text, mine, ids, types in zip(SENTENCES + [LONG_TEXT], encoder.tokenizer.encode(SENTENCES + [LONG_TEXT]),
                                      fast_ids, fast_types):
        assert ids.dtype == types.dtype == np.intp
        assert ids.tolist() == mine.ids and types.tolist() == mine.type_ids, text


@pytest.mark.slow
@pytest.mark.parametrize(
    "texts", [SENTENCES[:12], [LONG_TEXT, "A short one."]], ids=["short-batch", "truncated-256"]
)
def test_hidden_states_and_attentions_match_transformers(encoder, hf_models, hf_tokenizer, torch, texts):
    # padded batches: lengths 2 .. 30, and 256 (truncated) next to 5
    hf, hf64 = hf_models
    batch = hf_tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="np")
    real = batch["attention_mask"].astype(bool)  # (B, T)
    theirs = _hf_run(hf, torch, batch, output_hidden_states=True, output_attentions=True)
    truth = _hf_run(hf64, torch, batch, output_hidden_states=True, output_attentions=True)
    ours = encoder.model(
        batch["input_ids"], batch["attention_mask"], batch["token_type_ids"],
        output_hidden_states=True, output_attentions=True,
    )
    assert ours.last_hidden_state.shape == tuple(theirs.last_hidden_state.shape)
    assert ours.last_hidden_state.dtype == np.float32
    # Padded positions are never used and are ill-conditioned (transformers' own float32 and
    # float64 disagree there by ~1e-4): compare real tokens. Measured: transformers float32
    # is 0.8e-6..4e-6 from the truth, attnkit 1.5e-6..4e-6; hidden states reach 6..10, so the
    # 8-ulp epsilon is 6e-6..1e-5 (attention probabilities: ~1e-6).
    assert_within_budget(
        ours.last_hidden_state[real], theirs.last_hidden_state.numpy()[real],
        truth.last_hidden_state.numpy()[real], what="last hidden state",
    )
    assert len(ours.hidden_states) == len(theirs.hidden_states) == len(truth.hidden_states) == 7
    for layer, (a, b, t) in enumerate(zip(ours.hidden_states, theirs.hidden_states, truth.hidden_states)):
        assert_within_budget(a[real], b.numpy()[real], t.numpy()[real], what=f"hidden state {layer}")
    assert len(ours.attentions) == 6
    for layer, (a, b, t) in enumerate(zip(ours.attentions, theirs.attentions, truth.attentions)):
        assert a.shape == tuple(b.shape)  # (B, H, T, T)
        rows = real[:, None, :, None] & np.ones(a.shape, bool)  # real query rows
        assert_within_budget(a[rows], b.numpy()[rows], t.numpy()[rows], what=f"attention probabilities {layer}")
        # padded keys get exactly zero weight: masked means excluded
        assert np.all(a[np.broadcast_to(~real[:, None, None, :], a.shape)] == 0)


@pytest.mark.slow
def test_float64_model_matches_float64_transformers(minilm_folder, hf_models, hf_tokenizer, torch):
    """attnkit's BertModel in float64 is transformers' in float64 to float64 rounding (the
    float64 reference other tests, e.g. test_embed_cli, use as their truth)."""
    _, hf64 = hf_models
    model = load_bert(minilm_folder).astype(np.float64)
    batch = hf_tokenizer(SENTENCES[:8], padding=True, return_tensors="np")
    real = batch["attention_mask"].astype(bool)
    truth = _hf_run(hf64, torch, batch, output_attentions=True)
    ours = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"], output_attentions=True)
    assert ours.last_hidden_state.dtype == np.float64
    diff = max_abs_err(ours.last_hidden_state[real], truth.last_hidden_state.numpy()[real])
    print(f"float64 hidden states: max |attnkit - transformers| = {diff:.2e}")
    assert diff < 1e-10
    for a, t in zip(ours.attentions, truth.attentions):
        rows = real[:, None, :, None] & np.ones(a.shape, bool)
        assert max_abs_err(a[rows], t.numpy()[rows]) < 1e-12


@pytest.mark.slow
def test_attention_extraction_matches_transformers(encoder, hf_models, torch):
    hf, hf64 = hf_models
    text = "The quick brown fox jumps over the lazy dog, naïvely."
    tokens, weights = encoder.attention(text)
    ids = encoder.tokenizer.encode([text])[0].ids
    with torch.no_grad():
        theirs = hf(input_ids=torch.tensor([ids]), output_attentions=True).attentions
        truth = hf64(input_ids=torch.tensor([ids]), output_attentions=True).attentions
    expected = np.stack([a[0].numpy() for a in theirs])  # (layers, H, T, T)
    assert tokens[0] == "[CLS]" and tokens[-1] == "[SEP]" and len(tokens) == len(ids)
    assert weights.shape == (6, 12, len(tokens), len(tokens)) and weights.dtype == np.float32
    assert_within_budget(weights, expected, np.stack([a[0].numpy() for a in truth]), what="attention(text)")
    # A row of T float32 probabilities sums to 1 within ~T eps (the float32 sum of the
    # softmax denominator, one rounding per division); summed here in float64, 4x that.
    T = len(tokens)
    np.testing.assert_allclose(weights.sum(-1, dtype=np.float64), 1.0, rtol=0, atol=4 * T * F32_EPS)


@pytest.mark.slow
def test_fast_path_matches_reference_modules(encoder, hf_models, torch):
    """encode()'s packed, in-place path is as accurate as the attnkit.nn modules, per sentence."""
    _, hf64 = hf_models
    texts = ["Hello, world!", "Café, naïve, résumé.", "", LONG_TEXT]
    encodings = encoder.tokenizer.encode(texts)
    ids = np.concatenate([e.ids for e in encodings])
    lengths = np.array([len(e.ids) for e in encodings])
    packed = encoder.model(ids, cu_seqlens=np.concatenate([[0], np.cumsum(lengths)])).last_hidden_state
    start = 0
    for n, e in zip(lengths, encodings):
        reference = encoder.model(np.array([e.ids])).last_hidden_state[0]
        with torch.no_grad():
            truth = hf64(input_ids=torch.tensor([e.ids])).last_hidden_state[0].numpy()
        assert_within_budget(packed[start : start + n], reference, truth, what=f"packed path, {n} tokens")
        start += n


@pytest.mark.slow
def test_embeddings_match_sentence_transformers(encoder, st_embeddings):
    expected, truth = st_embeddings
    got = encoder.encode(SENTENCES, batch_size=7)  # several batches, results in input order
    assert got.shape == (len(SENTENCES), 384) and got.dtype == np.float32
    # Measured: sentence-transformers float32 is ~2e-7 from the truth, attnkit ~2.5e-7.
    assert_within_budget(got, expected, truth, what=f"embeddings of {len(SENTENCES)} sentences")
    # For unit vectors 1 - cos = |a - b|^2 / 2 <= 384 * (max diff)^2 / 2, ~1e-10 at the budget's
    # edge (7e-7): 1e-6 has ample room. Computed in float64, so it adds no rounding of its own.
    got64, expected64 = got.astype(np.float64), expected.astype(np.float64)
    cosine = np.sum(got64 * expected64, axis=1) / (
        np.linalg.norm(got64, axis=1) * np.linalg.norm(expected64, axis=1)
    )
    print(f"min cosine similarity: {cosine.min():.12f}")
    assert cosine.min() >= 1 - 1e-6
    # unit norm, as L2-normalized in float32 can be: the truth is 1
    assert_within_budget(
        np.linalg.norm(got64, axis=1), np.linalg.norm(expected64, axis=1), np.ones(len(SENTENCES)),
        what="embedding norms",
    )


@pytest.mark.slow
def test_embeddings_with_compiled_kernels_match_sentence_transformers(encoder, st_embeddings):
    """With the compiled kernels started, encode() takes the compiled packed attention (a spy
    checks it ran) and stays within the budget of sentence-transformers' float32 error against
    the float64 truth."""
    from attnkit import kernels
    from attnkit.kernels import elementwise

    if not kernels.enabled():
        pytest.skip(f"compiled kernels off: {kernels.reason_disabled()}")
    elementwise.load()
    expected, truth = st_embeddings
    calls = []
    real = elementwise._attention_softmax
    with pytest.MonkeyPatch.context() as m:
        m.setattr(elementwise, "_attention_softmax", lambda s, scale: (calls.append(s.shape), real(s, scale)))
        got = encoder.encode(SENTENCES, batch_size=7)
    assert calls, "the compiled packed attention did not run"
    assert got.shape == (len(SENTENCES), 384) and got.dtype == np.float32
    assert_within_budget(got, expected, truth, what=f"embeddings of {len(SENTENCES)} sentences, compiled kernels")


@pytest.mark.slow
def test_batching_and_threads_do_not_change_results(encoder, st_embeddings):
    """Every batching and thread count is as accurate as sentence-transformers (the float32
    results differ in the last bits: BLAS sums in an order that depends on the rows it gets)."""
    oracle, truth = (e[:20] for e in st_embeddings)
    texts = SENTENCES[:20]
    base = encoder.encode(texts, batch_size=32)
    one_by_one = np.concatenate([encoder.encode([t]) for t in texts])
    single_thread = SentenceEncoder(encoder.model, encoder.tokenizer, num_threads=1).encode(texts, batch_size=3)
    reversed_order = encoder.encode(texts[::-1], batch_size=5)[::-1]
    for what, got in [("batch of 32", base), ("one by one", one_by_one), ("one thread, batches of 3", single_thread),
                      ("reversed, batches of 5", reversed_order)]:
        assert_within_budget(got, oracle, truth, what=what)


@pytest.mark.slow
def test_encode_shapes_and_progress(encoder):
    assert encoder.encode("one string").shape == (384,)  # as sentence-transformers: one string, one vector
    assert encoder.encode(["one string"]).shape == (1, 384)
    assert encoder.encode([]).shape == (0, 384)
    texts = ["a tuple", "of sentences"]
    assert np.array_equal(encoder.encode(tuple(texts)), encoder.encode(np.array(texts)))
    seen = []
    encoder.encode(["a", "b", "c", "d", "e"], batch_size=2, progress=seen.append)
    assert seen == [2, 2, 1]
    embeddings = encoder.encode(["A man is eating food.", "A man eats a meal.", "The sky is blue."])
    similar = encoder.similarity(embeddings, embeddings)
    assert similar.shape == (3, 3)
    assert similar[0, 1] > similar[0, 2]
    # |e|^2 of a float32 unit vector: twice its norm's error (~1e-6, see the norm budget above)
    # plus the float32 dot of D = 384 products, ~4 sqrt(D) eps with rounding as a random walk
    np.testing.assert_allclose(np.diag(similar), 1.0, rtol=0, atol=2e-6 + 4 * math.sqrt(384) * F32_EPS)


@pytest.mark.slow
@pytest.mark.parametrize(
    "bad, error, words",
    [
        (123, TypeError, "expected a str or a sequence of str, got int"),
        (["fine", 3], TypeError, "texts[1] to be a str, got int"),
        ([b"bytes"], TypeError, "texts[0] to be a str, got bytes"),
        (None, TypeError, "got NoneType"),
    ],
)
def test_encode_rejects_non_strings(encoder, bad, error, words):
    with pytest.raises(error) as info:
        encoder.encode(bad)
    assert words in str(info.value)


@pytest.mark.slow
def test_other_bad_arguments(encoder):
    with pytest.raises(ValueError, match="batch_size"):
        encoder.encode(["a"], batch_size=0)
    with pytest.raises(TypeError, match="text to be a str, got int"):
        encoder.attention(5)
    with pytest.raises(ValueError, match="input_ids"):
        encoder.model(np.array([[101, 10**6]]))
    with pytest.raises(ValueError, match="num_threads"):
        SentenceEncoder(encoder.model, encoder.tokenizer, num_threads=0)


def _gelu_inputs():
    x = np.concatenate(
        [np.linspace(-12, 12, 4001), np.random.default_rng(0).standard_normal(5000) * 3, [0.0, -0.0, 1e-30, -1e-30]]
    ).astype(np.float32)
    exact = np.array([0.5 * v * math.erfc(-v / math.sqrt(2)) for v in x.astype(np.float64)])
    got = gelu_inplace(x.reshape(-1, 1).repeat(3, axis=1).copy())[:, 0]
    return x, exact, got


def test_gelu_inplace_is_exact_gelu():
    x, exact, got = _gelu_inputs()
    eps = F32_EPS
    # relative error, measured against max(|GELU(x)|, 1e-3): float32-level everywhere,
    # including the negative tail where 0.5 * x * (1 + erf) would cancel. The erfc fit is
    # good to 1.2e-7 (1 eps) and ~10 float32 operations round once each: 16 eps.
    err = np.abs(got - exact) / np.maximum(np.abs(exact), 1e-3) / eps
    print(f"gelu_inplace: {err.max():.1f} eps relative, {np.abs(got - exact).max():.2e} absolute")
    assert err.max() <= 16
    # absolute: half an ulp of the result (<= 2.4e-7 below 8; from |x| = 8 on the erfc term is
    # < 1e-14 and GELU(x) = max(x, 0) exactly) plus 16 eps of the term |x|/2 erfc(|x|/sqrt 2),
    # which together peak at 3.5e-7 (x = 0.75, term 0.17)
    assert np.abs(got - exact).max() <= 5e-7
    assert not np.isnan(got).any()


def test_gelu_inplace_within_budget_of_torch(torch):
    x, exact, got = _gelu_inputs()
    torch_gelu = torch.nn.functional.gelu(torch.from_numpy(x)).numpy()
    assert_within_budget(got, torch_gelu, exact, what="gelu_inplace vs torch's float32 gelu")


@pytest.mark.slow
def test_flash_backend_gives_the_same_embeddings(encoder, st_embeddings):
    oracle, truth = st_embeddings
    flash = SentenceEncoder(encoder.model, encoder.tokenizer, backend="flash")
    texts = SENTENCES[:6] + [LONG_TEXT]
    assert SENTENCES[-1] == LONG_TEXT
    pick = list(range(6)) + [len(SENTENCES) - 1]
    assert_within_budget(flash.encode(texts), oracle[pick], truth[pick], what="flash backend embeddings")
    assert_within_budget(encoder.encode(texts), oracle[pick], truth[pick], what="naive backend embeddings")
    encoder.model.set_attention_backend("naive")
    with pytest.raises(ValueError, match="unknown attention backend"):
        SentenceEncoder(encoder.model, encoder.tokenizer, backend="nope")
