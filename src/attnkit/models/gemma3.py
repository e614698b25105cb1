"""Gemma 3 text decoders (Gemma 3 270M, ...) on attnkit's attention.

One block, with a norm before and after each sublayer:

    h   = x + post_attn_norm(out_proj(attention(rope_l(q_norm(q_proj(n))), rope_l(k_norm(k_proj(n))), v_proj(n))))
    out = h + post_mlp_norm(down_proj(gelu_tanh(gate_proj(m)) * up_proj(m)))     n = attn_norm(x), m = mlp_norm(h)

- Every norm is an RMSNorm whose multiplier is (1 + w): Hugging Face stores w, llama.cpp's
  converter stores 1 + w already. attnkit keeps the multiplier itself (the `RMSNorm` of
  `attnkit.nn`), so a folder's weights get 1 added at load and a GGUF's are taken as they are.
- QK-norm: queries and keys are RMS-normalized per head (over the head dimension, with their
  own (1 + w)) before the rotation.
- Local and global layers: `layer_types` says which layers are "sliding_attention" (a query
  sees its last `sliding_window` keys, itself included: 512 for Gemma 3 270M) and which are
  "full_attention"; Gemma 3 alternates five local layers with one global one. Local layers
  rotate with base `rope_local_theta` (10 000), global ones with `rope_theta` (1 000 000).
- Grouped-query attention down to one key/value head (Gemma 3 270M: 4 query heads, 1 KV
  head, head dim 256, wider than d_model / heads = 160), scores scaled by
  `query_pre_attn_scalar ** -0.5` instead of 1/sqrt(E).
- The embedding is multiplied by sqrt(d_model) on the way in; the output head is the
  embedding (tied); logits are soft-capped, cap * tanh(logits / cap), when
  `final_logit_softcapping` is set.

Attention runs through the modules' one backend interface (`AttentionModule.attend`), so
every backend, `record_attention` and the interventions of `attnkit.interpret` reach it;
local layers pass attnkit's `window=` band as Mistral's and Qwen2's sliding layers do.

Loaders: `Gemma3ForCausalLM.from_gguf` (llama.cpp's "gemma3" files; the weight matrices stay
in their Q8_0/Q5_0/Q4_K/Q6_K blocks when the compiled kernels are on) and `from_folder` (a
Hugging Face `gemma3_text` folder). llama.cpp writes no layer pattern and no local rope base
into the file: it uses every sixth layer global and base 10 000, and so does this loader,
as transformers' does.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from attnkit.models.causal_lm import CausalLM
from attnkit.models.chat import folder_tokenizer
from attnkit.models.checkpoint import (
    CheckpointError,
    ConfigReader,
    check_folder,
    check_tensors,
    check_tied_copy,
    find_safetensors,
    is_model_file,
    read_config,
    read_header,
    read_json,
    read_safetensors,
)
from attnkit.models.gguf import GGUFFile, check_metadata_keys, tokenizer_from_gguf
from attnkit.quant.layers import QuantizedEmbedding, QuantizedLinear, QuantizedTensor, quantized_types
from attnkit.nn.cache import KVCache
from attnkit.nn.decoder_layers import RMSNorm, RotaryEmbedding
from attnkit.nn.interface import AttentionModule
from attnkit.nn.layers import gelu_tanh
from attnkit.nn.linear import Linear
from attnkit.nn.module import Module, ModuleList, make_rng
from attnkit.nn.positional import RopeScaling

__all__ = ["Gemma3Attention", "Gemma3Block", "Gemma3Config", "Gemma3ForCausalLM", "Gemma3MLP"]

FULL, SLIDING = "full_attention", "sliding_attention"


def default_layer_types(num_layers: int, pattern: int = 6) -> tuple[str, ...]:
    """Gemma 3's pattern: every `pattern`-th layer global, the others local."""
    return tuple(FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers))


