"""GPT-2 on attnkit's attention.

    x   = wte[ids] + wpe[positions]                          learned positions
    h   = x + out_proj(causal_attention(ln_1(x)))            pre-LN blocks
    out = h + fc2(gelu_tanh(fc1(ln_2(h))))
    logits = ln_f(out) @ wte^T                               tied head

Hugging Face stores GPT-2's projections as `Conv1D` layers, whose weight is
(in_features, out_features), the transpose of a Linear's, and fuses query, key
and value into one `c_attn` of shape (d, 3d). The loader splits and transposes
them at the boundary; inside attnkit every weight has torch's Linear layout.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from attnkit.models.generation import CausalLM
from attnkit.nn.cache import KVCache
from attnkit.nn.decoder_layers import CausalSelfAttention, Embedding
from attnkit.nn.layers import FeedForward, LayerNorm
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
    layer_norm_eps: float = 1e-5
    scale_attn_weights: bool = True  # divide scores by sqrt(E)
    scale_attn_by_inverse_layer_idx: bool = False  # and by layer + 1
    bos_token_id: int | None = 50256
    eos_token_id: int | None = 50256

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> "GPT2Config":
        """From a Hugging Face `config.json` (model_type "gpt2")."""
        if config.get("model_type") != "gpt2":
            raise ValueError(f"expected a config of model_type 'gpt2', got {config.get('model_type')!r}")
        activation = config.get("activation_function", "gelu_new")
        if activation not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"expected activation_function 'gelu_new' (tanh GELU), got {activation!r}")
        hidden = int(config["n_embd"])
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(config["n_layer"]),
            num_heads=int(config["n_head"]),
            intermediate_size=int(config.get("n_inner") or 4 * hidden),
            max_position_embeddings=int(config.get("n_positions", 1024)),
            layer_norm_eps=float(config.get("layer_norm_epsilon", 1e-5)),
            scale_attn_weights=bool(config.get("scale_attn_weights", True)),
            scale_attn_by_inverse_layer_idx=bool(config.get("scale_attn_by_inverse_layer_idx", False)),
            bos_token_id=config.get("bos_token_id"),
            eos_token_id=config.get("eos_token_id"),
        )


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
        self.mlp = FeedForward(d, config.intermediate_size, activation="gelu_tanh", seed=rng)

    def forward(self, x, cache, layer, *, backend="naive", weights=None) -> np.ndarray:
        h = x + self.attn(self.attn_norm(x), cache, layer, backend=backend, weights=weights)
        out = self.mlp(self.mlp_norm(h))
        out += h
        return out


class GPT2LMHeadModel(CausalLM):
    """GPT-2 language model: ids (B, T) -> logits (B, T, vocab), head tied to ``embed``.

    Children: ``embed`` (wte), ``pos_embed`` (wpe), ``layers.{i}``, ``norm`` (ln_f).
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
        self._head_from = None

    def new_cache(self, batch_size: int, max_length: int) -> KVCache:
        c = self.config
        head_dim = c.hidden_size // c.num_heads
        return KVCache(c.num_layers, batch_size, c.num_heads, head_dim, max_length, dtype=self.dtype)

    def _hidden_states(self, ids, positions, cache, weights):
        x = self.embed.weight[ids] + self.pos_embed.weight[positions]  # (B, T, d)
        for index, block in enumerate(self.layers):
            x = block(x, cache, index, backend=self.attention_backend, weights=weights)
        return self.norm(x)

    def _logits(self, hidden: np.ndarray) -> np.ndarray:
        if self._head_from is not self.embed.weight:
            self._head_t = np.ascontiguousarray(self.embed.weight.T)  # (d, vocab)
            self._head_from = self.embed.weight
        return hidden @ self._head_t

    @classmethod
    def from_folder(cls, folder: str | os.PathLike[str]) -> "GPT2LMHeadModel":
        """Load a Hugging Face GPT-2 folder (config.json, safetensors, tokenizer.json if present)."""
        from attnkit.models.chat import DecoderTokenizer
        from attnkit.models.checkpoint import (
            check_shapes,
            find_safetensors,
            map_names,
            read_config,
            read_safetensors,
        )

        folder = Path(folder)
        config = GPT2Config.from_hf(read_config(folder))
        model = cls(config, seed=0)
        files = find_safetensors(folder)
        tensors = _split_conv1d(read_safetensors(files), config)
        mapped, original = map_names(
            tensors, _HF_GPT2_NAMES, ignore=[r"lm_head\.weight", r".*attn\.(masked_)?bias"], source=files[0]
        )
        expected = {name: array.shape for name, array in model.state_dict().items()}
        check_shapes(mapped, expected, original=original, source=files[0])
        model.load_state_dict(mapped)
        if (folder / "tokenizer.json").is_file():
            model.tokenizer = DecoderTokenizer.from_folder(folder)
        return model


def _split_conv1d(tensors: dict[str, np.ndarray], config: GPT2Config) -> dict[str, np.ndarray]:
    """Conv1D (in, out) weights -> Linear (out, in); c_attn split into q/k/v."""
    d = config.hidden_size
    out: dict[str, np.ndarray] = {}
    for name, array in tensors.items():
        name = name.removeprefix("transformer.")
        if name.endswith("attn.c_attn.weight"):
            if array.shape != (d, 3 * d):
                raise ValueError(f"expected {name} of shape ({d}, {3 * d}), got {array.shape}")
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
]
