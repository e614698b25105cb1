"""The BERT config: the numbers that define an encoder, read from config.json.

`BertConfig.from_dict` implements or refuses every math-changing key by name
and lists the keys that change nothing at inference; see attnkit.models.bert
for the model it configures.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from attnkit.models.checkpoint import CheckpointError, ConfigReader

# config.json keys a BERT config must have: they define the shapes and the heads.
_REQUIRED_KEYS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "intermediate_size", "max_position_embeddings",
)
# Math-changing keys attnkit implements at one value only: (key, allowed values with
# Hugging Face's default first, why the others are refused).
_REFUSED_KEYS = (
    ("position_embedding_type", ("absolute",), "relative position embeddings are not implemented"),
    ("hidden_act", ("gelu",), "attnkit's BERT implements exact (erf) GELU only"),
    ("is_decoder", (False,), "a decoder BERT attends causally"),
    ("add_cross_attention", (False,), "cross-attention layers are not implemented"),
    ("quantization_config", (None,), "quantized weights are not implemented"),
)

# Metadata of BERT configs beyond `checkpoint.is_metadata_key` (the list and rule every
# family shares): keys that change nothing an encoder computes at inference, the pooler
# and pre-training heads (ignored, see BERT_IGNORED). Every other key is in the computed
# table: the dataclass fields (read) and `_REFUSED_KEYS` (implemented at one value).
_HARMLESS_BERT_KEYS = frozenset(
    {
        "hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout",
        "gradient_checkpointing", "tie_word_embeddings", "output_past", "use_return_dict",
        "bos_token_id", "eos_token_id", "unk_token_id", "mask_token_id", "cls_token_id",
        "directionality", "pooler_fc_size", "pooler_num_attention_heads", "pooler_num_fc_layers",
        "pooler_size_per_head", "pooler_type", "_attn_implementation",
    }
)


@dataclass(frozen=True)
class BertConfig:
    """The numbers that define a BERT encoder (Hugging Face config.json names)."""

    vocab_size: int = 30522  # word-piece vocabulary
    hidden_size: int = 384  # D, the model width
    num_hidden_layers: int = 6
    num_attention_heads: int = 12  # H; head dim E = D / H
    intermediate_size: int = 1536  # feed-forward hidden size
    max_position_embeddings: int = 512  # longest input the position table covers
    type_vocab_size: int = 2  # token types (segment A / B)
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0

    @classmethod
    def from_dict(cls, config: dict, source: str | Path = "config.json") -> BertConfig:
        """Build from a config.json dict; rejects what this encoder does not implement.

        The sizes and the head count are required (a missing one is refused, not
        guessed); `type_vocab_size`, `layer_norm_eps` and `pad_token_id` default to
        Hugging Face's values. Keys that change the math are implemented or
        refused by name (`_REFUSED_KEYS`); the others (dropout, initializer
        range, `id2label`, ...) change nothing at inference.

        Raises:
            CheckpointError: not a BERT model, a missing or malformed key, zero or
                non-dividing heads, or a math-changing setting attnkit does not implement.
        """
        if not isinstance(config, dict):
            raise CheckpointError(f"expected a JSON object in {source}, got {type(config).__name__}")
        model_type = config.get("model_type")
        if model_type != "bert":
            architectures = config.get("architectures") or []
            raise CheckpointError(
                f"unsupported architecture in {source}: expected model_type 'bert' (a BERT-family "
                f"encoder such as BertModel), got model_type={model_type!r}, "
                f"architectures={architectures!r}"
            )
        for key, allowed, why in _REFUSED_KEYS:
            value = config.get(key, allowed[0])
            if value not in allowed:
                raise CheckpointError(
                    f"unsupported {key} {value!r} in {source}; expected {allowed[0]!r}: {why}"
                )
        values = {}
        for field in fields(cls):
            value = config.get(field.name)
            if value is None:
                continue
            if field.name == "layer_norm_eps":
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1
                expected = "a number in [0, 1)"
            elif field.name in ("num_hidden_layers", "pad_token_id"):
                ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
                expected = "an int >= 0"
            else:
                ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
                expected = "a positive int"
            if not ok:
                raise CheckpointError(f"unexpected {field.name}={value!r} in {source}; expected {expected}")
            values[field.name] = value
        ConfigReader(config, source).check_keys(
            [field.name for field in fields(cls)] + [key for key, _, _ in _REFUSED_KEYS],
            harmless=_HARMLESS_BERT_KEYS,
            what="attnkit's BERT",
        )
        missing = [key for key in _REQUIRED_KEYS if config.get(key) is None]
        if missing:
            raise CheckpointError(
                f"missing key(s) {missing} in {source}: a BERT config needs {list(_REQUIRED_KEYS)}"
            )
        self = cls(**values)
        if self.hidden_size % self.num_attention_heads:
            raise CheckpointError(
                f"hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads} in {source}: expected a head "
                "count that divides the width"
            )
        return self

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads



__all__ = ["BertConfig"]
