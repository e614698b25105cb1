"""sentence-transformers' first line works: `SentenceEncoder("all-MiniLM-L6-v2")` (and a
folder path) builds the model by name; `attnkit.models.SentenceTransformer` is the same class;
`SentenceEncoder` lives in attnkit.models.sentence and stays importable from bert."""

from __future__ import annotations

import numpy as np
import pytest

from attnkit.models import SentenceEncoder, SentenceTransformer


def test_the_names_are_one_class_wherever_imported():
    from attnkit.models import bert, sentence

    assert SentenceTransformer is SentenceEncoder is sentence.SentenceEncoder is bert.SentenceEncoder
    assert SentenceEncoder.__module__ == "attnkit.models.sentence"
    assert bert.BertModel.__module__ == "attnkit.models.bert_model"
    assert sentence.Pooling is not None and sentence.read_modules is not None  # the head's names, as before


@pytest.mark.parametrize("name", ["all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2", "minilm", None])
def test_a_name_builds_the_embedded_model(minilm_folder, name):
    encoder = SentenceEncoder(name) if name is not None else SentenceEncoder()
    reference = SentenceEncoder.from_pretrained(minilm_folder)
    texts = ["The cat sat on the mat.", "A dog ran."]
    assert encoder.path == reference.path and encoder.max_seq_length == reference.max_seq_length
    np.testing.assert_array_equal(encoder.encode(texts), reference.encode(texts))


def test_a_folder_path_and_the_loader_keywords(minilm_folder):
    encoder = SentenceTransformer(str(minilm_folder), backend="flash", num_threads=1)
    assert encoder.num_threads == 1
    assert {m.backend for _, m in encoder.named_modules() if hasattr(m, "backend")} == {"flash"}


def test_parts_given_with_a_name_or_missing_are_refused(minilm_folder):
    encoder = SentenceEncoder(minilm_folder)
    with pytest.raises(TypeError, match="expected no tokenizer with a model name or folder"):
        SentenceEncoder("all-MiniLM-L6-v2", encoder.tokenizer)
    with pytest.raises(TypeError, match="expected the BertTokenizer of the BertModel given"):
        SentenceEncoder(encoder.model)
    rebuilt = SentenceEncoder(encoder.model, encoder.tokenizer, head=encoder.head)  # from parts, as before
    np.testing.assert_array_equal(rebuilt.encode(["a b"]), encoder.encode(["a b"]))


def test_an_unknown_name_says_attnkit_never_downloads():
    with pytest.raises((ValueError, OSError)) as caught:
        SentenceEncoder("no-such-model-anywhere")
    assert "no-such-model-anywhere" in str(caught.value) and "never downloads" in str(caught.value)
