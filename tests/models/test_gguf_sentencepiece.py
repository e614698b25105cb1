"""A GGUF file's SentencePiece tokenizer (`tokenizer.ggml.model` "llama", Gemma's) against
transformers' tokenizer of the same metadata: ids and decoded text equal on varied text."""

from __future__ import annotations

import pytest

from attnkit.models.checkpoint import CheckpointError
from attnkit.models.gguf import tokenizer_from_gguf
from attnkit.models.gguf_sentencepiece import sentencepiece_merges

TEXTS = [
    "The capital of France is",
    "hello abc ab a",
    "  two  spaces\tand\ttabs\n\nnewlines\n",
    " leading space",
    "trailing   ",
    "",
    "héllo wörld — ünïcödé 日本語 中文 한국어",
    "emoji 🤖🚀👩‍👩‍👧 ok",
    "digits 1234567890 3.14159 1e-9 12",
    "def f(x):\n    return x**2  # code\n",
    "<start_of_turn>user\nhello<end_of_turn>",
    "\x00\x01 control \x7f",
    "ﬁ ligature Ⅻ",
]

_BYTES = [f"<0x{b:02X}>" for b in range(256)]
_PIECES = ["\u2581", "a", "b", "c", "ab", "\u2581a", "\u2581ab", "abc", "  ", "   ", "h", "e", "l", "o", "he",
           "ll", "llo", "hello", "\u2581hello", "\n", "1", "2", "12", "\u2581\u2581h"]


def tiny_metadata(**changes):
    """A SentencePiece BPE vocabulary as a Gemma GGUF spells it: specials, 256 byte pieces,
    pieces whose merges the positions rank, two pieces of real spaces, a control token."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", *_BYTES, *_PIECES, "<start_of_turn>", "<end_of_turn>"]
    types = [3, 3, 3, 2] + [6] * 256 + [1] * len(_PIECES) + [3, 3]
    metadata = {
        "general.architecture": "gemma3",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * len(tokens),
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_space_prefix": False,
    }
    metadata.update(changes)
    return metadata


def transformers_tokenizer(transformers, metadata):
    """transformers' GGUF tokenizer builder on the same metadata (its internal entry points)."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    renames = GGUF_TOKENIZER_MAPPING["tokenizer"]
    tokenizer_dict = {name: metadata[f"tokenizer.{key}"] for key, name in renames.items()
                      if f"tokenizer.{key}" in metadata}
    backend, _ = convert_gguf_tokenizer(metadata["general.architecture"], tokenizer_dict)
    return backend


def test_merges_rank_by_position_then_longer_left():
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    assert sentencepiece_merges(tokens) == [("a", "b"), ("b", "c"), ("ab", "c"), ("a", "bc")]


def test_tiny_vocabulary_matches_transformers(transformers):
    metadata = tiny_metadata()
    ours = tokenizer_from_gguf(metadata)
    theirs = transformers_tokenizer(transformers, metadata)
    for text in TEXTS:
        expected = theirs.encode(text, add_special_tokens=False).ids
        got = ours.encode(text, add_special_tokens=False)
        assert got == expected, f"{text!r}: {got} != {expected}"
        assert ours.decode(got) == theirs.decode(expected, skip_special_tokens=False), text
    assert ours.encode("hello")[0] == 2  # BOS first, as tokenizer.ggml.add_bos_token says


def test_byte_fallback_and_spaces_round_trip():
    tokenizer = tokenizer_from_gguf(tiny_metadata())
    for text in TEXTS:
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    ids = tokenizer.encode("  h", add_special_tokens=False)
    assert ids != tokenizer.encode(" h", add_special_tokens=False)


def test_dummy_prefix_and_bad_metadata_refused():
    with pytest.raises(CheckpointError, match="add_space_prefix"):
        tokenizer_from_gguf(tiny_metadata(**{"tokenizer.ggml.add_space_prefix": True}))
    with pytest.raises(CheckpointError, match="token_type"):
        tokenizer_from_gguf(tiny_metadata(**{"tokenizer.ggml.token_type": [1, 2]}))
    with pytest.raises(CheckpointError, match="unknown_token_id"):
        tokenizer_from_gguf(tiny_metadata(**{"tokenizer.ggml.unknown_token_id": 10**6}))
    with pytest.raises(CheckpointError, match="'t5'"):
        tokenizer_from_gguf(tiny_metadata(**{"tokenizer.ggml.model": "t5"}))


@pytest.mark.slow
def test_gemma3_tokenizer_matches_transformers(transformers, gemma3_file):
    from attnkit.models.gguf import GGUFFile

    ours = tokenizer_from_gguf(GGUFFile(gemma3_file))
    theirs = transformers.AutoTokenizer.from_pretrained(str(gemma3_file.parent), gguf_file=gemma3_file.name)
    for text in TEXTS:
        expected = theirs.encode(text)
        got = ours.encode(text)
        assert got == expected, f"{text!r}: {got} != {expected}"
        assert ours.decode(got) == theirs.decode(expected), text
    assert ours.encode("The capital of France is") == [2, 818, 5279, 529, 7001, 563]


def test_merges_are_cached_by_the_pieces(tmp_path, monkeypatch):
    import numpy as np

    from attnkit.models import gguf_sentencepiece as sp

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    tokens = ["a", "b", "c", "ab", "bc", "abc", "\n", "a\nb"]
    expected = sentencepiece_merges(tokens)
    assert sp.cached_merges(tokens) == expected  # derived, then stored
    stored = list((tmp_path / "attnkit" / "sentencepiece").glob("merges-*.npy"))
    assert len(stored) == 1 and not list(stored[0].parent.glob("*.partial*"))
    monkeypatch.setattr(sp, "_merge_ids", lambda tokens: pytest.fail("derived again despite the cache"))
    assert sp.cached_merges(tokens) == expected  # read back
    assert sp._merges_cache(["a", "b\nc"]) != sp._merges_cache(["a\nb", "c"])  # pieces, not their text
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    np.save(stored[0], np.array([[0, 99]], dtype=np.int32))  # an id outside the vocabulary: derived again
    assert sp.cached_merges(tokens) == expected
    stored[0].write_bytes(b"not an array")
    assert sp.cached_merges(tokens) == expected