@dataclass(frozen=True)
class Gemma3Config:
    """Hyperparameters of a Gemma 3 text decoder (defaults: Gemma 3 270M)."""

    vocab_size: int = 262144
    hidden_size: int = 640  # d_model
    intermediate_size: int = 2048  # d_ff of the gated MLP
    num_layers: int = 18  # num_hidden_layers
    num_heads: int = 4  # num_attention_heads
    num_kv_heads: int = 1  # num_key_value_heads
    head_dim: int = 256
    rope_theta: float = 1_000_000.0  # global layers (rope_parameters["full_attention"])
    rope_local_theta: float = 10_000.0  # local layers (rope_parameters["sliding_attention"])
    rope_scaling: RopeScaling | None = None  # global layers only (linear for the larger Gemma 3)
    rms_norm_eps: float = 1e-6
    sliding_window: int = 512  # a local layer's query sees its last `sliding_window` keys, itself included
    layer_types: tuple[str, ...] | None = None  # None: default_layer_types(num_layers)
    query_pre_attn_scalar: float = 256.0  # scores scaled by query_pre_attn_scalar ** -0.5
    final_logit_softcapping: float | None = None
    max_position_embeddings: int = 32768
    bos_token_id: int | None = 2
    eos_token_id: tuple[int, ...] = (1,)

    def __post_init__(self) -> None:
        if isinstance(self.eos_token_id, (int, np.integer)):
            object.__setattr__(self, "eos_token_id", (int(self.eos_token_id),))
        if self.layer_types is None:
            object.__setattr__(self, "layer_types", default_layer_types(self.num_layers))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= {FULL, SLIDING}:
            raise ValueError(
                f"expected layer_types to give {FULL!r} or {SLIDING!r} for each of the {self.num_layers} layers, "
                f"got {self.layer_types!r}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"expected num_heads ({self.num_heads}) to be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"expected an even head_dim for rotary embeddings, got {self.head_dim}")
        if self.sliding_window < 1:
            raise ValueError(f"expected sliding_window >= 1, got {self.sliding_window}")

    def window_of(self, layer: int) -> int | None:
        """The sliding window of `layer` (None: a global layer)."""
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    @property
    def scale(self) -> float:
        return float(self.query_pre_attn_scalar) ** -0.5


# ----------------------------------------------------------------------------- modules


def _linear(weight: Any) -> Module:
    """A bias-free `Linear` on `weight` (out, in) as given, or a `QuantizedLinear` on blocks."""
    if isinstance(weight, QuantizedTensor):
        return QuantizedLinear(weight)
    layer = Linear.__new__(Linear)
    Module.__init__(layer)
    layer.out_features, layer.in_features = weight.shape
    layer.register_parameter("weight", np.asarray(weight, np.float32), order="F")
    layer.register_parameter("bias", None)
    return layer


def _norm(weight: np.ndarray, eps: float) -> RMSNorm:
    """An `RMSNorm` whose multiplier is `weight` (Gemma's 1 + w, already added)."""
    norm = RMSNorm(len(weight), eps)
    norm.weight = np.asarray(weight, np.float32)
    return norm


