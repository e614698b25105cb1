"""GPT-2 on attnkit's attention.

    x   = wte[ids] + wpe[positions]                          learned positions
    h   = x + out_proj(causal_attention(ln_1(x)))            pre-LN blocks
    out = h + fc2(gelu_tanh(fc1(ln_2(h))))
    logits = ln_f(out) @ wte^T                               tied head (or lm_head)

Hugging Face stores GPT-2's projections as `Conv1D` layers, whose weight is
(in_features, out_features), the transpose of a Linear's, and fuses query, key
and value into one `c_attn` of shape (d, 3d). The loader splits and transposes
them at the boundary; inside attnkit every weight has torch's Linear layout.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from attnkit.models.causal_lm import CausalLM
from attnkit.nn.cache import KVCache
from attnkit.nn.decoder_layers import CausalSelfAttention, Embedding
from attnkit.nn.interface import check_backend
from attnkit.nn.layers import FeedForward, LayerNorm
from attnkit.nn.linear import Linear
from attnkit.nn.module import Module, ModuleList, make_rng

__all__ = ["GPT2Config", "GPT2Block", "GPT2LMHeadModel"]


@dataclass(frozen=True)
class GPT2Config:
    """Hyperparameters of GPT-2 (defaults: the 124M model)."""

    vocab_size: int = 50257
    hidden_size: int = 768  # n_embd
    num_layers: int = 12  # n_layer
    num_heads: int = 12  # n_head
    intermediate_size: int = 3072  # n_inner, default 4 * n_embd
    max_position_embeddings: int = 1024  # n_positions
    layer_norm_eps: float = 1e-5  # layer_norm_epsilon
    activation: str = "gelu_tanh"  # activation_function: gelu_new / gelu_pytorch_tanh, gelu, relu
    scale_attn_weights: bool = True  # divide scores by sqrt(E)
    scale_attn_by_inverse_layer_idx: bool = False  # and by layer + 1
    tie_word_embeddings: bool = True  # head = wte; False: its own lm_head.weight
    bos_token_id: int | None = 50256
    eos_token_id: tuple[int, ...] = (50256,)  # any of them ends a sequence (an int is taken as one id)

    def __post_init__(self) -> None:
        if isinstance(self.eos_token_id, (int, np.integer)):
            object.__setattr__(self, "eos_token_id", (int(self.eos_token_id),))
        elif self.eos_token_id is None:
            object.__setattr__(self, "eos_token_id", ())
        else:
            object.__setattr__(self, "eos_token_id", tuple(int(i) for i in self.eos_token_id))
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"expected {name} to be a positive int, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"expected hidden_size ({self.hidden_size}) to be a multiple of num_heads ({self.num_heads})"
            )

    @classmethod
    def from_hf(cls, config: dict[str, Any], source: str | os.PathLike[str] = "config.json") -> "GPT2Config":
        """From a Hugging Face `config.json` (model_type "gpt2").

        Every key is read, known to change nothing at inference (dropouts, the `summary_*`
        keys of the classification head), or refused by name.

        Raises:
            CheckpointError (a ValueError): naming `source`, the key, what was expected and found.
        """
        from attnkit.models.checkpoint import CheckpointError, ConfigReader

        read = ConfigReader(config, source)
        if config.get("model_type") != "gpt2":
            raise CheckpointError(f"{source}: expected model_type 'gpt2', got {config.get('model_type')!r}")
        read.check_keys(_HF_GPT2_KEYS, harmless=_HF_GPT2_HARMLESS, what="attnkit's GPT-2")
        activation = read.text("activation_function", "gelu_new")
        if activation not in _ACTIVATIONS:
            raise CheckpointError(
                f"{source}: activation_function {activation!r} is not supported; expected one of "
                f"{', '.join(_ACTIVATIONS)}"
            )
        hidden = read.integer("n_embd")
        heads = read.integer("n_head")
        if hidden % heads:
            raise CheckpointError(f"{source}: expected n_embd ({hidden}) to be a multiple of n_head ({heads})")
        positions = read.integer("n_positions", 1024)
        n_ctx = read.integer("n_ctx", positions)
        if n_ctx != positions:  # older configs repeat the context length as n_ctx
            raise CheckpointError(f"{source}: n_ctx ({n_ctx}) and n_positions ({positions}) disagree")
        bos = read.token_ids("bos_token_id")
        return cls(
            vocab_size=read.integer("vocab_size"),
            hidden_size=hidden,
            num_layers=read.integer("n_layer"),
            num_heads=heads,
            intermediate_size=read.integer("n_inner", 4 * hidden),
            max_position_embeddings=positions,
            layer_norm_eps=read.number("layer_norm_epsilon", 1e-5, positive=True),
            activation=_ACTIVATIONS[activation],
            scale_attn_weights=read.flag("scale_attn_weights", True),
            scale_attn_by_inverse_layer_idx=read.flag("scale_attn_by_inverse_layer_idx", False),
            tie_word_embeddings=read.flag("tie_word_embeddings", True),
            bos_token_id=bos[0] if bos else None,
            eos_token_id=read.token_ids("eos_token_id"),
        )


# activation_function -> attnkit's activation (transformers' ACT2FN names)
_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}
# config.json keys of GPT-2: read and implemented ...
_HF_GPT2_KEYS = {
    "model_type", "vocab_size", "n_embd", "n_layer", "n_head", "n_inner", "n_positions", "n_ctx",
    "layer_norm_epsilon", "activation_function", "scale_attn_weights", "scale_attn_by_inverse_layer_idx",
    "tie_word_embeddings", "bos_token_id", "eos_token_id",
}
# ... and harmless at inference.
_HF_GPT2_HARMLESS = {
    "attn_pdrop", "embd_pdrop", "resid_pdrop", "is_decoder",
    "reorder_and_upcast_attn",  # computes the scores in float32 under float16: attnkit does anyway
    # the sequence-classification head (GPT2DoubleHeadsModel), not part of the language model
    "summary_activation", "summary_first_dropout", "summary_proj_to_labels", "summary_type", "summary_use_proj",
}


class GPT2Block(Module):
    """Pre-LN block. Children: ``attn_norm``, ``attn`` (with biases), ``mlp_norm``, ``mlp``
    (`FeedForward` with tanh GELU, ``fc1``/``fc2``)."""

    def __init__(self, config: GPT2Config, layer: int, *, seed: int | np.random.Generator | None = None) -> None:
        super().__init__()
        rng = make_rng(seed)
        d, heads = config.hidden_size, config.num_heads
        scale = 1.0 / np.sqrt(d // heads) if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            scale /= layer + 1
        self.attn_norm = LayerNorm(d, config.layer_norm_eps)
        self.attn = CausalSelfAttention(d, heads, bias=True, scale=float(scale), seed=rng)
        self.mlp_norm = LayerNorm(d, config.layer_norm_eps)
        self.mlp = FeedForward(d, config.intermediate_size, activation=config.activation, seed=rng)

    def forward(self, x, cache, layer) -> np.ndarray:
        h = x + self.attn(self.attn_norm(x), cache, layer)
        out = self.mlp(self.mlp_norm(h))
        out += h
        return out


class GPT2LMHeadModel(CausalLM):
    """GPT-2 language model: ids (B, T) -> logits (B, T, vocab).

    Children: ``embed`` (wte), ``pos_embed`` (wpe), ``layers.{i}``, ``norm`` (ln_f), and
    ``lm_head`` unless the head is tied to ``embed`` (`tie_word_embeddings`, the default).
    """

    def __init__(self, config: GPT2Config, *, seed: int | np.random.Generator | None = None, tokenizer=None):
        super().__init__()
        rng = make_rng(seed)
        self.config = config
        self.tokenizer = tokenizer
        self.embed = Embedding(config.vocab_size, config.hidden_size, seed=rng)
        self.pos_embed = Embedding(config.max_position_embeddings, config.hidden_size, seed=rng)
        self.layers = ModuleList(GPT2Block(config, i, seed=rng) for i in range(config.num_layers))
        self.norm = LayerNorm(config.hidden_size, config.layer_norm_eps)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, seed=rng)
        self._head_from = None

    def new_cache(self, batch_size: int, max_length: int) -> KVCache:
        c = self.config
        head_dim = c.hidden_size // c.num_heads
        return KVCache(c.num_layers, batch_size, c.num_heads, head_dim, max_length, dtype=self.dtype)

    def embed_inputs(self, ids, positions):
        return self.embed.weight[ids] + self.pos_embed.weight[positions]  # (B, T, d)

    def run_layers(self, x, positions, cache, start=0, stop=None):
        for index in range(start, len(self.layers) if stop is None else stop):
            x = self.layers[index](x, cache, index)
        return x

    def final_norm(self, x):
        return self.norm(x)

    def _logits(self, hidden: np.ndarray) -> np.ndarray:
        source = self.embed.weight if self.config.tie_word_embeddings else self.lm_head.weight
        if self._head_from is not source:
            self._head_t = np.ascontiguousarray(source.T)  # (d, vocab)
            self._head_from = source
        return hidden @ self._head_t

    @classmethod
    def from_folder(cls, folder: str | os.PathLike[str], *, backend: str = "naive") -> "GPT2LMHeadModel":
        """Load a Hugging Face GPT-2 folder (config.json, safetensors, generation_config.json and
        tokenizer.json if present), attending through `backend` (as `set_attention_backend`;
        the name is checked before anything is read).

        The config is validated, then checked against the tensor shapes in the safetensors
        header, before any weight is read; every tensor must be used (the causal-mask buffers
        `attn.bias` / `attn.masked_bias` of older files excepted, which attnkit rebuilds).
        """
        from dataclasses import replace

        from attnkit.models.chat import folder_tokenizer
        from attnkit.models.checkpoint import (
            ConfigReader,
            check_folder,
            is_model_file,
            check_tensors,
            check_tied_copy,
            find_safetensors,
            map_names,
            read_config,
            read_header,
            read_json,
            read_safetensors,
        )

        check_backend(backend)
        folder = check_folder(folder)
        config = GPT2Config.from_hf(read_config(folder), source=folder / "config.json")
        generation = folder / "generation_config.json"
        if is_model_file(generation):  # transformers' generate stops on its eos_token_id
            eos = ConfigReader(read_json(generation), generation).token_ids("eos_token_id")
            config = replace(config, eos_token_id=eos) if eos else config
        files = find_safetensors(folder)
        source = files[0] if len(files) == 1 else f"{folder} ({len(files)} shards)"
        header = read_header(files)
        prefix = "transformer." if any(name.startswith("transformer.") for name in header) else ""
        expected, optional = hf_tensor_shapes(config, prefix)
        ignore = [re.escape(prefix) + pattern for pattern in _HF_GPT2_IGNORE]
        check_tensors(header, expected, optional=optional, ignore=ignore, source=source, config=(
            f"vocab_size={config.vocab_size}, n_embd={config.hidden_size}, n_inner={config.intermediate_size}, "
            f"n_positions={config.max_position_embeddings}, n_layer={config.num_layers}"
        ))
        tokenizer = folder_tokenizer(folder, config.vocab_size, source)  # checked before any weight is read
        tensors = {name.removeprefix("transformer."): array for name, array in read_safetensors(files).items()}
        if config.tie_word_embeddings:
            check_tied_copy(tensors, "lm_head.weight", "wte.weight", source=source)
            tensors.pop("lm_head.weight", None)
        mapped, _ = map_names(_split_conv1d(tensors, config), _HF_GPT2_NAMES, ignore=_HF_GPT2_IGNORE, source=source)
        model = cls(config, seed=0)
        model.load_state_dict(mapped)
        model.tokenizer = tokenizer
        return model.set_attention_backend(backend) if backend != "naive" else model


def hf_tensor_shapes(
    config: GPT2Config, prefix: str = "transformer."
) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """(expected, optional): Hugging Face tensor name -> shape, in Conv1D's (in, out) layout;
    `prefix` starts every name but the head's (`transformer.` as GPT2LMHeadModel saves them,
    "" for a bare GPT2Model). Optional: a tied head saved anyway (it must equal wte)."""
    c = config
    d, ff = c.hidden_size, c.intermediate_size
    expected: dict[str, tuple[int, ...]] = {
        prefix + "wte.weight": (c.vocab_size, d), prefix + "wpe.weight": (c.max_position_embeddings, d),
        prefix + "ln_f.weight": (d,), prefix + "ln_f.bias": (d,),
    }
    for i in range(c.num_layers):
        p = f"{prefix}h.{i}."
        expected.update({
            p + "ln_1.weight": (d,), p + "ln_1.bias": (d,),
            p + "attn.c_attn.weight": (d, 3 * d), p + "attn.c_attn.bias": (3 * d,),
            p + "attn.c_proj.weight": (d, d), p + "attn.c_proj.bias": (d,),
            p + "ln_2.weight": (d,), p + "ln_2.bias": (d,),
            p + "mlp.c_fc.weight": (d, ff), p + "mlp.c_fc.bias": (ff,),
            p + "mlp.c_proj.weight": (ff, d), p + "mlp.c_proj.bias": (d,),
        })
    head = {"lm_head.weight": (c.vocab_size, d)}
    if c.tie_word_embeddings:
        return expected, head
    return {**expected, **head}, {}


def _split_conv1d(tensors: dict[str, np.ndarray], config: GPT2Config) -> dict[str, np.ndarray]:
    """Conv1D (in, out) weights -> Linear (out, in); c_attn split into q/k/v (shapes checked before)."""
    out: dict[str, np.ndarray] = {}
    for name, array in tensors.items():
        if name.endswith("attn.c_attn.weight"):
            for part, block in zip("qkv", np.split(array, 3, axis=1)):
                out[name.replace("c_attn", f"{part}_proj")] = block.T
        elif name.endswith("attn.c_attn.bias"):
            for part, block in zip("qkv", np.split(array, 3)):
                out[name.replace("c_attn", f"{part}_proj")] = block
        elif name.endswith(("c_proj.weight", "c_fc.weight")):
            out[name] = array.T
        else:
            out[name] = array
    return out


# Hugging Face GPT-2 names (after `_split_conv1d`) -> attnkit names.
_HF_GPT2_NAMES = [
    (r"wte\.weight", r"embed.weight"),
    (r"wpe\.weight", r"pos_embed.weight"),
    (r"h\.(\d+)\.ln_1\.(weight|bias)", r"layers.\1.attn_norm.\2"),
    (r"h\.(\d+)\.attn\.([qkv])_proj\.(weight|bias)", r"layers.\1.attn.\2_proj.\3"),
    (r"h\.(\d+)\.attn\.c_proj\.(weight|bias)", r"layers.\1.attn.out_proj.\2"),
    (r"h\.(\d+)\.ln_2\.(weight|bias)", r"layers.\1.mlp_norm.\2"),
    (r"h\.(\d+)\.mlp\.c_fc\.(weight|bias)", r"layers.\1.mlp.fc1.\2"),
    (r"h\.(\d+)\.mlp\.c_proj\.(weight|bias)", r"layers.\1.mlp.fc2.\2"),
    (r"ln_f\.(weight|bias)", r"norm.\1"),
    (r"lm_head\.weight", r"lm_head.weight"),
]
# The ignore list: the causal-mask buffers older transformers saved (attnkit builds its own mask).
_HF_GPT2_IGNORE = [r"h\.\d+\.attn\.(masked_)?bias"]
