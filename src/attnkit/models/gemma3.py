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

A quantized model's decode step runs in one compiled call, Llama's step with Gemma's flags
(`attnkit.models.llama.fused`), when nothing watches the layers.

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
from typing import Any

import numpy as np

from attnkit.models.causal_lm import CausalLM
from attnkit.models.chat import folder_tokenizer
from attnkit.models.checkpoint import check_folder, check_tensors, check_tied_copy, find_safetensors, read_config, \
    read_header, read_safetensors
from attnkit.models.gemma3_config import (  # noqa: F401 - re-exported: the names' home before the split
    FULL,
    SLIDING,
    Gemma3Config,
    _with_generation_config,
    config_from_gguf,
    config_from_hf,
    default_layer_types,
)
from attnkit.models.gemma3_weights import (  # noqa: F401 - re-exported
    _GGUF_NAMES,
    _hf_names,
    _runs_quantized,
    hf_tensor_shapes,
    random_weights,
    state_from_gguf,
)
from attnkit.models.gguf import GGUFFile, tokenizer_from_gguf
from attnkit.models.llama.fused import fused_logits
from attnkit.quant.layers import QuantizedEmbedding, QuantizedLinear, QuantizedTensor
from attnkit.nn.cache import KVCache
from attnkit.nn.decoder_layers import RMSNorm, RotaryEmbedding
from attnkit.nn.interface import AttentionModule
from attnkit.nn.layers import gelu_tanh
from attnkit.nn.linear import Linear
from attnkit.nn.module import Module, ModuleList, make_rng

__all__ = ["Gemma3Attention", "Gemma3Block", "Gemma3Config", "Gemma3ForCausalLM", "Gemma3MLP"]


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

    A quantized model's decode step runs as one compiled call (`attnkit.models.llama.fused`,
    Llama's step with Gemma's flags; `compiled_step_reason` says when not).
    """

    STEP_MODULES = (Gemma3Attention, Gemma3MLP)  # the layers' modules the compiled step stands in for

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

    def _compiled_step(self, ids, positions, cache, threads):
        return fused_logits(self, ids, positions, cache, parts=threads)

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