class Gemma3Attention(AttentionModule):
    """Gemma 3 self-attention: projections, QK-norm, rotary, grouped-query attention through
    the KV cache, a sliding window on local layers.

    Children: ``q_proj`` (Hq*E, d), ``k_proj``/``v_proj`` (Hkv*E, d), ``out_proj`` (d, Hq*E)
    (`Linear` or `QuantizedLinear`), ``q_norm``/``k_norm`` (`RMSNorm` over E).
    """

    def __init__(self, q_proj, k_proj, v_proj, out_proj, q_norm: RMSNorm, k_norm: RMSNorm, *, num_heads: int,
                 num_kv_heads: int, head_dim: int, scale: float, window: int | None) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = q_proj, k_proj, v_proj, out_proj
        self.q_norm, self.k_norm = q_norm, k_norm
        self.num_heads, self.num_kv_heads, self.head_dim = int(num_heads), int(num_kv_heads), int(head_dim)
        self.scale = float(scale)
        self.window = None if window is None else int(window)

    def attend(self, query, key, value, **options):
        if self.window is None:
            return super().attend(query, key, value, **options)
        # key j is seen from position i when i - window < j <= i: window - 1 keys to the left
        return super().attend(query, key, value, window=self.window - 1, **options)

    def forward(self, x: np.ndarray, cache: KVCache, layer: int, *, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """x (B, T, d) -> (B, T, d); cos, sin (B, T, E) this layer's rotary tables."""
        B, T, _ = x.shape
        Hq, Hkv, E = self.num_heads, self.num_kv_heads, self.head_dim
        dt = self.q_norm.weight.dtype
        q = self.q_norm(self.q_proj(x).reshape(B, T, Hq, E), dt)  # (B, T, Hq, E)
        k = self.k_norm(self.k_proj(x).reshape(B, T, Hkv, E), dt)  # (B, T, Hkv, E)
        v = self.v_proj(x).reshape(B, T, Hkv, E)
        q = RotaryEmbedding.apply(q, cos[:, :, None], sin[:, :, None]).transpose(0, 2, 1, 3)  # (B, Hq, T, E)
        k = RotaryEmbedding.apply(k, cos[:, :, None], sin[:, :, None]).transpose(0, 2, 1, 3)  # (B, Hkv, T, E)
        v = v.transpose(0, 2, 1, 3)  # (B, Hkv, T, E)
        result = cache.attend(layer, q, k, v, scale=self.scale, backend=self.attend)  # (B, Hq, T, E)
        return self.out_proj(result.transpose(0, 2, 1, 3).reshape(B, T, Hq * E))  # (B, T, d)

    def extra_repr(self) -> str:
        window = "global" if self.window is None else f"window={self.window}"
        return f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, {window}"


class Gemma3MLP(Module):
    """down_proj(gelu_tanh(gate_proj(x)) * up_proj(x)). Children: ``gate_proj``, ``up_proj``
    (d_ff, d), ``down_proj`` (d, d_ff)."""

    def __init__(self, gate_proj, up_proj, down_proj) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj

    def forward(self, x: np.ndarray) -> np.ndarray:
        """x (..., d) -> (..., d)."""
        hidden = gelu_tanh(self.gate_proj(x))  # (..., d_ff)
        hidden *= self.up_proj(x)
        return self.down_proj(hidden)


class Gemma3Block(Module):
    """Attention then the gated MLP, each between its two norms, each around a residual.

    Children: ``attn_norm``, ``attn``, ``post_attn_norm``, ``mlp_norm``, ``mlp``, ``post_mlp_norm``.
    """

    def __init__(self, attn_norm, attn, post_attn_norm, mlp_norm, mlp, post_mlp_norm) -> None:
        super().__init__()
        self.attn_norm, self.attn, self.post_attn_norm = attn_norm, attn, post_attn_norm
        self.mlp_norm, self.mlp, self.post_mlp_norm = mlp_norm, mlp, post_mlp_norm

    def forward(self, x, cos, sin, cache, layer) -> np.ndarray:
        """x: the residual stream (B, T, d), float64; the sublayers compute in the parameters' dtype."""
        dt = self.attn_norm.weight.dtype
        h = x + self.post_attn_norm(self.attn(self.attn_norm(x, dt), cache, layer, cos=cos, sin=sin), dt)
        h += self.post_mlp_norm(self.mlp(self.mlp_norm(h, dt)), dt)
        return h


class Gemma3ForCausalLM(CausalLM):
    """A Gemma 3 text model: ids (B, T) -> logits (B, T, vocab).

    Children: ``embed``, ``layers.{i}`` (`Gemma3Block`), ``norm``. Random weights from `seed`
    unless `weights` (attnkit's names -> arrays or `QuantizedTensor`s, norms as their 1 + w
    multipliers) are given; load real ones with `from_gguf`, `from_folder` or
    `attnkit.models.AutoCausalLM.from_pretrained("gemma3")`.
    """

    def __init__(self, config: Gemma3Config, *, seed: int | np.random.Generator | None = None, tokenizer=None,
                 weights: dict[str, Any] | None = None) -> None:
        super().__init__()
        c = config
        self.config = c
        self.tokenizer = tokenizer
        state = random_weights(c, make_rng(seed)) if weights is None else weights
        embed = state["embed.weight"]
        if isinstance(embed, QuantizedTensor):
            self.embed = QuantizedEmbedding(embed)
        else:
            from attnkit.nn.decoder_layers import Embedding

            self.embed = Embedding.__new__(Embedding)
            Module.__init__(self.embed)
            self.embed.num_embeddings, self.embed.embedding_dim = embed.shape
            self.embed.register_parameter("weight", np.asarray(embed, np.float32))
        blocks = []
        for i in range(c.num_layers):
            p = f"layers.{i}."

            def norm(name: str, p: str = p) -> RMSNorm:
                return _norm(state[p + name + ".weight"], c.rms_norm_eps)

            def linear(name: str, p: str = p) -> Module:
                return _linear(state[p + name + ".weight"])

            attn = Gemma3Attention(
                linear("attn.q_proj"), linear("attn.k_proj"), linear("attn.v_proj"), linear("attn.out_proj"),
                norm("attn.q_norm"), norm("attn.k_norm"), num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
                head_dim=c.head_dim, scale=c.scale, window=c.window_of(i),
            )
            mlp = Gemma3MLP(linear("mlp.gate_proj"), linear("mlp.up_proj"), linear("mlp.down_proj"))
            blocks.append(Gemma3Block(norm("attn_norm"), attn, norm("post_attn_norm"), norm("mlp_norm"), mlp,
                                      norm("post_mlp_norm")))
        self.layers = ModuleList(blocks)
        self.norm = _norm(state["norm.weight"], c.rms_norm_eps)
        self.rotary_global = RotaryEmbedding(c.head_dim, c.rope_theta, c.rope_scaling)
        self.rotary_local = RotaryEmbedding(c.head_dim, c.rope_local_theta)
        self._head_from = None

    def new_cache(self, batch_size: int, max_length: int) -> KVCache:
        c = self.config
        return KVCache(c.num_layers, batch_size, c.num_kv_heads, c.head_dim, max_length, dtype=self.dtype)

    def embed_inputs(self, ids, positions):
        # float64 residual stream (as attnkit's Llama), the embedding times sqrt(d_model)
        return self.embed.weight[ids].astype(np.float64) * math.sqrt(self.config.hidden_size)  # (B, T, d)

    def run_layers(self, x, positions, cache, start=0, stop=None):
        tables = {FULL: self.rotary_global.cos_sin(positions), SLIDING: self.rotary_local.cos_sin(positions)}
        for index in range(start, len(self.layers) if stop is None else stop):
            cos, sin = tables[self.config.layer_types[index]]  # (B, T, E) each
            x = self.layers[index](x, cos, sin, cache, index)
        return x

    def final_norm(self, x):
        return self.norm(x).astype(self.norm.weight.dtype, copy=False)

    def _logits(self, hidden: np.ndarray) -> np.ndarray:
        source = self.embed.weight  # tied head
        if self._head_from is not source:  # (d, vocab); blocks stay blocks
            self._head_t = source.T if isinstance(source, QuantizedTensor) else np.ascontiguousarray(source.T)
            self._head_from = source
        logits = hidden @ self._head_t  # (B, T, vocab)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = (np.tanh(logits / logits.dtype.type(cap)) * logits.dtype.type(cap)).astype(logits.dtype)
        return logits

    # -- loading ---------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str] | GGUFFile, *, quantized: bool | None = None) -> "Gemma3ForCausalLM":
        """Load a llama.cpp Gemma 3 GGUF file (architecture "gemma3"; tokenizer from metadata).

        Arguments:
            path: the `.gguf` file, or the `GGUFFile` already opened on it.
            quantized: True: weight matrices (embedding included) stay in the file's blocks,
                memory-mapped, on the compiled kernels; False: every weight dequantized to float32;
                None (default): quantized when the compiled kernels are available and every
                matrix's type is one `quantized_types()` lists.

        Raises:
            ValueError: naming the file: not a Gemma 3 file, a key or tensor attnkit does not
                implement, sizes that disagree, an unsupported tensor type.
        """
        gguf_file = path if isinstance(path, GGUFFile) else GGUFFile(path)
        config = config_from_gguf(gguf_file)
        tokenizer = tokenizer_from_gguf(gguf_file)
        if quantized is None:
            quantized = _runs_quantized(gguf_file)
        return cls(config, tokenizer=tokenizer, weights=state_from_gguf(gguf_file, config, quantized=quantized))

    @classmethod
    def from_folder(cls, folder: str | os.PathLike[str]) -> "Gemma3ForCausalLM":
        """Load a Hugging Face `gemma3_text` folder: config.json, model.safetensors (or shards),
        generation_config.json and tokenizer.json if present. Norm weights w become 1 + w."""
        folder = check_folder(folder)
        config = config_from_hf(read_config(folder), folder / "config.json")
        config = _with_generation_config(config, folder)
        files = find_safetensors(folder)
        source = files[0] if len(files) == 1 else f"{folder} ({len(files)} shards)"
        expected = hf_tensor_shapes(config)
        check_tensors(read_header(files), expected, optional={"lm_head.weight": (config.vocab_size, config.hidden_size)},
                      ignore=[], source=source, config=f"hidden_size={config.hidden_size}, layers={config.num_layers}")
        tokenizer = folder_tokenizer(folder, config.vocab_size, source)
        tensors = read_safetensors(files)
        check_tied_copy(tensors, "lm_head.weight", "model.embed_tokens.weight", source=source)
        state = {}
        for name, ours in _hf_names(config).items():
            weight = np.asarray(tensors[name], np.float32)
            state[ours] = weight + np.float32(1) if ours.endswith("norm.weight") else weight
        return cls(config, tokenizer=tokenizer, weights=state)


# ----------------------------------------------------------------------------- random weights


def random_weights(config: Gemma3Config, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Weights drawn like torch's defaults (uniform +-1/sqrt(fan_in), N(0, 1) embedding), norms
    as multipliers near 1: for tests and tiny models."""
    c = config
    d, q, kv, ff, E = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size, \
        c.head_dim

    def matrix(rows: int, cols: int) -> np.ndarray:
        bound = 1.0 / math.sqrt(cols)
        return rng.uniform(-bound, bound, (rows, cols)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    state = {"embed.weight": rng.standard_normal((c.vocab_size, d), dtype=np.float32), "norm.weight": norm(d)}
    for i in range(c.num_layers):
        p = f"layers.{i}."
        state.update({
            p + "attn_norm.weight": norm(d), p + "post_attn_norm.weight": norm(d),
            p + "mlp_norm.weight": norm(d), p + "post_mlp_norm.weight": norm(d),
            p + "attn.q_norm.weight": norm(E), p + "attn.k_norm.weight": norm(E),
            p + "attn.q_proj.weight": matrix(q, d), p + "attn.k_proj.weight": matrix(kv, d),
            p + "attn.v_proj.weight": matrix(kv, d), p + "attn.out_proj.weight": matrix(d, q),
            p + "mlp.gate_proj.weight": matrix(ff, d), p + "mlp.up_proj.weight": matrix(ff, d),
            p + "mlp.down_proj.weight": matrix(d, ff),
        })
    return state


# ----------------------------------------------------------------------------- Hugging Face folders

_HF_KEYS = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rope_theta", "rope_local_base_freq", "rope_parameters", "rope_scaling",
    "rms_norm_eps", "sliding_window", "layer_types", "sliding_window_pattern", "_sliding_window_pattern",
    "query_pre_attn_scalar", "final_logit_softcapping", "max_position_embeddings", "bos_token_id",
    "eos_token_id", "hidden_activation", "model_type",
}
_HF_HARMLESS = {
    "pad_token_id", "initializer_range", "attention_dropout", "use_cache", "torch_dtype", "dtype",
    "architectures", "transformers_version", "cache_implementation", "tie_word_embeddings",
}
_HF_NEUTRAL = {
    "attn_logit_softcapping": (None,),
    "attention_bias": (False,),
    "use_bidirectional_attention": (False, None),
    "hidden_act": ("gelu_pytorch_tanh", None),
}


def _hf_rope(config: dict[str, Any], source) -> tuple[float, float, RopeScaling | None]:
    """(global base, local base, global scaling) from `rope_parameters` (transformers 5: one
    entry per layer type) or the older `rope_theta` / `rope_local_base_freq` / `rope_scaling`."""
    params = config.get("rope_parameters") or config.get("rope_scaling")
    if isinstance(params, dict) and {FULL, SLIDING} & set(params):
        full, local = params.get(FULL) or {}, params.get(SLIDING) or {}
    else:
        full = dict(params or {}, rope_theta=config.get("rope_theta", 1_000_000.0))
        local = {"rope_type": "default", "rope_theta": config.get("rope_local_base_freq", 10_000.0)}
    for kind, entry in ((FULL, full), (SLIDING, local)):
        rope_type = entry.get("rope_type", entry.get("type", "default"))
        allowed = ("default", "linear") if kind == FULL else ("default",)
        if rope_type not in allowed:
            raise CheckpointError(f"{source}: rope type {rope_type!r} of the {kind} layers is not supported by "
                                  f"attnkit's Gemma 3 (expected {' or '.join(allowed)})")
    scaling = None
    if full.get("rope_type", full.get("type")) == "linear":
        scaling = RopeScaling(rope_type="linear", factor=float(full["factor"]))
    return float(full.get("rope_theta", 1_000_000.0)), float(local.get("rope_theta", 10_000.0)), scaling


def config_from_hf(config: dict[str, Any], source: str | os.PathLike[str] = "config.json") -> Gemma3Config:
    """A `Gemma3Config` from a `gemma3_text` config.json (every key read, harmless, or refused)."""
    read = ConfigReader(config, source)
    if config.get("model_type") != "gemma3_text":
        raise CheckpointError(f"{source}: expected model_type 'gemma3_text', got {config.get('model_type')!r}")
    read.check_keys(_HF_KEYS, neutral=_HF_NEUTRAL, harmless=_HF_HARMLESS, what="attnkit's Gemma 3")
    activation = config.get("hidden_activation", "gelu_pytorch_tanh")
    if activation != "gelu_pytorch_tanh":
        raise CheckpointError(f"{source}: expected hidden_activation 'gelu_pytorch_tanh', got {activation!r}")
    if config.get("tie_word_embeddings", True) is not True:
        raise CheckpointError(f"{source}: attnkit's Gemma 3 ties its output head to the embedding; "
                              "tie_word_embeddings false is not supported")
    layers = read.integer("num_hidden_layers")
    layer_types = config.get("layer_types")
    if layer_types is None:
        layer_types = default_layer_types(layers, int(config.get("sliding_window_pattern", 6)))
    rope_theta, rope_local_theta, scaling = _hf_rope(config, source)
    cap = config.get("final_logit_softcapping")
    eos = read.token_ids("eos_token_id")
    bos = read.token_ids("bos_token_id")
    try:
        return Gemma3Config(
            vocab_size=read.integer("vocab_size"),
            hidden_size=read.integer("hidden_size"),
            intermediate_size=read.integer("intermediate_size"),
            num_layers=layers,
            num_heads=read.integer("num_attention_heads"),
            num_kv_heads=read.integer("num_key_value_heads"),
            head_dim=read.integer("head_dim"),
            rope_theta=rope_theta,
            rope_local_theta=rope_local_theta,
            rope_scaling=scaling,
            rms_norm_eps=read.number("rms_norm_eps", 1e-6, positive=True),
            sliding_window=read.integer("sliding_window"),
            layer_types=tuple(layer_types),
            query_pre_attn_scalar=read.number("query_pre_attn_scalar", 256.0, positive=True),
            final_logit_softcapping=None if cap is None else float(cap),
            max_position_embeddings=read.integer("max_position_embeddings", 32768),
            bos_token_id=bos[0] if bos else None,
            eos_token_id=eos or (1,),
        )
    except ValueError as error:
        if isinstance(error, CheckpointError):
            raise
        raise CheckpointError(f"{source}: {error}") from None


def _with_generation_config(config: Gemma3Config, folder: Path) -> Gemma3Config:
    path = folder / "generation_config.json"
    if not is_model_file(path):
        return config
    eos = ConfigReader(read_json(path), path).token_ids("eos_token_id")
    return replace(config, eos_token_id=eos) if eos else config


def _hf_names(config: Gemma3Config) -> dict[str, str]:
    """Hugging Face tensor name -> attnkit's."""
    names = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight"}
    parts = {
        "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attn_norm",
        "pre_feedforward_layernorm": "mlp_norm", "post_feedforward_layernorm": "post_mlp_norm",
        "self_attn.q_proj": "attn.q_proj", "self_attn.k_proj": "attn.k_proj", "self_attn.v_proj": "attn.v_proj",
        "self_attn.o_proj": "attn.out_proj", "self_attn.q_norm": "attn.q_norm", "self_attn.k_norm": "attn.k_norm",
        "mlp.gate_proj": "mlp.gate_proj", "mlp.up_proj": "mlp.up_proj", "mlp.down_proj": "mlp.down_proj",
    }
    for i in range(config.num_layers):
        for theirs, ours in parts.items():
            names[f"model.layers.{i}.{theirs}.weight"] = f"layers.{i}.{ours}.weight"
    return names


def hf_tensor_shapes(config: Gemma3Config) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor name -> shape for `config`."""
    ours = _shapes(config)
    return {theirs: ours[name] for theirs, name in _hf_names(config).items()}


def _shapes(config: Gemma3Config) -> dict[str, tuple[int, ...]]:
    """attnkit's weight name -> shape."""
    c = config
    d, q, kv, ff, E = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size, \
        c.head_dim
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (c.vocab_size, d), "norm.weight": (d,)}
    for i in range(c.num_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "attn_norm.weight": (d,), p + "post_attn_norm.weight": (d,), p + "mlp_norm.weight": (d,),
            p + "post_mlp_norm.weight": (d,), p + "attn.q_norm.weight": (E,), p + "attn.k_norm.weight": (E,),
            p + "attn.q_proj.weight": (q, d), p + "attn.k_proj.weight": (kv, d), p + "attn.v_proj.weight": (kv, d),
            p + "attn.out_proj.weight": (d, q), p + "mlp.gate_proj.weight": (ff, d), p + "mlp.up_proj.weight": (ff, d),
            p + "mlp.down_proj.weight": (d, ff),
        })
    return shapes


