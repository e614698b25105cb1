"""Llama-family decoders (Llama 2/3 layout, SmolLM2) on attnkit's attention.

One block, pre-norm:

    h   = x + out_proj(attention(rope(q_proj(n)), rope(k_proj(n)), v_proj(n)))   n = rms_norm(x)
    out = h + down_proj(silu(gate_proj(m)) * up_proj(m))                          m = rms_norm(h)

with grouped-query attention (SmolLM2-135M: 9 query heads share 3 key/value
heads, head dim 64), rotary position embeddings (base `rope_theta`, 100000 for
SmolLM2), and a final RMSNorm before the output head, which is either the token
embedding itself (tied, as SmolLM2) or its own matrix.

Loaders: `LlamaForCausalLM.from_gguf(path)` (llama.cpp files, any quantization
the `gguf` package dequantizes) and `LlamaForCausalLM.from_folder(path)`
(Hugging Face `config.json` + safetensors).

Speed: a decode step is a chain of matrix-vector products, bound by reading
the weights once per token. Each layer keeps its query/key/value projections
fused into one pre-transposed (d_model, (Hq + 2 Hkv) E) matrix and its gate/up
projections into one (d_model, 2 d_ff) matrix, so a token costs two products
per sublayer instead of five; the head keeps a (d_model, vocab) transposed copy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from attnkit.models.generation import CausalLM
from attnkit.nn.cache import KVCache
from attnkit.nn.decoder_layers import CausalSelfAttention, Embedding, RMSNorm, RotaryEmbedding, SwiGLU
from attnkit.nn.linear import Linear
from attnkit.nn.module import Module, ModuleList, make_rng

__all__ = ["LlamaConfig", "LlamaBlock", "LlamaForCausalLM"]


@dataclass(frozen=True)
class LlamaConfig:
    """Hyperparameters of a Llama-family decoder (defaults: SmolLM2-135M)."""

    vocab_size: int = 49152
    hidden_size: int = 576  # d_model
    intermediate_size: int = 1536  # d_ff of SwiGLU
    num_layers: int = 30
    num_heads: int = 9  # query heads
    num_kv_heads: int = 3  # key/value heads (GQA when fewer than num_heads)
    head_dim: int = 64
    rope_theta: float = 100000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192  # context length
    tie_word_embeddings: bool = True  # head = embedding matrix
    attention_bias: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"expected num_heads ({self.num_heads}) to be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> "LlamaConfig":
        """From a Hugging Face `config.json` (model_type "llama")."""
        if config.get("model_type") != "llama":
            raise ValueError(f"expected a config of model_type 'llama', got {config.get('model_type')!r}")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"expected hidden_act 'silu', got {config.get('hidden_act')!r}")
        if config.get("mlp_bias", False):
            raise ValueError("expected mlp_bias false; biases in the SwiGLU are not supported")
        rope = config.get("rope_parameters") or {}
        scaling = config.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
        if rope_type not in ("default", None):
            raise ValueError(f"expected default rotary embeddings, got rope_type {rope_type!r}")
        theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
        num_heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])

        def single(value: Any) -> int | None:
            if isinstance(value, list):
                value = value[0] if value else None
            return None if value is None else int(value)

        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or hidden // num_heads),
            rope_theta=float(theta),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", False)),
            bos_token_id=single(config.get("bos_token_id")),
            eos_token_id=single(config.get("eos_token_id")),
        )


class LlamaBlock(Module):
    """Pre-norm decoder block: attention then SwiGLU, each around a residual.

    Children: ``attn_norm``, ``attn``, ``mlp_norm``, ``mlp``.
    """

    def __init__(self, config: LlamaConfig, *, seed: int | np.random.Generator | None = None) -> None:
        super().__init__()
        rng = make_rng(seed)
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = CausalSelfAttention(
            config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
            bias=config.attention_bias, seed=rng,
        )
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size, seed=rng)

    def forward(self, x, cos, sin, cache, layer, *, backend="naive", weights=None) -> np.ndarray:
        """x: the residual stream (B, T, d), float64 (see `_hidden_states`); the
        sublayers compute in the parameters' dtype."""
        dt = self.attn_norm.weight.dtype
        normed = self.attn_norm(x).astype(dt, copy=False)
        h = x + self.attn(normed, cache, layer, cos=cos, sin=sin, backend=backend, weights=weights)
        return h + self.mlp(self.mlp_norm(h).astype(dt, copy=False))


