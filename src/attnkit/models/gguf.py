"""Reading GGUF files: metadata, tensors dequantized to float32, and the tokenizer.

GGUF is llama.cpp's single-file format: a header of typed key/value metadata
(the architecture, its hyperparameters, the tokenizer's vocabulary and merges,
the chat template) followed by tensors, often quantized in blocks (Q4_1 stores
32 weights as 4-bit integers with one float16 scale and one float16 minimum).

The `gguf` package (the reference reader, maintained in llama.cpp) parses the
file and dequantizes; this module maps what it returns to attnkit:

    gguf_file = GGUFFile(path)
    config = llama_config_from_gguf(gguf_file)          # every key checked
    tokenizer = tokenizer_from_gguf(gguf_file)
    state = llama_state_from_gguf(gguf_file, config)    # attnkit names, float32

The checkpoint rule of `attnkit.models.checkpoint` holds here too: every
metadata key is read, known to change nothing (names, licenses, fill-in-the-
middle token ids, ...) or refused by name; every tensor's shape is checked
against the metadata before any tensor is dequantized; every tensor is used.
What a Llama GGUF may carry beyond the plain model, and what attnkit does with it:

- `blk.N.attn_{q,k,v,output}.bias`, `blk.N.ffn_{gate,up,down}.bias`: biases
  (a missing one of a set is zero). llama.cpp uses them; transformers' GGUF
  loader drops them.
- `rope_freqs.weight`: llama.cpp's per-frequency divisors of the rotary
  frequencies, which is how its converter stores Llama 3.1's rope scaling
  (no scaling-type key). transformers' GGUF loader ignores it.
- `{arch}.rope.scaling.type` "linear" (or `rope.scale_linear`) with its
  factor; "yarn" and "longrope" are refused.
- `tokenizer.ggml.pre`: how text is split before BPE (`GGUF_PRE_TOKENIZERS`).

One detail matters for correctness: llama.cpp's converter permutes the rows of
the query and key projections (and their biases) so that its rotary embedding
can rotate adjacent pairs (x0, x1), (x2, x3), ... instead of the two halves
(x_i, x_{i+E/2}) that Hugging Face's Llama rotates. `llama_state_from_gguf`
undoes that permutation, as transformers does, so one rotary embedding serves
GGUF and safetensors checkpoints alike.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from attnkit.models.checkpoint import CheckpointError, ConfigReader, TensorInfo, check_tensors

__all__ = [
    "GGUFFile",
    "GGUF_PRE_TOKENIZERS",
    "SUPPORTED_ARCHITECTURES",
    "llama_config_from_gguf",
    "llama_state_from_gguf",
    "supported_tensor_types",
    "tokenizer_from_gguf",
    "unpermute_rotary_rows",
]

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)
SUPPORTED_ARCHITECTURES = ("llama",)

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


@lru_cache(maxsize=1)
def supported_tensor_types() -> tuple[str, ...]:
    """Names of the GGML tensor types this reader turns into float32.

    F32, F16, BF16, F64 and every block quantization that `gguf.quants.dequantize`
    implements (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K-quants, the IQ types, ...).
    """
    from gguf import GGMLQuantizationType
    from gguf.quants import _type_traits  # the dequantizers the package implements

    names = {"F32", "F16", "F64"}
    names.update(t.name for t in GGMLQuantizationType if t in _type_traits)
    return tuple(sorted(names))


def _check_magic(path: Path) -> None:
    if not path.is_file():
        raise ValueError(f"expected a GGUF file, got {str(path)!r}, which is not a file")
    with open(path, "rb") as handle:
        head = handle.read(8)
    if head[:4] != GGUF_MAGIC:
        raise ValueError(
            f"expected a GGUF file starting with the magic bytes b'GGUF', got {head[:4]!r} in {str(path)!r}"
        )
    if len(head) < 8:
        raise ValueError(f"could not read GGUF file {str(path)!r}: it ends inside its header (truncated)")
    version = int.from_bytes(head[4:8], "little")
    if version not in GGUF_VERSIONS and int.from_bytes(head[4:8], "big") not in GGUF_VERSIONS:
        raise ValueError(
            f"could not read GGUF file {str(path)!r}: expected GGUF version 2 or 3, got {version}"
        )


def _reader_class():
    """`gguf.GGUFReader` reading through a plain ndarray view of its memory map.

    The reader slices its `np.memmap` once per metadata item; each slice of a memmap
    subclass runs Python-level bookkeeping, which for a 49152-token vocabulary takes seconds.
    A base-class view of the same mapping reads the same bytes without it.
    """
    from gguf import GGUFReader

    class _Reader(GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            count = int(count)
            dtype = np.dtype(dtype)
            array = plain[offset : offset + dtype.itemsize * count].view(dtype)[:count]
            order = self.byte_order if override_order is None else override_order
            return array.view(array.dtype.newbyteorder(order))

    return _Reader


class GGUFFile:
    """An opened GGUF file: `metadata` (a dict of plain Python values) and its tensors.

    Tensors are memory-mapped; `tensor_infos` gives their shapes and types without reading
    them, and `tensor(name)` dequantizes one.

    Arguments:
        path: the `.gguf` file.

    Raises:
        ValueError: the file does not exist, is not GGUF, or its header is truncated or corrupt;
            the message names the file.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        _check_magic(self.path)
        try:
            self._reader = _reader_class()(self.path)
            self.metadata: dict[str, Any] = {
                key: field.contents() for key, field in self._reader.fields.items() if not key.startswith("GGUF.")
            }
            self._tensors = {tensor.name: tensor for tensor in self._reader.tensors}
            self.tensor_infos: dict[str, TensorInfo] = {
                tensor.name: TensorInfo(
                    tuple(int(n) for n in reversed(tensor.shape.tolist())),  # GGML lists dims fastest-first
                    tensor.tensor_type.name,
                    self.path,
                )
                for tensor in self._reader.tensors
            }
        except Exception:  # noqa: BLE001 - a third-party parser on untrusted bytes; none may escape
            # The reader's own errors are NumPy's ("index 0 is out of bounds for axis 0 ..."),
            # which say nothing about the file, so the message is ours.
            raise ValueError(
                f"could not read GGUF file {str(self.path)!r}: its header or tensor table is truncated or corrupt"
            ) from None

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def tensor_type(self, name: str) -> str:
        """The GGML type name of tensor `name` (`"Q4_1"`, `"F32"`, ...)."""
        return self._info(name).dtype

    def _info(self, name: str) -> TensorInfo:
        if name not in self.tensor_infos:
            raise ValueError(f"GGUF file {str(self.path)!r} has no tensor {name!r}")
        return self.tensor_infos[name]

    def tensor(self, name: str) -> np.ndarray:
        """Tensor `name` as float32 in NumPy (row-major) order, e.g. (out_features, in_features).

        Raises:
            ValueError: no tensor of that name, a type with no dequantizer, or data that does
                not fit its shape; naming the file and the tensor.
        """
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        info = self._info(name)
        tensor = self._tensors[name]
        kind = tensor.tensor_type
        if info.dtype not in supported_tensor_types():
            raise ValueError(
                f"tensor {name!r} in {str(self.path)!r} has GGML type {kind.name}, which attnkit cannot "
                f"dequantize; expected one of {', '.join(supported_tensor_types())}"
            )
        try:
            if kind == GGMLQuantizationType.F64:
                values = np.asarray(tensor.data).view(np.float64).astype(np.float32)
            else:
                values = dequantize(tensor.data, kind)
            return np.ascontiguousarray(values, dtype=np.float32).reshape(info.shape)
        except (ValueError, IndexError, TypeError, NotImplementedError):
            raise ValueError(
                f"could not read tensor {name!r} ({kind.name}, shape {info.shape}) from {str(self.path)!r}: "
                "its data is truncated or does not match its type and shape"
            ) from None