# ----------------------------------------------------------------------------- GGUF files

_GGUF_KEYS = {  # any other gemma3.* key (attn_logit_softcapping, rope.scaling.*, ...) is refused by name
    "final_logit_softcapping", "context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
    "attention.head_count_kv", "attention.key_length", "attention.value_length", "attention.layer_norm_rms_epsilon",
    "rope.freq_base", "attention.sliding_window", "rope.dimension_count", "vocab_size",
}
_GGUF_NAMES = {
    "token_embd.weight": "embed.weight",
    "output_norm.weight": "norm.weight",
    "blk.{i}.attn_norm.weight": "layers.{i}.attn_norm.weight",
    "blk.{i}.post_attention_norm.weight": "layers.{i}.post_attn_norm.weight",
    "blk.{i}.ffn_norm.weight": "layers.{i}.mlp_norm.weight",
    "blk.{i}.post_ffw_norm.weight": "layers.{i}.post_mlp_norm.weight",
    "blk.{i}.attn_q_norm.weight": "layers.{i}.attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "layers.{i}.attn.k_norm.weight",
    "blk.{i}.attn_q.weight": "layers.{i}.attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "layers.{i}.attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "layers.{i}.attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "layers.{i}.attn.out_proj.weight",
    "blk.{i}.ffn_gate.weight": "layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "layers.{i}.mlp.down_proj.weight",
}


