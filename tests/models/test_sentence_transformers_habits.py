"""SentenceEncoder used as sentence-transformers users use SentenceTransformer.

sentence-transformers' documented usage (its README's first example) runs with attnkit swapped
in, and every call that shares a name gives sentence-transformers' shapes, dtypes and
types, and values within the float64-grounded budget of tests/models/test_bert.py: attnkit's
float32 error against the model run in float64 is at most twice sentence-transformers'
own float32 error (conftest.assert_within_budget).
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import replace

import numpy as np
import pytest
from conftest import assert_within_budget

from attnkit.models import SentenceEncoder

README_SENTENCES = [  # sentence-transformers' README
    "The weather is lovely today.",
    "It's so sunny outside!",
    "He drove to the stadium.",
]
QUERIES = ["A man is eating food.", "Someone in a gorilla costume is playing a set of drums."]


@pytest.fixture(scope="module")
def encoder(minilm_folder):
    return SentenceEncoder.from_pretrained("minilm", num_threads=1)


@pytest.fixture(scope="module")
def st_models(minilm_folder, sentence_transformers, torch):
    """sentence-transformers' model in float32 (the oracle) and cast to float64 (the truth)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = sentence_transformers.SentenceTransformer(str(minilm_folder), device="cpu")
    yield model, copy.deepcopy(model).double()
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_the_readme_example_runs_with_attnkit_swapped_in(encoder, st_models):
    st, st64 = st_models
    results = {}
    for name, model in (("attnkit", encoder), ("sentence-transformers", st), ("float64", st64)):
        embeddings = model.encode(README_SENTENCES)
        similarities = model.similarity(embeddings, embeddings)
        results[name] = embeddings, similarities
    (ours, our_sim), (theirs, their_sim), (truth, true_sim) = results.values()
    assert ours.shape == theirs.shape == (3, 384) and ours.dtype == theirs.dtype == np.float32
    assert our_sim.shape == tuple(their_sim.shape) == (3, 3) and our_sim.dtype == np.float32
    assert_within_budget(ours, theirs, truth, what="README embeddings")
    assert_within_budget(our_sim, their_sim.numpy(), true_sim.numpy(), what="README similarities")


@pytest.mark.slow
def test_encode_shapes_types_and_flags_match_sentence_transformers(encoder, st_models, torch):
    st, st64 = st_models
    one, theirs = encoder.encode("one string"), st.encode("one string")
    assert one.shape == theirs.shape == (384,) and one.dtype == theirs.dtype == np.float32
    assert_within_budget(one, theirs, st64.encode("one string"), what="one string")
    assert encoder.encode(["one string"]).shape == (1, 384)

    for flags in ({"convert_to_tensor": True}, {"convert_to_numpy": False}, {}):
        for sentences in ("one string", QUERIES):
            got, expected = encoder.encode(sentences, **flags), st.encode(sentences, **flags)
            assert type(got) is type(expected), (flags, sentences)
            if isinstance(got, list):
                assert [tuple(g.shape) for g in got] == [tuple(e.shape) for e in expected]
                assert all(isinstance(g, torch.Tensor) and g.dtype == torch.float32 for g in got)
            else:
                assert tuple(got.shape) == tuple(expected.shape) and str(got.dtype) == str(expected.dtype)

    seen = []
    ours = encoder.encode(QUERIES * 3, batch_size=2, show_progress_bar=True, normalize_embeddings=True,
                          progress=seen.append)
    assert seen == [2, 2, 2]
    theirs = st.encode(QUERIES * 3, batch_size=2, normalize_embeddings=True)
    truth = st64.encode(QUERIES * 3, batch_size=2, normalize_embeddings=True)
    assert_within_budget(ours, theirs, truth, what="normalize_embeddings=True")
    assert encoder.get_sentence_embedding_dimension() == encoder.get_embedding_dimension() == 384
    assert st.get_embedding_dimension() == 384
    assert encoder.get_max_seq_length() == st.get_max_seq_length() == 256
    assert encoder.similarity_fn_name == st.similarity_fn_name == "cosine"


@pytest.mark.slow
def test_progress_bar_writes_nothing_to_stdout(encoder, capsys):
    plain = encoder.encode(QUERIES)
    with_bar = encoder.encode(QUERIES, show_progress_bar=True)
    assert np.array_equal(plain, with_bar)
    assert capsys.readouterr().out == ""


