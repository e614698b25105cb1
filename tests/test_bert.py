"""all-MiniLM-L6-v2 on attnkit against transformers' BertModel (eager) and sentence-transformers.

Goals checked here: last hidden states, every layer's hidden states and the
attention probabilities within 1e-5 absolute of transformers; sentence
embeddings within 1e-6 absolute (cosine >= 0.999999) of sentence-transformers
on 50+ varied sentences, one of them a 300-token text that must be truncated.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
sentence_transformers = pytest.importorskip("sentence_transformers")

from attnkit.models import SentenceEncoder, minilm_path  # noqa: E402
from attnkit.models.bert import gelu_inplace  # noqa: E402

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
def encoder():
    return SentenceEncoder.from_pretrained()


@pytest.fixture(scope="module")
def hf_model():
    model = transformers.BertModel.from_pretrained(str(minilm_path()), attn_implementation="eager")
    return model.eval()


@pytest.fixture(scope="module")
def hf_tokenizer():
    return transformers.AutoTokenizer.from_pretrained(str(minilm_path()))


@pytest.fixture(scope="module")
def st_model():
    return sentence_transformers.SentenceTransformer(str(minilm_path()), device="cpu")


def _report(what: str, diff: float, tol: float) -> None:
    print(f"{what}: max |attnkit - reference| = {diff:.3e} (tolerance {tol:.0e}) {'OK' if diff <= tol else 'NOT OK'}")


def test_sentence_set_is_varied_and_long_text_truncates(encoder):
    assert len(SENTENCES) >= 50
    from tokenizers import Tokenizer

    untruncated = Tokenizer.from_file(str(minilm_path() / "tokenizer.json"))
    untruncated.no_truncation()
    assert len(untruncated.encode(LONG_TEXT).ids) >= 300
    assert len(encoder.tokens(LONG_TEXT)) == 256 == encoder.max_seq_length
    assert encoder.tokens("") == ["[CLS]", "[SEP]"]


def test_tokenizer_matches_transformers(encoder, hf_tokenizer):
    ours = encoder.tokenizer.encode(SENTENCES)
    theirs = hf_tokenizer(SENTENCES, truncation=True, max_length=256)
    for text, mine, ids, types in zip(SENTENCES, ours, theirs["input_ids"], theirs["token_type_ids"]):
        assert mine.ids == ids, text
        assert mine.type_ids == types, text


@pytest.mark.parametrize(
    "texts", [SENTENCES[:12], [LONG_TEXT, "A short one."]], ids=["short-batch", "truncated-256"]
)
def test_hidden_states_and_attentions_match_transformers(encoder, hf_model, hf_tokenizer, texts):
    # padded batches: lengths 2 .. 30, and 256 (truncated) next to 5
    batch = hf_tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="np")
    real = batch["attention_mask"].astype(bool)  # (B, T)
    with torch.no_grad():
        theirs = hf_model(
            **{k: torch.from_numpy(v) for k, v in batch.items()},
            output_hidden_states=True, output_attentions=True,
        )
    ours = encoder.model(
        batch["input_ids"], batch["attention_mask"], batch["token_type_ids"],
        output_hidden_states=True, output_attentions=True,
    )
    assert ours.last_hidden_state.shape == tuple(theirs.last_hidden_state.shape)
    assert ours.last_hidden_state.dtype == np.float32
    # Padded positions are never used and are ill-conditioned (transformers' own
    # float32 and float64 disagree there by ~1e-4): compare real tokens.
    diff = np.abs(ours.last_hidden_state - theirs.last_hidden_state.numpy())[real].max()
    _report("last hidden state", diff, 1e-5)
    assert diff <= 1e-5
    assert len(ours.hidden_states) == len(theirs.hidden_states) == 7
    for layer, (a, b) in enumerate(zip(ours.hidden_states, theirs.hidden_states)):
        assert np.abs(a - b.numpy())[real].max() <= 1e-5, f"hidden state {layer}"
    assert len(ours.attentions) == 6
    worst = 0.0
    for a, b in zip(ours.attentions, theirs.attentions):
        assert a.shape == tuple(b.shape)  # (B, H, T, T)
        rows = real[:, None, :, None] & np.ones(a.shape, bool)  # real query rows
        worst = max(worst, float(np.abs(a - b.numpy())[rows].max()))
        # padded keys get exactly zero weight: masked means excluded
        assert np.all(a[np.broadcast_to(~real[:, None, None, :], a.shape)] == 0)
    _report("attention probabilities", worst, 1e-5)
    assert worst <= 1e-5


def test_attention_extraction_matches_transformers(encoder, hf_model):
    text = "The quick brown fox jumps over the lazy dog, naïvely."
    tokens, weights = encoder.attention(text)
    ids = encoder.tokenizer.encode([text])[0].ids
    with torch.no_grad():
        theirs = hf_model(input_ids=torch.tensor([ids]), output_attentions=True).attentions
    expected = np.stack([a[0].numpy() for a in theirs])  # (layers, H, T, T)
    assert tokens[0] == "[CLS]" and tokens[-1] == "[SEP]" and len(tokens) == len(ids)
    assert weights.shape == (6, 12, len(tokens), len(tokens)) and weights.dtype == np.float32
    diff = float(np.abs(weights - expected).max())
    _report("attention(text)", diff, 1e-5)
    assert diff <= 1e-5
    np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)


def test_fast_path_matches_reference_modules(encoder):
    """encode()'s packed, in-place path against the attnkit.nn modules, per sentence."""
    texts = ["Hello, world!", "Café, naïve, résumé.", "", LONG_TEXT]
    encodings = encoder.tokenizer.encode(texts)
    ids = np.concatenate([e.ids for e in encodings])
    lengths = np.array([len(e.ids) for e in encodings])
    packed, _ = encoder._packed.forward(ids, np.zeros_like(ids), lengths)
    start = 0
    for n, e in zip(lengths, encodings):
        reference = encoder.model(np.array([e.ids])).last_hidden_state[0]
        assert np.abs(packed[start : start + n] - reference).max() <= 1e-5
        start += n