# ----------------------------------------------------------------------------- metadata


def _require_architecture(gguf_file: GGUFFile) -> str:
    architecture = gguf_file.architecture
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"expected a GGUF model of architecture {' or '.join(map(repr, SUPPORTED_ARCHITECTURES))}, "
            f"got {architecture!r} in {str(gguf_file.path)!r}"
        )
    general_type = gguf_file.metadata.get("general.type", "model")
    if general_type != "model":
        raise CheckpointError(
            f"{gguf_file.path}: general.type is {general_type!r}; expected 'model' (adapters and other "
            "partial files cannot run on their own)"
        )
    return architecture


# `{arch}.` keys of a Llama that attnkit reads ...
_LLAMA_KEYS = {
    "block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
    "attention.head_count_kv", "attention.key_length", "attention.value_length",
    "attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.dimension_count", "vocab_size",
    "rope.scaling.type", "rope.scaling.factor", "rope.scale_linear",
}
# ... that change nothing for the models attnkit runs ...
_LLAMA_HARMLESS = {
    "rope.scaling.original_context_length",  # read by yarn only, which is refused
    "rope.scaling.finetuned",
}
# ... and that are harmless at these values only.
_LLAMA_NEUTRAL = {
    "expert_count": (0,),
    "expert_used_count": (0,),
    "attention.causal": (True,),
    "rope.scaling.attn_factor": (1.0,),
}
# `tokenizer.` keys read, and those that change nothing for a byte-level BPE tokenizer.
_TOKENIZER_KEYS = {
    "ggml.model", "ggml.pre", "ggml.tokens", "ggml.token_type", "ggml.merges", "ggml.bos_token_id",
    "ggml.eos_token_id", "ggml.eot_token_id", "ggml.eom_token_id", "ggml.padding_token_id",
    "ggml.add_bos_token", "ggml.add_eos_token", "chat_template",
}
_TOKENIZER_HARMLESS = {
    "ggml.scores",  # sentencepiece merge scores; byte-level BPE ranks merges by their order
    "ggml.token_type_count", "ggml.unknown_token_id", "ggml.seperator_token_id", "ggml.separator_token_id",
    "ggml.cls_token_id", "ggml.mask_token_id",
    "ggml.prefix_token_id", "ggml.suffix_token_id", "ggml.middle_token_id",  # fill-in-the-middle ids
    "ggml.fim_pre_token_id", "ggml.fim_suf_token_id", "ggml.fim_mid_token_id", "ggml.fim_pad_token_id",
    "ggml.fim_rep_token_id", "ggml.fim_sep_token_id",
    # sentencepiece-only settings; llama.cpp and transformers ignore them for byte-level BPE
    "ggml.add_space_prefix", "ggml.remove_extra_whitespaces", "ggml.precompiled_charsmap",
    "huggingface.json",  # a copy of tokenizer.json; llama.cpp and transformers build from ggml.* keys
    "chat_templates",  # the names of extra chat templates (`tokenizer.chat_template.NAME`), unused
}
_TOKENIZER_NEUTRAL = {"ggml.add_sep_token": (False,)}


