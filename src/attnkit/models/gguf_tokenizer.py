"""The byte-level BPE tokenizer a GGUF file describes, rebuilt with Hugging Face `tokenizers`.

`tokenizer_from_gguf(gguf_file)` reads the `tokenizer.ggml.*` keys: the vocabulary and
merges, the pre-tokenizer's split by `tokenizer.ggml.pre` (`GGUF_PRE_TOKENIZERS`), the
control and user-defined tokens; SentencePiece files (Gemma) go to
`attnkit.models.gguf_sentencepiece`. `attnkit.models.gguf` re-exports both names.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from attnkit.models.checkpoint import CheckpointError, ConfigReader

__all__ = ["GGUF_PRE_TOKENIZERS", "tokenizer_from_gguf"]

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# How text is split into words before byte-level BPE, by `tokenizer.ggml.pre`. The regexes
# are those of transformers' GGUF converter (`GGUF_PRE_TOKENIZER_SPLITS`), which are llama.cpp's;
# "gpt2" is GPT-2's own split, and "digits" GPT-2's with every digit alone (llama.cpp's
# `\p{N}` first: SmolLM, StarCoder, ..., as their tokenizer.json files say).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GGUF_PRE_TOKENIZERS: dict[str, str] = {
    **dict.fromkeys(("gpt2", "mpt", "olmo", "jais"), "gpt2"),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"), "digits"),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}


def _pre_tokenizer(name: str | None, source):
    """The `tokenizers` pre-tokenizer for `tokenizer.ggml.pre` (absent: GPT-2's, as transformers does)."""
    from tokenizers import Regex, pre_tokenizers

    split = GGUF_PRE_TOKENIZERS.get("gpt2" if name is None else name)
    if split is None:
        raise CheckpointError(
            f"{source}: tokenizer.ggml.pre {name!r} is not supported; attnkit splits text the way of "
            f"{', '.join(sorted(GGUF_PRE_TOKENIZERS))} (an unknown split would tokenize text differently "
            "from the model's own tokenizer)"
        )
    if split == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    if split == "digits":
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated"),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


def tokenizer_from_gguf(gguf: Any, *, source: str | os.PathLike[str] = "GGUF metadata"):
    """The tokenizer a GGUF file describes, rebuilt with Hugging Face `tokenizers`.

    Supports byte-level BPE (`tokenizer.ggml.model == "gpt2"`), which GPT-2, SmolLM, Llama 3
    and Qwen use: the vocabulary and merges come from the file; the pre-tokenizer from
    `tokenizer.ggml.pre` (`GGUF_PRE_TOKENIZERS`; none given: GPT-2's, as transformers does);
    tokens the file marks as control (`<|im_start|>`, ...) become special tokens that are
    never split. BOS (and EOS) are added when `tokenizer.ggml.add_bos_token`
    (`add_eos_token`) says so, as transformers does.
    SentencePiece BPE (`tokenizer.ggml.model == "llama"`, Gemma) is built by
    `attnkit.models.gguf_sentencepiece`.

    Arguments:
        gguf: an `attnkit.models.gguf.GGUFFile`, or its metadata (a mapping).
        source: the file, for messages, when `gguf` is metadata.

    Returns:
        `attnkit.models.chat.DecoderTokenizer`, which also carries the chat template and the
        BOS/EOS ids.

    Raises:
        ValueError: naming the file: another tokenizer model (`t5`, ...),
            an unknown pre-tokenizer, a missing or malformed vocabulary.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if isinstance(gguf, Mapping):
        metadata = gguf
    else:  # a GGUFFile (attnkit.models.gguf, which imports this module)
        metadata, source = gguf.metadata, gguf.path
    read = ConfigReader(metadata, source, prefix="tokenizer.ggml.")
    kind = metadata.get("tokenizer.ggml.model")
    if kind == "llama":  # SentencePiece BPE (Gemma): attnkit.models.gguf_sentencepiece
        from attnkit.models.gguf_sentencepiece import sentencepiece_decoder_tokenizer

        return sentencepiece_decoder_tokenizer(metadata, source)
    if kind != "gpt2":
        raise CheckpointError(
            f"{source}: expected a byte-level BPE tokenizer (tokenizer.ggml.model 'gpt2') or SentencePiece "
            f"(tokenizer.ggml.model 'llama'), got {kind!r}"
        )
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise CheckpointError(f"{source} lacks tokenizer.ggml.tokens (a list of strings), which its tokenizer needs")
    merges_raw = metadata.get("tokenizer.ggml.merges", [])
    if not isinstance(merges_raw, list) or not all(isinstance(m, str) and " " in m for m in merges_raw):
        raise CheckpointError(f"{source}: expected tokenizer.ggml.merges to be a list of 'left right' strings")
    merges = [tuple(merge.split(" ", 1)) for merge in merges_raw]
    token_types = metadata.get("tokenizer.ggml.token_type", [])
    if not isinstance(token_types, list) or (token_types and len(token_types) != len(tokens)):
        raise CheckpointError(
            f"{source}: expected tokenizer.ggml.token_type to list one type per token ({len(tokens)})"
        )
    vocab = {token: index for index, token in enumerate(tokens)}
    pre = read.text("pre", None)
    try:
        bpe = models.BPE(
            vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="", end_of_word_suffix="",
            fuse_unk=False,
        )
    except Exception as error:  # noqa: BLE001 - tokenizers' Rust errors (a merge of unknown tokens, ...)
        raise CheckpointError(f"{source}: the vocabulary and merges do not form a BPE model: {error}") from None
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = _pre_tokenizer(pre, source)
    tokenizer.decoder = decoders.ByteLevel()

    byte_alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    control = [
        AddedToken(token, normalized=False, special=True)
        for token, kind_id in zip(tokens, token_types)
        if kind_id == _TOKEN_TYPE_CONTROL and set(token) <= byte_alphabet
    ]
    user_defined = [
        AddedToken(token, normalized=False, special=False)
        for token, kind_id in zip(tokens, token_types)
        if kind_id == _TOKEN_TYPE_USER_DEFINED
    ]
    if control:
        tokenizer.add_special_tokens(control)
    if user_defined:
        tokenizer.add_tokens(user_defined)

    from attnkit.models.gguf_sentencepiece import gguf_decoder_tokenizer

    return gguf_decoder_tokenizer(tokenizer, tokens, metadata, source, add_bos_default=False)