def config_from_gguf(gguf_file: GGUFFile) -> Gemma3Config:
    """A `Gemma3Config` from llama.cpp's "gemma3" metadata: the layer pattern (every sixth layer
    global) and the local rope base (10 000) are llama.cpp's fixed choices, not in the file."""
    source = gguf_file.path
    if gguf_file.architecture != "gemma3":
        raise CheckpointError(f"{source}: expected a GGUF of architecture 'gemma3', got {gguf_file.architecture!r}")
    metadata = gguf_file.metadata
    check_metadata_keys(gguf_file, "gemma3", known=_GGUF_KEYS, harmless=set(),
                        neutral={}, what="attnkit's Gemma 3")
    read = ConfigReader(metadata, source, prefix="gemma3.")
    head_dim = read.integer("attention.key_length")
    if read.integer("attention.value_length", head_dim) != head_dim:
        raise CheckpointError(f"{source}: expected gemma3.attention.value_length equal to the key length {head_dim}")
    if read.integer("rope.dimension_count", head_dim) != head_dim:
        raise CheckpointError(f"{source}: expected gemma3.rope.dimension_count equal to the head dimension {head_dim}")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise CheckpointError(f"{source} lacks tokenizer.ggml.tokens (the vocabulary), which a Gemma 3 GGUF needs")
    vocab_size = read.integer("vocab_size", len(tokens))
    if vocab_size != len(tokens):
        raise CheckpointError(f"{source}: gemma3.vocab_size is {vocab_size} but the vocabulary has {len(tokens)} tokens")
    special = ConfigReader(metadata, source, prefix="tokenizer.ggml.")
    stop_ids = [i for key in ("eos_token_id", "eot_token_id") for i in special.token_ids(key)]
    # "<end_of_turn>" ends a turn as EOS does (llama.cpp stops on it too)
    if "<end_of_turn>" in tokens:
        stop_ids.append(tokens.index("<end_of_turn>"))
    bos = special.token_ids("bos_token_id")
    layers = read.integer("block_count")
    cap = read.get("final_logit_softcapping")
    try:
        return Gemma3Config(
            vocab_size=vocab_size,
            hidden_size=read.integer("embedding_length"),
            intermediate_size=read.integer("feed_forward_length"),
            num_layers=layers,
            num_heads=read.integer("attention.head_count"),
            num_kv_heads=read.integer("attention.head_count_kv"),
            head_dim=head_dim,
            rope_theta=read.number("rope.freq_base", 1_000_000.0, positive=True),
            rms_norm_eps=read.number("attention.layer_norm_rms_epsilon", 1e-6, positive=True),
            sliding_window=read.integer("attention.sliding_window"),
            query_pre_attn_scalar=float(head_dim),  # llama.cpp: 1/sqrt(head dim) (all but the 27B)
            final_logit_softcapping=None if cap is None else float(cap),
            max_position_embeddings=read.integer("context_length", 32768),
            bos_token_id=bos[0] if bos else None,
            eos_token_id=tuple(dict.fromkeys(stop_ids)),
        )
    except ValueError as error:
        if isinstance(error, CheckpointError):
            raise
        raise CheckpointError(f"{source}: {error}") from None