def check_gguf_keys(gguf_file: GGUFFile, arch: str) -> None:
    """Refuse, by name, every metadata key a Llama GGUF may not carry unread.

    `general.*` (names, license, quantization) and `quantize.*` (importance-matrix notes) never
    change the math; `split.count` above 1 means this file holds only part of the tensors.
    """
    source = gguf_file.path
    metadata = gguf_file.metadata
    split = metadata.get("split.count", 1)
    if split != 1:
        raise CheckpointError(
            f"{source} is one of {split} parts of a split GGUF (split.count); merge them first "
            "(llama-gguf-split --merge)"
        )
    ConfigReader(metadata, source, prefix=f"{arch}.").check_keys(
        _LLAMA_KEYS, neutral=_LLAMA_NEUTRAL, harmless=_LLAMA_HARMLESS, common=False, what="attnkit's Llama"
    )
    named_templates = {key.removeprefix("tokenizer.") for key in metadata if key.startswith("tokenizer.chat_template.")}
    ConfigReader(metadata, source, prefix="tokenizer.").check_keys(
        _TOKENIZER_KEYS, neutral=_TOKENIZER_NEUTRAL, harmless=_TOKENIZER_HARMLESS | named_templates, common=False,
        what="attnkit's GGUF tokenizer",
    )
    known = ("general.", "quantize.", "split.", "tokenizer.", f"{arch}.")
    other = [key for key in metadata if not key.startswith(known)]
    if other:
        raise CheckpointError(
            f"{source}: attnkit's Llama does not know the metadata key(s) {', '.join(map(repr, sorted(other)))}; "
            "they may change what the model computes, so the file is refused"
        )