def test_embeddings_match_sentence_transformers(encoder, st_model):
    expected = st_model.encode(SENTENCES, batch_size=16, convert_to_numpy=True)
    got = encoder.encode(SENTENCES, batch_size=7)  # several batches, results in input order
    assert got.shape == (len(SENTENCES), 384) and got.dtype == np.float32
    diff = float(np.abs(got - expected).max())
    cosine = np.sum(got * expected, axis=1) / (
        np.linalg.norm(got, axis=1) * np.linalg.norm(expected, axis=1)
    )
    _report(f"embeddings of {len(SENTENCES)} sentences", diff, 1e-6)
    print(f"min cosine similarity: {cosine.min():.9f}")
    assert diff <= 1e-6
    assert cosine.min() >= 0.999999
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)


def test_batching_and_threads_do_not_change_results(encoder):
    texts = SENTENCES[:20]
    base = encoder.encode(texts, batch_size=32)
    one_by_one = np.concatenate([encoder.encode([t]) for t in texts])
    single_thread = SentenceEncoder(encoder.model, encoder.tokenizer, num_threads=1).encode(texts, batch_size=3)
    assert np.abs(base - one_by_one).max() <= 1e-6
    assert np.abs(base - single_thread).max() <= 1e-6
    reversed_order = encoder.encode(texts[::-1], batch_size=5)[::-1]
    assert np.abs(base - reversed_order).max() <= 1e-6


def test_encode_shapes_and_progress(encoder):
    assert encoder.encode("one string").shape == (1, 384)
    assert encoder.encode([]).shape == (0, 384)
    texts = ["a tuple", "of sentences"]
    assert np.array_equal(encoder.encode(tuple(texts)), encoder.encode(np.array(texts)))
    seen = []
    encoder.encode(["a", "b", "c", "d", "e"], batch_size=2, progress=seen.append)
    assert seen == [2, 2, 1]
    similar = encoder.similarity(["A man is eating food.", "A man eats a meal.", "The sky is blue."])
    assert similar.shape == (3, 3)
    assert similar[0, 1] > similar[0, 2]
    np.testing.assert_allclose(np.diag(similar), 1.0, atol=1e-5)


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


def test_other_bad_arguments(encoder):
    with pytest.raises(ValueError, match="batch_size"):
        encoder.encode(["a"], batch_size=0)
    with pytest.raises(TypeError, match="text to be a str, got int"):
        encoder.attention(5)
    with pytest.raises(ValueError, match="input_ids"):
        encoder.model(np.array([[101, 10**6]]))
    with pytest.raises(ValueError, match="num_threads"):
        SentenceEncoder(encoder.model, encoder.tokenizer, num_threads=0)


def test_gelu_inplace_is_exact_gelu():
    x = np.concatenate(
        [np.linspace(-12, 12, 4001), np.random.default_rng(0).standard_normal(5000) * 3, [0.0, -0.0, 1e-30, -1e-30]]
    ).astype(np.float32)
    exact = np.array([0.5 * v * math.erfc(-v / math.sqrt(2)) for v in x.astype(np.float64)])
    got = gelu_inplace(x.reshape(-1, 1).repeat(3, axis=1).copy())[:, 0]
    eps = float(np.finfo(np.float32).eps)
    # relative error, measured against max(|GELU(x)|, 1e-3): float32-level everywhere,
    # including the negative tail where 0.5 * x * (1 + erf) would cancel
    err = np.abs(got - exact) / np.maximum(np.abs(exact), 1e-3) / eps
    print(f"gelu_inplace: {err.max():.1f} eps relative, {np.abs(got - exact).max():.2e} absolute")
    assert err.max() <= 16
    assert np.abs(got - exact).max() <= 5e-7
    assert not np.isnan(got).any()
    torch_gelu = torch.nn.functional.gelu(torch.from_numpy(x)).numpy()
    assert np.abs(got - torch_gelu).max() <= 4e-6


def test_flash_backend_gives_the_same_embeddings(encoder):
    flash = SentenceEncoder(encoder.model, encoder.tokenizer, attention="flash")
    texts = SENTENCES[:6] + [LONG_TEXT]
    assert np.abs(flash.encode(texts) - encoder.encode(texts)).max() <= 1e-6
    encoder.model.set_attention_backend("naive")
    with pytest.raises(ValueError, match="unknown attention backend"):
        SentenceEncoder(encoder.model, encoder.tokenizer, attention="nope")
