"""BERT's word-piece tokenizer, through the `tokenizers` library (imported when a
tokenizer is built, so importing this module stays light)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from attnkit.models.checkpoint import (
    CheckpointError,
    check_folder,
    is_model_file,
    read_json,
    read_model_text,
    token_id_count,
)


def check_texts(texts: Any) -> list[str]:
    """A list of strings from a string or a sequence of strings; TypeError otherwise."""
    if isinstance(texts, str):
        return [texts]
    if isinstance(texts, np.ndarray) and texts.ndim == 1:
        texts = texts.tolist()  # numpy str_ elements become str
    if isinstance(texts, (bytes, bytearray)) or not isinstance(texts, Sequence):
        raise TypeError(
            f"expected a str or a sequence of str, got {type(texts).__name__}"
        )
    for index, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"expected texts[{index}] to be a str, got {type(text).__name__}")
    return list(texts)


class BertTokenizer:
    """Word-piece tokenization through the `tokenizers` library.

    Reads a folder's tokenizer.json, or builds the standard BERT pipeline from
    vocab.txt. As transformers' BertTokenizer does, the normalizer follows
    tokenizer_config.json (`do_lower_case`, default true; `strip_accents`;
    `tokenize_chinese_chars`), whatever tokenizer.json says. Inputs longer than
    `max_length` tokens (special tokens included) are cut on the side
    `truncation_side` names; nothing is padded here: the model pads per batch.
    """

    def __init__(self, tokenizer: Any, max_length: int, *, truncation_side: str = "right") -> None:
        if truncation_side not in ("right", "left"):
            raise ValueError(f"expected truncation_side 'right' or 'left', got {truncation_side!r}")
        self.max_length = int(max_length)
        self.truncation_side = truncation_side
        tokenizer.no_padding()
        tokenizer.enable_truncation(max_length=self.max_length, direction=truncation_side)
        self._tokenizer = tokenizer

    @classmethod
    def from_folder(cls, folder: str | Path, max_length: int, *, lowercase: bool = False) -> BertTokenizer:
        """Load the tokenizer of a model folder (tokenizer.json, else vocab.txt).

        Arguments:
            folder: the folder with tokenizer.json or vocab.txt (and tokenizer_config.json).
            max_length: the longest input in tokens.
            lowercase: lower-case every text first (sentence_bert_config.json's
                `do_lower_case`, which sentence-transformers applies on top of the tokenizer).

        Raises:
            CheckpointError: no tokenizer, an unreadable one, a tokenizer class other
                than BERT's, or left padding (which shifts BERT's absolute positions).
        """
        from tokenizers import Tokenizer, normalizers

        folder = check_folder(folder)
        config_path = folder / "tokenizer_config.json"
        settings = read_json(config_path) if is_model_file(config_path) else {}
        tokenizer_class = settings.get("tokenizer_class")
        if tokenizer_class not in (None, "BertTokenizer", "BertTokenizerFast", "PreTrainedTokenizerFast"):
            raise CheckpointError(
                f"unsupported tokenizer_class {tokenizer_class!r} in {config_path}; expected "
                "BertTokenizer, BertTokenizerFast or PreTrainedTokenizerFast (tokenizer.json as written)"
            )
        padding_side = settings.get("padding_side", "right")
        if padding_side != "right":
            raise CheckpointError(
                f"unsupported padding_side {padding_side!r} in {config_path}; expected 'right' "
                "(left padding shifts BERT's absolute positions, so results depend on the batch)"
            )
        truncation_side = settings.get("truncation_side", "right")
        if truncation_side not in ("right", "left"):
            raise CheckpointError(
                f"unsupported truncation_side {truncation_side!r} in {config_path}; expected 'right' or 'left'"
            )
        for key in ("do_lower_case", "strip_accents", "tokenize_chinese_chars"):
            if not isinstance(settings.get(key, False), bool) and settings.get(key) is not None:
                raise CheckpointError(f"unexpected {key}={settings[key]!r} in {config_path}; expected true or false")
        bert_normalizer = dict(
            clean_text=True,
            handle_chinese_chars=bool(settings.get("tokenize_chinese_chars", True)),
            strip_accents=settings.get("strip_accents"),
            lowercase=bool(settings.get("do_lower_case", True)),
        )
        if is_model_file(folder / "tokenizer.json"):
            path = folder / "tokenizer.json"
            try:  # read here (a regular file, UTF-8); tokenizers never opens the path itself
                tokenizer = Tokenizer.from_str(read_model_text(path))
            except CheckpointError:
                raise
            except Exception as error:  # tokenizers raises a bare Exception
                raise CheckpointError(f"cannot read {path}: {error}") from None
            if tokenizer_class != "PreTrainedTokenizerFast":
                tokenizer.normalizer = normalizers.BertNormalizer(**bert_normalizer)
        elif is_model_file(folder / "vocab.txt"):
            from tokenizers.implementations import BertWordPieceTokenizer

            if tokenizer_class == "PreTrainedTokenizerFast":
                raise CheckpointError(
                    f"no tokenizer.json in {folder}, which tokenizer_class {tokenizer_class!r} needs"
                )
            vocab = read_vocab_txt(folder / "vocab.txt")
            try:
                tokenizer = BertWordPieceTokenizer(
                    vocab,
                    lowercase=bert_normalizer["lowercase"],
                    strip_accents=bert_normalizer["strip_accents"],
                    handle_chinese_chars=bert_normalizer["handle_chinese_chars"],
                )._tokenizer  # the tokenizers.Tokenizer inside the convenience wrapper
            except Exception as error:  # noqa: BLE001 - a TypeError for a missing [SEP], tokenizers' own
                raise CheckpointError(f"cannot build a word-piece tokenizer from {folder / 'vocab.txt'}: {error}") from None
        else:
            raise CheckpointError(f"no tokenizer in {folder}: expected tokenizer.json or vocab.txt")
        if lowercase:
            existing = tokenizer.normalizer
            steps = [normalizers.Lowercase()] + ([existing] if existing is not None else [])
            tokenizer.normalizer = normalizers.Sequence(steps)
        return cls(tokenizer, max_length, truncation_side=truncation_side)

    def encode(self, texts: str | Sequence[str]) -> list[Any]:
        """Tokenize; returns one `tokenizers.Encoding` per text (.ids, .type_ids, .tokens)."""
        return self._tokenizer.encode_batch(check_texts(texts))

    def encode_ids(self, texts: str | Sequence[str]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Tokenize for a model: (ids, type_ids), one (T,) integer array of each per text, the
        same numbers as `encode` gives. Skips what only `encode` needs (each token's character
        offsets: tokenizers' `encode_batch_fast`, where the installed tokenizers has it)."""
        texts = check_texts(texts)
        encode_batch = getattr(self._tokenizer, "encode_batch_fast", self._tokenizer.encode_batch)
        encodings = encode_batch(texts)
        return ([np.asarray(e.ids, dtype=np.intp) for e in encodings],
                [np.asarray(e.type_ids, dtype=np.intp) for e in encodings])

    @property
    def vocab_size(self) -> int:
        """The ids this tokenizer can produce are 0 to vocab_size - 1 (one more than its
        largest id, which a vocabulary with gaps puts above its number of tokens): the rows
        the model's embedding must have."""
        return token_id_count(self._tokenizer)



# What Rust's `str::trim_end` removes (Unicode White_Space), which tokenizers' WordPiece
# applies to each vocab.txt line; Python's `str.isspace` adds \x1c-\x1f.
_RUST_WHITESPACE = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a"
    "\u2028\u2029\u202f\u205f\u3000"
)


def read_vocab_txt(path: Path) -> dict[str, int]:
    """A BERT vocab.txt as token -> id (the line number), read as tokenizers' `WordPiece.read_file`
    does (lines split on "\n" with a trailing "\r" dropped, each trimmed at the end; a token
    listed twice keeps its last line), from a regular UTF-8 file.

    Raises:
        CheckpointError: not a regular file, or not UTF-8 (naming the byte offset).
    """
    text = read_model_text(path)
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the newline that ends the last line
    vocab: dict[str, int] = {}
    for index, line in enumerate(lines):
        vocab[line.removesuffix("\r").rstrip(_RUST_WHITESPACE)] = index
    if not vocab:
        raise CheckpointError(f"{path} is empty; expected one word piece per line")
    return vocab


__all__ = ["BertTokenizer", "check_texts", "read_vocab_txt"]