def llama_config_from_gguf(gguf_file: GGUFFile):
    """A `LlamaConfig` from llama.cpp's metadata keys (`llama.block_count`, ...) and the
    tensors the file has (a separate head, biases, `rope_freqs.weight`).

    Raises:
        ValueError: naming the file: not a Llama model, a missing or invalid key, a key or
            feature attnkit does not implement (yarn, a partial rotary dimension, ...).
    """
    from attnkit.models.llama import LlamaConfig
    from attnkit.nn.positional import RopeScaling

    arch = _require_architecture(gguf_file)
    check_gguf_keys(gguf_file, arch)
    source = gguf_file.path
    read = ConfigReader(gguf_file.metadata, source, prefix=f"{arch}.")
    hidden_size = read.integer("embedding_length")
    num_heads = read.integer("attention.head_count")
    num_kv_heads = read.integer("attention.head_count_kv", num_heads)
    if num_heads % num_kv_heads:
        raise CheckpointError(
            f"{source}: expected {arch}.attention.head_count ({num_heads}) to be a multiple of "
            f"{arch}.attention.head_count_kv ({num_kv_heads})"
        )
    if read.has("attention.key_length"):
        head_dim = read.integer("attention.key_length")
    elif hidden_size % num_heads:
        raise CheckpointError(
            f"{source}: expected {arch}.embedding_length ({hidden_size}) to be a multiple of "
            f"{arch}.attention.head_count ({num_heads}), or an attention.key_length key"
        )
    else:
        head_dim = hidden_size // num_heads
    value_dim = read.integer("attention.value_length", head_dim)
    if value_dim != head_dim:
        raise CheckpointError(
            f"{source}: expected {arch}.attention.value_length equal to the key length {head_dim}, got {value_dim}"
        )
    if head_dim % 2:
        raise CheckpointError(f"{source}: expected an even head dimension for rotary embeddings, got {head_dim}")
    rotary_dim = read.integer("rope.dimension_count", head_dim)
    if rotary_dim != head_dim:
        raise CheckpointError(
            f"{source}: expected {arch}.rope.dimension_count equal to the head dimension {head_dim}, got "
            f"{rotary_dim} (partial rotary embeddings are not supported)"
        )
    tokens = gguf_file.metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise CheckpointError(f"{source} lacks tokenizer.ggml.tokens (the vocabulary), which a Llama GGUF needs")
    vocab_size = read.integer("vocab_size", len(tokens))
    if vocab_size != len(tokens):
        raise CheckpointError(
            f"{source}: {arch}.vocab_size is {vocab_size} but tokenizer.ggml.tokens has {len(tokens)} tokens"
        )
    infos = gguf_file.tensor_infos
    layers = read.integer("block_count")
    bias_names = [f"blk.{i}.{part}.bias" for i in range(layers) for part in _ATTENTION_PARTS]
    mlp_bias_names = [f"blk.{i}.{part}.bias" for i in range(layers) for part in _MLP_PARTS]
    special = ConfigReader(gguf_file.metadata, source, prefix="tokenizer.ggml.")
    # llama.cpp ends generation at any of EOS, end-of-turn and end-of-message; so does attnkit
    stop_ids = [i for key in ("eos_token_id", "eot_token_id", "eom_token_id") for i in special.token_ids(key)]
    bos = special.token_ids("bos_token_id")
    outside = [i for i in [*stop_ids, *bos] if i >= vocab_size]
    if outside:
        raise CheckpointError(
            f"{source}: bos/eos/eot/eom token id(s) {outside} are outside the vocabulary of {vocab_size} tokens"
        )
    try:
        return LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=read.integer("feed_forward_length"),
            num_layers=layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rope_theta=read.number("rope.freq_base", 10000.0, positive=True),
            rope_scaling=_gguf_rope_scaling(gguf_file, read, arch, head_dim, RopeScaling),
            rms_norm_eps=read.number("attention.layer_norm_rms_epsilon", 1e-5, positive=True),
            max_position_embeddings=read.integer("context_length", 2048),
            tie_word_embeddings="output.weight" not in infos,
            attention_bias=any(name in infos for name in bias_names),
            mlp_bias=any(name in infos for name in mlp_bias_names),
            bos_token_id=bos[0] if bos else None,
            eos_token_id=tuple(dict.fromkeys(stop_ids)),
        )
    except ValueError as error:
        if isinstance(error, CheckpointError):
            raise
        raise CheckpointError(f"{source}: {error}") from None