class LlamaForCausalLM(CausalLM):
    """A Llama-family language model: ids (B, T) -> logits (B, T, vocab).

    Children: ``embed``, ``layers.{i}`` (`LlamaBlock`), ``norm``, and ``lm_head`` unless the
    head is tied to the embedding. Random weights from `seed`; load real ones with
    `from_gguf`, `from_folder` or `CausalLM.from_pretrained`.
    """

    def __init__(self, config: LlamaConfig, *, seed: int | np.random.Generator | None = None, tokenizer=None):
        super().__init__()
        rng = make_rng(seed)
        self.config = config
        self.tokenizer = tokenizer
        self.embed = Embedding(config.vocab_size, config.hidden_size, seed=rng)
        self.layers = ModuleList(LlamaBlock(config, seed=rng) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, seed=rng)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)
        self._head_from = None

    def new_cache(self, batch_size: int, max_length: int) -> KVCache:
        c = self.config
        return KVCache(c.num_layers, batch_size, c.num_kv_heads, c.head_dim, max_length, dtype=self.dtype)

    def _hidden_states(self, ids, positions, cache, weights):
        # The residual stream is carried in float64: 30 layers each add a float32
        # sublayer output to it, and rounding those sums in float32 doubled the
        # logits' distance from transformers (1.04e-4 -> 7.9e-5 on SmolLM2). It is
        # one d-wide vector per token, so this costs nothing next to the matmuls.
        x = self.embed.weight[ids].astype(np.float64)  # (B, T, d)
        cos, sin = self.rotary.cos_sin(positions)  # (B, T, E) each
        for index, block in enumerate(self.layers):
            x = block(x, cos, sin, cache, index, backend=self.attention_backend, weights=weights)
        return self.norm(x).astype(self.embed.weight.dtype, copy=False)

    def _logits(self, hidden: np.ndarray) -> np.ndarray:
        source = self.embed.weight if self.config.tie_word_embeddings else self.lm_head.weight
        if self._head_from is not source:
            self._head_t = np.ascontiguousarray(source.T)  # (d, vocab)
            self._head_from = source
        return hidden @ self._head_t  # (B, T, vocab)

    # -- loading ---------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> "LlamaForCausalLM":
        """Load a llama.cpp GGUF file (weights dequantized to float32, tokenizer from metadata).

        Raises:
            ValueError: not a GGUF file, not a Llama model, or an unsupported tensor type.
        """
        from attnkit.models.gguf import GGUFFile, llama_config_from_gguf, llama_state_from_gguf, tokenizer_from_gguf

        gguf_file = GGUFFile(path)
        tied = "output.weight" not in gguf_file.tensor_names
        config = llama_config_from_gguf(gguf_file.metadata, tied=tied)
        state = llama_state_from_gguf(gguf_file, config)
        tokenizer = tokenizer_from_gguf(gguf_file.metadata)
        model = cls(config, seed=0, tokenizer=tokenizer)
        model.load_state_dict(state)
        return model

    @classmethod
    def from_folder(cls, folder: str | os.PathLike[str]) -> "LlamaForCausalLM":
        """Load a Hugging Face Llama folder: config.json, model.safetensors (or shards), and
        tokenizer.json if present."""
        from attnkit.models.chat import DecoderTokenizer
        from attnkit.models.checkpoint import load_state_dict, read_config

        folder = Path(folder)
        config = LlamaConfig.from_hf(read_config(folder))
        model = cls(config, seed=0)
        expected = {name: array.shape for name, array in model.state_dict().items()}
        ignore = [r".*rotary_emb\.inv_freq"]
        if config.tie_word_embeddings:
            ignore.append(r"lm_head\.weight")  # a tied head saved anyway is the embedding again
        state = load_state_dict(folder, _HF_LLAMA_NAMES, expected, ignore=ignore)
        model.load_state_dict(state)
        if (folder / "tokenizer.json").is_file():
            model.tokenizer = DecoderTokenizer.from_folder(folder)
        return model


# Hugging Face Llama checkpoint names -> attnkit names.
_HF_LLAMA_NAMES = [
    (r"model\.embed_tokens\.weight", r"embed.weight"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", r"layers.\1.attn_norm.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)", r"layers.\1.attn.\2_proj.\3"),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.(weight|bias)", r"layers.\1.attn.out_proj.\2"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", r"layers.\1.mlp_norm.weight"),
    (r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight", r"layers.\1.mlp.\2_proj.weight"),
    (r"model\.norm\.weight", r"norm.weight"),
    (r"lm_head\.weight", r"lm_head.weight"),
]