def _gguf_shapes(config: Gemma3Config) -> dict[str, tuple[int, ...]]:
    ours = _shapes(config)
    shapes = {}
    for theirs, name in _GGUF_NAMES.items():
        for i in range(config.num_layers) if "{i}" in theirs else [None]:
            shapes[theirs.format(i=i)] = ours[name.format(i=i)]
    return shapes


def _runs_quantized(gguf_file: GGUFFile) -> bool:
    from attnkit.quant import compiled_available

    runs = set(quantized_types())
    return compiled_available() and all(
        info.dtype in runs for info in gguf_file.tensor_infos.values() if len(info.shape) == 2)


def state_from_gguf(gguf_file: GGUFFile, config: Gemma3Config, *, quantized: bool = False) -> dict[str, Any]:
    """Every tensor of a Gemma 3 GGUF under attnkit's names (checked against `config` first):
    matrices as float32, or as `QuantizedTensor`s on the file's blocks with `quantized`; norms
    as stored (llama.cpp stores 1 + w). No row permutation: llama.cpp rotates Gemma's halves
    (NeoX order), as Hugging Face does."""
    expected = _gguf_shapes(config)
    c = config
    check_tensors(gguf_file.tensor_infos, expected, optional={}, dtypes=None, source=gguf_file.path,
                  config=f"embedding_length={c.hidden_size}, block_count={c.num_layers}, head_count={c.num_heads}, "
                         f"head_count_kv={c.num_kv_heads}, key_length={c.head_dim}, vocabulary {c.vocab_size}")
    if quantized:
        runs = quantized_types()
        for name, info in gguf_file.tensor_infos.items():
            if len(info.shape) == 2 and info.dtype not in runs:
                raise ValueError(f"tensor {name!r} in {str(gguf_file.path)!r} has GGML type {info.dtype}, which "
                                 f"attnkit's quantized products do not run; load it with quantized=False")
    else:
        gguf_file.check_tensor_types()
    state: dict[str, Any] = {}
    for theirs, ours in _GGUF_NAMES.items():
        for i in range(c.num_layers) if "{i}" in theirs else [None]:
            name, shape = theirs.format(i=i), expected[theirs.format(i=i)]
            if quantized and len(shape) == 2:
                state[ours.format(i=i)] = QuantizedTensor(gguf_file.raw(name), gguf_file.tensor_type(name), shape[1])
            else:
                state[ours.format(i=i)] = gguf_file.tensor(name)
    return state
