"""Log-probabilities (and attnkit's per-token extension) in OpenAI's response shapes.

- chat: `choice.logprobs = {"content": [{"token", "logprob", "bytes", "top_logprobs":
  [{"token", "logprob", "bytes"}, ...]}, ...], "refusal": None}`
  (`openai.types.chat.ChatCompletionTokenLogprob`);
- completions: `choice.logprobs = {"tokens", "token_logprobs", "top_logprobs" (a
  {token: logprob} dict per token), "text_offset"}` (`openai.types.completion_choice.Logprobs`).

One entry per token whose text is in the completion: the end-of-sequence token and the
token that completed a stop string are counted in usage but have no entry (their text is
not in the answer). The values are the engine's: the float64 log-softmax of the model's
float32 logits at that step.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any, Sequence

__all__ = ["attnkit_entries", "chat_entries", "completion_logprobs", "token_bytes"]


@lru_cache(maxsize=1)
def _byte_level_table() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins for bytes (GPT-2's table), character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[chr(byte)] = byte
        else:
            table[chr(256 + extra)] = byte
            extra += 1
    return table


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_bytes(tokenizer: Any, token: int) -> list[int]:
    """The UTF-8 bytes a token stands for (a piece of a character for some tokens): read from
    its vocabulary entry for byte-level BPE (`Ġcat` -> b" cat") and SentencePiece byte tokens
    (`<0xE2>`), else its decoded text's bytes."""
    inner = getattr(tokenizer, "tokenizer", None)
    raw = inner.id_to_token(int(token)) if inner is not None else None
    if raw is not None:
        table = _byte_level_table()
        if type(getattr(inner, "decoder", None)).__name__ == "ByteLevel" and all(c in table for c in raw):
            return [table[c] for c in raw]
        match = _BYTE_TOKEN.fullmatch(raw)
        if match:
            return [int(match.group(1), 16)]
    return list(tokenizer.decode([int(token)]).encode("utf-8"))


def _text(tokenizer: Any, token: int) -> str:
    return tokenizer.decode([int(token)])


def chat_entries(tokenizer: Any, events: Sequence[Any]) -> list[dict[str, Any]]:
    """`logprobs.content` entries of chat for these `TokenEvent`s."""
    return [{"token": _text(tokenizer, e.token), "logprob": e.logprob, "bytes": token_bytes(tokenizer, e.token),
             "top_logprobs": [{"token": _text(tokenizer, t), "logprob": value, "bytes": token_bytes(tokenizer, t)}
                              for t, value in e.top]}
            for e in events]


def completion_logprobs(tokenizer: Any, events: Sequence[Any], offset: int) -> tuple[dict[str, Any], int]:
    """Completions' `logprobs` for these `TokenEvent`s, their text starting at character
    `offset` (OpenAI counts from the prompt's start); returns it and the offset after them."""
    tokens, offsets = [], []
    for event in events:
        text = _text(tokenizer, event.token)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    tops = []
    for event in events:
        top: dict[str, float] = {}
        for token, value in event.top:  # two ids may read the same: the likelier one is kept
            top.setdefault(_text(tokenizer, token), value)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in events], "top_logprobs": tops,
            "text_offset": offsets}, offset


def attnkit_entries(tokenizer: Any, events: Sequence[Any]) -> list[dict[str, Any]]:
    """The `attnkit` extension's per-token entries: {"token", "id", "attention" (layers x heads
    x context), "logit_lens" (layers + 1 x top: {"id", "token", "logit"})}, as asked."""
    out = []
    for event in events:
        entry: dict[str, Any] = {"id": event.token, "token": _text(tokenizer, event.token)}
        extra = event.extra or {}
        if "attention" in extra:
            entry["attention"] = extra["attention"]
        if "logit_lens" in extra:
            entry["logit_lens"] = [[{"id": t, "token": _text(tokenizer, t), "logit": value} for t, value in row]
                                   for row in extra["logit_lens"]]
        out.append(entry)
    return out