def _gguf_rope_scaling(gguf_file: GGUFFile, read: ConfigReader, arch: str, head_dim: int, RopeScaling):
    """RoPE scaling from `rope_freqs.weight` (divisors) or `rope.scaling.type` "linear"."""
    source = gguf_file.path
    kind = read.text("rope.scaling.type", "none")
    factor = read.number("rope.scaling.factor", None, positive=True)
    if factor is None:
        factor = read.number("rope.scale_linear", None, positive=True)
    if kind not in ("none", "linear"):
        raise CheckpointError(
            f"{source}: {arch}.rope.scaling.type {kind!r} is not supported; expected 'none' or 'linear' "
            "(yarn and longrope GGUF files are refused rather than run with the wrong positions)"
        )
    has_freqs = "rope_freqs.weight" in gguf_file.tensor_infos
    linear = factor is not None and factor != 1.0
    if linear and kind == "none":
        raise CheckpointError(
            f"{source}: {arch}.rope.scaling.type is 'none' but rope.scaling.factor is {factor}; expected "
            "one of them to say how positions are scaled"
        )
    if linear and has_freqs:
        raise CheckpointError(
            f"{source}: both rope_freqs.weight and a linear rope scaling factor ({factor}); attnkit "
            "implements one at a time"
        )
    if has_freqs:
        info = gguf_file.tensor_infos["rope_freqs.weight"]
        if info.shape != (head_dim // 2,):
            raise CheckpointError(
                f"{source}: tensor 'rope_freqs.weight' has shape {info.shape}, expected ({head_dim // 2},) "
                "(one divisor per rotary frequency, head_dim / 2)"
            )
        divisors = gguf_file.tensor("rope_freqs.weight")
        if not (np.all(np.isfinite(divisors)) and np.all(divisors > 0)):
            raise CheckpointError(f"{source}: expected rope_freqs.weight to hold finite divisors > 0")
        return RopeScaling(rope_type="divisors", divisors=tuple(float(x) for x in divisors))
    if linear:
        return RopeScaling(rope_type="linear", factor=factor)
    return None


# ----------------------------------------------------------------------------- tensors


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of a query or key projection (or its bias).

    llama.cpp's converter reorders each head's rows from halves
    (r_0..r_{E/2-1}, r_{E/2}..r_{E-1}) to interleaved pairs (r_0, r_{E/2}, r_1, ...).
    This restores the halves order Hugging Face's `rotate_half` expects.

    Arguments:
        weight: (num_heads * head_dim, in_features) or (num_heads * head_dim,) as stored.
        num_heads: heads of this projection (query heads for Q, key/value heads for K).
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    # stored row h*E + 2*i + j  came from  original row h*E + j*E/2 + i
    per_head = weight.reshape(num_heads, half, 2, *weight.shape[1:])  # (H, E/2, 2, ...)
    return np.ascontiguousarray(per_head.swapaxes(1, 2).reshape(weight.shape))


# GGUF tensor names -> attnkit Llama names ({i} = layer index).
_LLAMA_NAMES = {
    "token_embd.weight": "embed.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "layers.{i}.attn_norm.weight",
    "blk.{i}.attn_q.weight": "layers.{i}.attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "layers.{i}.attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "layers.{i}.attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "layers.{i}.attn.out_proj.weight",
    "blk.{i}.ffn_norm.weight": "layers.{i}.mlp_norm.weight",
    "blk.{i}.ffn_gate.weight": "layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "layers.{i}.mlp.down_proj.weight",
    "blk.{i}.attn_q.bias": "layers.{i}.attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "layers.{i}.attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "layers.{i}.attn.v_proj.bias",
    "blk.{i}.attn_output.bias": "layers.{i}.attn.out_proj.bias",
    "blk.{i}.ffn_gate.bias": "layers.{i}.mlp.gate_proj.bias",
    "blk.{i}.ffn_up.bias": "layers.{i}.mlp.up_proj.bias",
    "blk.{i}.ffn_down.bias": "layers.{i}.mlp.down_proj.bias",
}
_ATTENTION_PARTS = ("attn_q", "attn_k", "attn_v", "attn_output")
_MLP_PARTS = ("ffn_gate", "ffn_up", "ffn_down")


def gguf_tensor_shapes(config) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """(expected, optional): GGUF tensor name -> shape (NumPy order) for a `LlamaConfig`.

    Optional: biases (a missing one of a present set is zero), `rope_freqs.weight` (read into
    the config already).
    """
    c = config
    d, q, kv, ff = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    expected: dict[str, tuple[int, ...]] = {"token_embd.weight": (c.vocab_size, d), "output_norm.weight": (d,)}
    if not c.tie_word_embeddings:
        expected["output.weight"] = (c.vocab_size, d)
    optional: dict[str, tuple[int, ...]] = {"rope_freqs.weight": (c.head_dim // 2,)}
    for i in range(c.num_layers):
        p = f"blk.{i}."
        expected.update({
            p + "attn_norm.weight": (d,), p + "attn_q.weight": (q, d), p + "attn_k.weight": (kv, d),
            p + "attn_v.weight": (kv, d), p + "attn_output.weight": (d, q), p + "ffn_norm.weight": (d,),
            p + "ffn_gate.weight": (ff, d), p + "ffn_up.weight": (ff, d), p + "ffn_down.weight": (d, ff),
        })
        optional.update({
            p + "attn_q.bias": (q,), p + "attn_k.bias": (kv,), p + "attn_v.bias": (kv,), p + "attn_output.bias": (d,),
            p + "ffn_gate.bias": (ff,), p + "ffn_up.bias": (ff,), p + "ffn_down.bias": (d,),
        })
    return expected, optional


def llama_state_from_gguf(gguf_file: GGUFFile, config) -> dict[str, np.ndarray]:
    """All weights of a Llama GGUF as float32 arrays under attnkit's names.

    Every tensor's name and shape is checked against `config` first (nothing is dequantized
    before); query and key rows, and their biases, are un-permuted (`unpermute_rotary_rows`);
    a bias missing from a set the file has is zero.

    Raises:
        CheckpointError (a ValueError): naming the file and every missing, unused or mis-shaped tensor.
    """
    _require_architecture(gguf_file)
    c = config
    expected, optional = gguf_tensor_shapes(c)
    check_tensors(
        gguf_file.tensor_infos, expected, optional=optional, dtypes=None, source=gguf_file.path,
        config=(
            f"embedding_length={c.hidden_size}, feed_forward_length={c.intermediate_size}, head_count={c.num_heads}, "
            f"head_count_kv={c.num_kv_heads}, head dimension {c.head_dim}, vocabulary {c.vocab_size}"
        ),
    )
    for name, info in gguf_file.tensor_infos.items():
        if info.dtype not in supported_tensor_types():
            raise ValueError(
                f"tensor {name!r} in {str(gguf_file.path)!r} has GGML type {info.dtype}, which attnkit cannot "
                f"dequantize; expected one of {', '.join(supported_tensor_types())}"
            )
    wanted = {**optional, **expected}
    state: dict[str, np.ndarray] = {}
    for layer in [None, *range(c.num_layers)]:
        for gguf_pattern, ours_pattern in _LLAMA_NAMES.items():
            if ("{i}" in gguf_pattern) != (layer is not None):
                continue
            gguf_name = gguf_pattern.format(i=layer)
            ours = ours_pattern.format(i=layer)
            is_bias = gguf_name.endswith(".bias")
            if is_bias and not (c.attention_bias if gguf_name.split(".")[2] in _ATTENTION_PARTS else c.mlp_bias):
                continue
            if gguf_name not in gguf_file.tensor_infos:
                if is_bias:
                    state[ours] = np.zeros(wanted[gguf_name], np.float32)
                continue  # output.weight of a tied model
            weight = gguf_file.tensor(gguf_name)
            if ".attn_q." in gguf_name:
                weight = unpermute_rotary_rows(weight, c.num_heads)
            elif ".attn_k." in gguf_name:
                weight = unpermute_rotary_rows(weight, c.num_kv_heads)
            state[ours] = weight
    return state


# ----------------------------------------------------------------------------- tokenizer

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


def tokenizer_from_gguf(gguf: GGUFFile | Mapping[str, Any], *, source: str | os.PathLike[str] = "GGUF metadata"):
    """The tokenizer a GGUF file describes, rebuilt with Hugging Face `tokenizers`.

    Supports byte-level BPE (`tokenizer.ggml.model == "gpt2"`), which GPT-2, SmolLM, Llama 3
    and Qwen use: the vocabulary and merges come from the file; the pre-tokenizer from
    `tokenizer.ggml.pre` (`GGUF_PRE_TOKENIZERS`; none given: GPT-2's, as transformers does);
    tokens the file marks as control (`<|im_start|>`, ...) become special tokens that are
    never split. BOS (and EOS) are added when `tokenizer.ggml.add_bos_token`
    (`add_eos_token`) says so, as transformers does.

    Arguments:
        gguf: a `GGUFFile`, or its metadata.
        source: the file, for messages, when `gguf` is metadata.

    Returns:
        `attnkit.models.chat.DecoderTokenizer`, which also carries the chat template and the
        BOS/EOS ids.

    Raises:
        ValueError: naming the file: another tokenizer model (sentencepiece `llama`, `t5`, ...),
            an unknown pre-tokenizer, a missing or malformed vocabulary.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from attnkit.models.chat import DecoderTokenizer

    if isinstance(gguf, GGUFFile):
        metadata, source = gguf.metadata, gguf.path
    else:
        metadata = gguf
    read = ConfigReader(metadata, source, prefix="tokenizer.ggml.")
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise CheckpointError(
            f"{source}: expected a byte-level BPE tokenizer (tokenizer.ggml.model 'gpt2'), got {kind!r}"
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

    def token_of(key: str) -> str | None:
        ids = read.token_ids(key)
        if not ids:
            return None
        if ids[0] >= len(tokens):
            raise CheckpointError(
                f"{source}: tokenizer.ggml.{key} is {ids[0]}, outside the vocabulary of {len(tokens)} tokens"
            )
        return tokens[ids[0]]

    template = metadata.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise CheckpointError(f"{source}: expected tokenizer.chat_template to be a string")
    return DecoderTokenizer(
        tokenizer,
        bos_token=token_of("bos_token_id"),
        eos_token=token_of("eos_token_id"),
        pad_token=token_of("padding_token_id"),
        add_bos_token=read.flag("add_bos_token", False),
        add_eos_token=read.flag("add_eos_token", False),
        chat_template=template,
    )
