"""A GGUF file's SentencePiece tokenizer (`tokenizer.ggml.model == "llama"`), rebuilt with
Hugging Face `tokenizers`, as Gemma's files describe it.

What the file stores, and what each piece becomes:

- `tokenizer.ggml.tokens`: the pieces, in the file's order. A space is spelled "▁" (the
  leading-space convention: " the" is the piece "▁the"), except that Gemma's files spell a
  piece of two or more spaces with real spaces; those are respelled "▁▁..." so text, whose
  spaces the normalizer turns into "▁", can reach them.
- The merges: a SentencePiece BPE model has none in the file. Each piece that two other
  pieces concatenate to is a merge of those two, ranked by the piece's position in the file
  (Gemma's `tokenizer.ggml.scores` do not follow its merge order; the position does), then
  the longer left part first. This is the rule transformers' GGUF loader uses, so both give
  the same ids. Deriving them takes a second for Gemma's 262 144 pieces, so they are kept
  in the user cache (`cached_merges`).
- `tokenizer.ggml.token_type`: 6 (byte) marks the pieces "<0x00>".."<0xFF>" that byte
  fallback spells an unknown character with, UTF-8 byte by byte; 3 (control) marks special
  tokens ("<bos>", "<start_of_turn>", ...), never split from text; 4 (user-defined) marks
  pieces matched whole wherever they appear.
- `tokenizer.ggml.add_space_prefix`: whether " " is put before the text (a dummy prefix);
  Gemma's files say False, and a True is refused (nothing here prepends it).
- `tokenizer.ggml.bos_token_id`, `add_bos_token`: BOS first, as llama.cpp and transformers do.

Decoding: "▁" back to " ", byte pieces joined back into UTF-8 (`ByteFallback`), and the
pieces fused into one string.
"""

from __future__ import annotations

import hashlib
import json
import operator
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from attnkit.models.checkpoint import CheckpointError, ConfigReader

__all__ = ["cached_merges", "sentencepiece_decoder_tokenizer", "sentencepiece_merges", "sentencepiece_tokenizer"]

_CONTROL, _USER_DEFINED = 3, 4
_SPACE = "\u2581"  # "▁", SentencePiece's spelling of a space


def respell_spaces(tokens: Sequence[str]) -> list[str]:
    """Gemma's pieces of only spaces ("  ") spelled with "▁" as every other piece spells a space."""
    return [_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]


def _merge_ids(tokens: Sequence[str]) -> np.ndarray:
    """`sentencepiece_merges` as ids: (n, 2) int32, (left id, right id) best first."""
    ids = {token: index for index, token in enumerate(tokens)}
    ranked = []
    for index, token in enumerate(tokens):
        if ids.get(token) != index:  # a duplicate piece: the vocabulary keeps its first id
            continue
        for cut in range(1, len(token)):
            left_id = ids.get(token[:cut])
            if left_id is None:
                continue
            right_id = ids.get(token[cut:])
            if right_id is None:
                continue
            ranked.append((index, -cut, left_id, right_id))
    ranked.sort()
    pairs = np.array([(left, right) for _, _, left, right in ranked], dtype=np.int32)
    return pairs.reshape(-1, 2)


