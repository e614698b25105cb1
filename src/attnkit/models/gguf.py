"""Reading GGUF files: metadata, tensors dequantized to float32, and the tokenizer.

GGUF is llama.cpp's single-file format: a header of typed key/value metadata
(the architecture, its hyperparameters, the tokenizer's vocabulary and merges,
the chat template) followed by tensors, often quantized in blocks (Q4_1 stores
32 weights as 4-bit integers with one float16 scale and one float16 minimum).

The `gguf` package (the reference reader, maintained in llama.cpp) parses the
file and dequantizes; this module maps what it returns to attnkit:

    gguf_file = GGUFFile(path)
    config = llama_config_from_gguf(gguf_file.metadata)
    state = llama_state_from_gguf(gguf_file, config)   # attnkit names, float32
    tokenizer = tokenizer_from_gguf(gguf_file.metadata)

One detail matters for correctness: llama.cpp's converter permutes the rows of
the query and key projections so that its rotary embedding can rotate adjacent
pairs (x0, x1), (x2, x3), ... instead of the two halves (x_i, x_{i+E/2}) that
Hugging Face's Llama rotates. `llama_state_from_gguf` undoes that permutation,
as transformers does, so one rotary embedding serves GGUF and safetensors
checkpoints alike.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "GGUFFile",
    "SUPPORTED_ARCHITECTURES",
    "llama_config_from_gguf",
    "llama_state_from_gguf",
    "supported_tensor_types",
    "tokenizer_from_gguf",
    "unpermute_rotary_rows",
]

GGUF_MAGIC = b"GGUF"
SUPPORTED_ARCHITECTURES = ("llama",)

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


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
        magic = handle.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(
            f"expected a GGUF file starting with the magic bytes b'GGUF', got {magic!r} in {str(path)!r}"
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

    Tensors are memory-mapped and dequantized one at a time by `tensor(name)`.

    Arguments:
        path: the `.gguf` file.

    Raises:
        ValueError: the file does not exist or is not GGUF.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        _check_magic(self.path)
        try:
            self._reader = _reader_class()(self.path)
        except (ValueError, IndexError, OSError) as error:  # truncated or corrupt header
            raise ValueError(f"could not read GGUF file {str(self.path)!r}: {error}") from error
        self.metadata: dict[str, Any] = {}
        for key, field in self._reader.fields.items():
            if key.startswith("GGUF."):
                continue
            self.metadata[key] = field.contents()
        self._tensors = {tensor.name: tensor for tensor in self._reader.tensors}

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def tensor_type(self, name: str) -> str:
        """The GGML type name of tensor `name` (`"Q4_1"`, `"F32"`, ...)."""
        return self._tensors[name].tensor_type.name

    def tensor(self, name: str) -> np.ndarray:
        """Tensor `name` as float32 in NumPy (row-major) order, e.g. (out_features, in_features).

        Raises:
            KeyError: no tensor of that name.
            ValueError: its type has no dequantizer.
        """
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        if name not in self._tensors:
            raise KeyError(f"no tensor {name!r} in {str(self.path)!r}")
        tensor = self._tensors[name]
        kind = tensor.tensor_type
        # GGML lists dimensions fastest-first; NumPy wants them slowest-first.
        shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        if kind == GGMLQuantizationType.F64:
            values = np.asarray(tensor.data).view(np.float64).astype(np.float32)
        else:
            try:
                values = dequantize(tensor.data, kind)
            except NotImplementedError:
                raise ValueError(
                    f"tensor {name!r} has GGML type {kind.name}, which attnkit cannot dequantize; "
                    f"expected one of {', '.join(supported_tensor_types())}"
                ) from None
        return np.ascontiguousarray(values, dtype=np.float32).reshape(shape)


def _require_architecture(metadata: dict[str, Any]) -> str:
    architecture = str(metadata.get("general.architecture", ""))
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"expected a GGUF model of architecture {' or '.join(map(repr, SUPPORTED_ARCHITECTURES))}, "
            f"got {architecture!r}"
        )
    return architecture


def llama_config_from_gguf(metadata: dict[str, Any], *, tied: bool = True):
    """A `LlamaConfig` from llama.cpp's metadata keys (`llama.block_count`, ...).

    Arguments:
        metadata: `GGUFFile.metadata`.
        tied: whether the file has no separate `output.weight` (the head reuses the embedding).

    Raises:
        ValueError: not a Llama model, or a feature attnkit does not implement (RoPE scaling,
            a rotary dimension different from the head dimension).
    """
    from attnkit.models.llama import LlamaConfig

    arch = _require_architecture(metadata)

    def get(key: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{key!s}, which a {arch} model needs")
        return value

    hidden_size = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    num_kv_heads = int(get("attention.head_count_kv", num_heads))
    head_dim = int(get("attention.key_length", hidden_size // num_heads))
    rotary_dim = int(get("rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        raise ValueError(f"expected rope.dimension_count equal to the head dimension {head_dim}, got {rotary_dim}")
    scaling = metadata.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ValueError(f"RoPE scaling {scaling!r} is not supported; expected none")
    vocab_size = metadata.get(f"{arch}.vocab_size")
    if vocab_size is None:
        vocab_size = len(metadata.get("tokenizer.ggml.tokens", ()))
    return LlamaConfig(
        vocab_size=int(vocab_size),
        hidden_size=hidden_size,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings=tied,
        bos_token_id=_optional_int(metadata.get("tokenizer.ggml.bos_token_id")),
        eos_token_id=_optional_int(metadata.get("tokenizer.ggml.eos_token_id")),
    )


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of a query or key projection.

    llama.cpp's converter reorders each head's rows from halves
    (r_0..r_{E/2-1}, r_{E/2}..r_{E-1}) to interleaved pairs (r_0, r_{E/2}, r_1, ...).
    This restores the halves order Hugging Face's `rotate_half` expects.

    Arguments:
        weight: (num_heads * head_dim, in_features) as stored in the GGUF.
        num_heads: heads of this projection (query heads for Q, key/value heads for K).
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    # stored row h*E + 2*i + j  came from  original row h*E + j*E/2 + i
    per_head = weight.reshape(num_heads, half, 2, *weight.shape[1:])  # (H, E/2, 2, in)
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
}


def llama_state_from_gguf(gguf_file: GGUFFile, config) -> dict[str, np.ndarray]:
    """All weights of a Llama GGUF as float32 arrays under attnkit's names.

    Query and key rows are un-permuted (see `unpermute_rotary_rows`). Tensors the model
    does not use (e.g. `rope_freqs.weight`) are ignored.
    """
    _require_architecture(gguf_file.metadata)
    present = set(gguf_file.tensor_names)
    state: dict[str, np.ndarray] = {}
    for layer in [None, *range(config.num_layers)]:
        for gguf_pattern, ours_pattern in _LLAMA_NAMES.items():
            if ("{i}" in gguf_pattern) != (layer is not None):
                continue
            gguf_name = gguf_pattern.format(i=layer)
            if gguf_name not in present:
                if gguf_name == "output.weight":
                    continue  # tied head
                raise ValueError(f"GGUF file {str(gguf_file.path)!r} lacks tensor {gguf_name!r}")
            weight = gguf_file.tensor(gguf_name)
            if gguf_name.endswith("attn_q.weight"):
                weight = unpermute_rotary_rows(weight, config.num_heads)
            elif gguf_name.endswith("attn_k.weight"):
                weight = unpermute_rotary_rows(weight, config.num_kv_heads)
            state[ours_pattern.format(i=layer)] = weight
    return state


def tokenizer_from_gguf(metadata: dict[str, Any]):
    """The tokenizer a GGUF file describes, rebuilt with Hugging Face `tokenizers`.

    Supports byte-level BPE (`tokenizer.ggml.model == "gpt2"`), which GPT-2, SmolLM, Llama 3
    and Qwen use: the vocabulary and merges come from the file; the pre-tokenizer is the
    GPT-2 byte-level split (what transformers builds for this file); tokens the file marks
    as control (`<|im_start|>`, ...) become special tokens that are never split.

    Returns:
        `attnkit.models.chat.DecoderTokenizer`, which also carries the chat template and the
        BOS/EOS ids.

    Raises:
        ValueError: another tokenizer model (sentencepiece `llama`, `t5`, ...).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from attnkit.models.chat import DecoderTokenizer

    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"expected a byte-level BPE tokenizer (tokenizer.ggml.model 'gpt2'), got {kind!r}")
    tokens = list(metadata["tokenizer.ggml.tokens"])
    merges = [tuple(merge.split(" ", 1)) for merge in metadata.get("tokenizer.ggml.merges", ())]
    vocab = {token: index for index, token in enumerate(tokens)}
    bpe = models.BPE(
        vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False
    )
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=bool(metadata.get("tokenizer.ggml.add_space_prefix", False)))
    tokenizer.decoder = decoders.ByteLevel()

    token_types = list(metadata.get("tokenizer.ggml.token_type", ()))
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
        index = metadata.get(f"tokenizer.ggml.{key}")
        return tokens[int(index)] if index is not None and 0 <= int(index) < len(tokens) else None

    return DecoderTokenizer(
        tokenizer,
        bos_token=token_of("bos_token_id"),
        eos_token=token_of("eos_token_id"),
        pad_token=token_of("padding_token_id"),
        add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        chat_template=metadata.get("tokenizer.chat_template"),
    )