@pytest.mark.slow
def test_similarity_takes_embeddings_as_sentence_transformers_does(encoder, st_models, torch):
    st, st64 = st_models
    a, b = encoder.encode(QUERIES), encoder.encode(README_SENTENCES)
    sa, sb = st.encode(QUERIES), st.encode(README_SENTENCES)
    ta, tb = st64.encode(QUERIES), st64.encode(README_SENTENCES)
    got, expected, truth = encoder.similarity(a, b), st.similarity(sa, sb), st64.similarity(ta, tb)
    assert got.shape == tuple(expected.shape) == (2, 3)
    # a cosine of unit vectors rounds at the vectors' size (1), not at its own (~0.1-0.8):
    # the ulps are counted at 1, as BLAS kernels on other CPUs round its 384 products otherwise
    assert_within_budget(got, expected.numpy(), truth.numpy(), what="similarity (2, 3)", scale=1.0)
    pairwise = encoder.similarity_pairwise(a, b[:2])
    assert_within_budget(pairwise, st.similarity_pairwise(sa, sb[:2]).numpy(),
                         st64.similarity_pairwise(ta, tb[:2]).numpy(), what="similarity_pairwise", scale=1.0)
    # tensors in, a tensor out; one vector is one row; a list of vectors is rows
    as_tensor = encoder.similarity(torch.from_numpy(a), torch.from_numpy(b))
    assert isinstance(as_tensor, torch.Tensor) and np.array_equal(as_tensor.numpy(), got)
    assert encoder.similarity(a[0], b).shape == tuple(st.similarity(sa[0], sb).shape) == (1, 3)
    assert np.array_equal(encoder.similarity(list(a), list(b)), got)


@pytest.mark.slow
def test_every_similarity_function_matches_sentence_transformers(encoder, st_models):
    from sentence_transformers import SimilarityFunction

    st, st64 = st_models
    a, b = encoder.encode(QUERIES), encoder.encode(README_SENTENCES)
    sa, sb = st.encode(QUERIES), st.encode(README_SENTENCES)
    ta, tb = st64.encode(QUERIES), st64.encode(README_SENTENCES)
    for name in ("cosine", "dot", "euclidean", "manhattan"):
        ours = SentenceEncoder(encoder.model, encoder.tokenizer, head=replace(encoder.head, similarity=name),
                               num_threads=1)
        function = SimilarityFunction(name)
        try:
            st.similarity_fn_name = st64.similarity_fn_name = function
            assert_within_budget(ours.similarity(a, b), st.similarity(sa, sb).numpy(),
                                 st64.similarity(ta, tb).numpy(), what=f"{name} similarity")
        finally:
            st.similarity_fn_name = st64.similarity_fn_name = SimilarityFunction("cosine")


@pytest.mark.slow
def test_the_old_text_form_of_similarity_still_works_with_a_warning(encoder):
    texts = ["A man is eating food.", "A man eats a meal.", "The sky is blue."]
    with pytest.warns(DeprecationWarning, match=r"similarity\(texts\) is deprecated"):
        old = encoder.similarity(texts)
    e = encoder.encode(texts)
    assert np.array_equal(old, encoder.similarity(e, e)) and old.shape == (3, 3)
    with pytest.raises(TypeError, match="got text; encode it first"):
        encoder.similarity(texts, texts)
    with pytest.raises(TypeError, match="one argument"):
        encoder.similarity(e)
    with pytest.raises(ValueError, match="same width"):
        encoder.similarity(e, e[:, :10])


@pytest.mark.slow
def test_bad_flags_are_refused_by_name(encoder):
    with pytest.raises(ValueError, match="precision 'float32'"):
        encoder.encode("x", precision="int8")
    with pytest.raises(ValueError, match="batch_size"):
        encoder.encode("x", batch_size=0)


def test_torch_results_name_the_torch_extra(encoder, monkeypatch):
    import importlib

    from attnkit.extras import MissingExtraError

    real = importlib.import_module

    def no_torch(name, *args):
        if name == "torch":
            raise ModuleNotFoundError("No module named 'torch'", name="torch")
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", no_torch)
    for flags in ({"convert_to_tensor": True}, {"convert_to_numpy": False}):
        with pytest.raises(MissingExtraError, match=r"pip install 'attnkit\[torch\]'"):
            encoder.encode("x", **flags)


def test_short_names_load_the_embedded_models(minilm_folder):
    from attnkit.models.embedded import DECODER, ENCODER, embedded_path

    for name in ("minilm", "MiniLM", "all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"):
        assert embedded_path(name, ENCODER) == minilm_folder
    assert embedded_path(str(minilm_folder), ENCODER) is None and embedded_path(None, ENCODER) is None
    with pytest.raises(ValueError, match="not a sentence encoder"):
        SentenceEncoder.from_pretrained("smollm2")
    from attnkit.models import AutoCausalLM

    with pytest.raises(ValueError, match="not a text generator"):
        AutoCausalLM.from_pretrained("minilm")
    with pytest.raises(ValueError, match="not a text generator"):
        embedded_path("minilm", DECODER)


@pytest.mark.slow
def test_smollm2_by_name_is_the_embedded_decoder(smollm2_file, gguf):
    from attnkit.models import AutoCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        by_name, by_path = AutoCausalLM.from_pretrained("smollm2"), AutoCausalLM.from_pretrained(smollm2_file)
    assert type(by_name) is type(by_path) and by_name.config == by_path.config