def sentencepiece_merges(tokens: Sequence[str]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies, best first.

    Every split of a piece into two pieces of the vocabulary is a merge; merges rank by the
    position of the piece they make (earlier first), then by the length of their left part
    (longer first), then by the ids of the two parts.

    Arguments:
        tokens: the pieces, in the file's order (position = id).

    Returns:
        [(left, right), ...] for `tokenizers.models.BPE`.
    """
    return _pieces_of(_merge_ids(tokens), tokens)


def _pieces_of(pairs: np.ndarray, tokens: Sequence[str]) -> list[tuple[str, str]]:
    if not len(pairs):
        return []
    if len(pairs) == 1:
        return [(tokens[pairs[0, 0]], tokens[pairs[0, 1]])]
    lefts = operator.itemgetter(*pairs[:, 0].tolist())(tokens)
    rights = operator.itemgetter(*pairs[:, 1].tolist())(tokens)
    return list(zip(lefts, rights))


# The merges of a vocabulary are a pure function of its pieces, and deriving them is most of a
# Gemma tokenizer's load (docs/benchmarks.md); they are kept, as ids, in the user
# cache under a digest of the pieces (and of this rule's version), so a warm load reads 4 MB.
_MERGES_VERSION = 1


def _merges_cache(tokens: Sequence[str]) -> Path:
    digest = hashlib.sha256(json.dumps(list(tokens), ensure_ascii=False).encode("utf-8", "surrogatepass"))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "attnkit" / "sentencepiece" / f"merges-v{_MERGES_VERSION}-{digest.hexdigest()[:40]}.npy"


def cached_merges(tokens: Sequence[str]) -> list[tuple[str, str]]:
    """`sentencepiece_merges(tokens)`, read from the user cache when an earlier call stored
    them (`~/.cache/attnkit/sentencepiece/`, keyed by a sha256 of the pieces); a missing,
    unreadable or malformed entry is derived again (and stored when the folder is writable)."""
    path = _merges_cache(tokens)
    pairs = None
    try:
        loaded = np.load(path, allow_pickle=False)
        if loaded.dtype == np.int32 and loaded.ndim == 2 and loaded.shape[1] == 2 and (
                not loaded.size or (loaded.min() >= 0 and loaded.max() < len(tokens))):
            pairs = loaded
    except (OSError, ValueError):
        pass
    if pairs is None:
        pairs = _merge_ids(tokens)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(f"{path.stem}.{os.getpid()}.{threading.get_ident()}.partial.npy")
            np.save(partial, pairs)
            os.replace(partial, path)  # whole or absent, never half written
        except OSError:
            pass  # a read-only cache: derived at every load, nothing else changes
    return _pieces_of(pairs, tokens)


def sentencepiece_tokenizer(metadata: Mapping[str, Any], source: Any):
    """The `tokenizers.Tokenizer` of a SentencePiece BPE vocabulary in GGUF metadata.

    Arguments:
        metadata: the file's metadata (`tokenizer.ggml.*` keys).
        source: the file, for messages.

    Returns:
        A `tokenizers.Tokenizer` (special tokens added; BOS/EOS are the caller's, through
        `DecoderTokenizer`).

    Raises:
        CheckpointError (a ValueError): naming the file: a missing or malformed vocabulary, token
            types that do not list one per token, or a dummy space prefix (`add_space_prefix`).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

    tokens = metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise CheckpointError(f"{source} lacks tokenizer.ggml.tokens (a list of strings), which its tokenizer needs")
    token_types = metadata.get("tokenizer.ggml.token_type", [])
    if not isinstance(token_types, list) or (token_types and len(token_types) != len(tokens)):
        raise CheckpointError(
            f"{source}: expected tokenizer.ggml.token_type to list one type per token ({len(tokens)})"
        )
    if metadata.get("tokenizer.ggml.add_space_prefix", False):
        raise CheckpointError(
            f"{source}: tokenizer.ggml.add_space_prefix is True; attnkit's SentencePiece tokenizer adds no "
            "dummy space prefix (Gemma's files say False), so the file is refused rather than tokenized differently"
        )
    unknown_id = metadata.get("tokenizer.ggml.unknown_token_id")
    if unknown_id is not None and not (isinstance(unknown_id, int) and 0 <= unknown_id < len(tokens)):
        raise CheckpointError(
            f"{source}: tokenizer.ggml.unknown_token_id is {unknown_id!r}, outside the vocabulary of {len(tokens)} tokens"
        )
    pieces = respell_spaces(tokens)
    vocab = dict(zip(pieces, range(len(pieces))))
    if len(vocab) != len(pieces):  # a duplicate piece: keep its first id
        vocab = {}
        for index, piece in enumerate(pieces):
            vocab.setdefault(piece, index)
    try:
        bpe = models.BPE(
            vocab=vocab, merges=cached_merges(pieces), dropout=None, fuse_unk=True, byte_fallback=True,
            unk_token=None if unknown_id is None else pieces[unknown_id],
        )
    except Exception as error:  # noqa: BLE001 - tokenizers' Rust errors
        raise CheckpointError(f"{source}: the vocabulary does not form a BPE model: {error}") from None
    tokenizer = Tokenizer(bpe)
    tokenizer.normalizer = normalizers.Replace(" ", _SPACE)  # no dummy prefix: " the" and "the" differ
    tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tokenizer.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    control = [AddedToken(t, normalized=False, special=True)
               for t, kind in zip(pieces, token_types) if kind == _CONTROL]
    user_defined = [AddedToken(t, normalized=False, special=False)
                    for t, kind in zip(pieces, token_types) if kind == _USER_DEFINED]
    if control:
        tokenizer.add_special_tokens(control)
    if user_defined:
        tokenizer.add_tokens(user_defined)
    return tokenizer


def sentencepiece_decoder_tokenizer(metadata: Mapping[str, Any], source: Any):
    """`sentencepiece_tokenizer` with its special tokens and chat template: a
    `attnkit.models.chat.DecoderTokenizer` that puts BOS first when `tokenizer.ggml.add_bos_token`
    says so (absent: True, llama.cpp's default for a SentencePiece vocabulary, which transformers
    follows).

    Raises:
        CheckpointError (a ValueError): naming the file, as `sentencepiece_tokenizer`, or a special
            token id outside the vocabulary.
    """
    tokenizer = sentencepiece_tokenizer(metadata, source)
    pieces = respell_spaces(metadata["tokenizer.ggml.tokens"])
    return gguf_decoder_tokenizer(tokenizer, pieces, metadata, source, add_bos_default=True)


def gguf_decoder_tokenizer(tokenizer: Any, pieces: Sequence[str], metadata: Mapping[str, Any], source: Any, *,
                           add_bos_default: bool):
    """`tokenizer` (a `tokenizers.Tokenizer` of the vocabulary `pieces`) with a GGUF file's
    special tokens (`tokenizer.ggml.{bos,eos,padding}_token_id`), its BOS/EOS flags
    (`add_bos_token` absent: `add_bos_default`) and chat template, as an
    `attnkit.models.chat.DecoderTokenizer`; every GGUF tokenizer kind ends here.

    Raises:
        CheckpointError (a ValueError): naming the file: a special token id outside the
            vocabulary, or a chat template that is not a string.
    """
    from attnkit.models.chat import DecoderTokenizer

    read = ConfigReader(metadata, source, prefix="tokenizer.ggml.")

    def token_of(key: str) -> str | None:
        ids = read.token_ids(key)
        if not ids:
            return None
        if ids[0] >= len(pieces):
            raise CheckpointError(
                f"{source}: tokenizer.ggml.{key} is {ids[0]}, outside the vocabulary of {len(pieces)} tokens"
            )
        return pieces[ids[0]]

    template = metadata.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise CheckpointError(f"{source}: expected tokenizer.chat_template to be a string")
    return DecoderTokenizer(
        tokenizer,
        bos_token=token_of("bos_token_id"),
        eos_token=token_of("eos_token_id"),
        pad_token=token_of("padding_token_id"),
        add_bos_token=read.flag("add_bos_token", add_bos_default),
        add_eos_token=read.flag("add_eos_token", False),
        chat_template=template,
    )
