"""BERT's word-piece tokenizer, through the `tokenizers` library (imported when a
tokenizer is built, so importing this module stays light)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from attnkit.models.checkpoint import CheckpointError, check_folder, read_json


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
        settings = read_json(config_path) if config_path.is_file() else {}
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
        if (folder / "tokenizer.json").is_file():
            try:
                tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
            except Exception as error:  # tokenizers raises a bare Exception
                raise CheckpointError(
                    f"cannot read {folder / 'tokenizer.json'}: {error}"
                ) from None
            if tokenizer_class != "PreTrainedTokenizerFast":
                tokenizer.normalizer = normalizers.BertNormalizer(**bert_normalizer)
        elif (folder / "vocab.txt").is_file():
            from tokenizers.implementations import BertWordPieceTokenizer

            if tokenizer_class == "PreTrainedTokenizerFast":
                raise CheckpointError(
                    f"no tokenizer.json in {folder}, which tokenizer_class {tokenizer_class!r} needs"
                )
            tokenizer = BertWordPieceTokenizer(
                str(folder / "vocab.txt"),
                lowercase=bert_normalizer["lowercase"],
                strip_accents=bert_normalizer["strip_accents"],
                handle_chinese_chars=bert_normalizer["handle_chinese_chars"],
            )._tokenizer  # the tokenizers.Tokenizer inside the convenience wrapper
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

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size()



__all__ = ["BertTokenizer", "check_texts"]
