"""Llama-family decoders (Llama 2/3 layout, SmolLM2) on attnkit's attention.

One block, pre-norm:

    h   = x + out_proj(attention(rope(q_proj(n)), rope(k_proj(n)), v_proj(n)))   n = rms_norm(x)
    out = h + down_proj(silu(gate_proj(m)) * up_proj(m))                          m = rms_norm(h)

with grouped-query attention (SmolLM2-135M: 9 query heads share 3 key/value
heads, head dim 64), rotary position embeddings (base `rope_theta`, 100000 for
SmolLM2; scaled as `rope_scaling` says: linear, dynamic, yarn, llama3), and a
final RMSNorm before the output head, which is either the token embedding
itself (tied, as SmolLM2) or its own matrix. The projections carry biases when
the checkpoint says so (`attention_bias`, `mlp_bias`, or bias tensors in a GGUF).

Loaders: `LlamaForCausalLM.from_gguf(path)` (llama.cpp files, any quantization
the `gguf` package dequantizes) and `LlamaForCausalLM.from_folder(path)`
(Hugging Face `config.json` + safetensors). Both follow the checkpoint rule of
`attnkit.models.checkpoint`: every key understood or refused by name, shapes
checked against the file header before anything is allocated, every tensor used.
The names of both formats stop here: `LlamaConfig.from_hf` / `from_gguf` read the
config keys, `_HF_LLAMA_NAMES` / `_GGUF_LLAMA_NAMES` map the tensor names
(`attnkit.models.gguf` only reads the file).

One detail of GGUF matters for correctness: llama.cpp's converter permutes the
rows of the query and key projections (and their biases) so that its rotary
embedding can rotate adjacent pairs (x0, x1), (x2, x3), ... instead of the two
halves (x_i, x_{i+E/2}) that Hugging Face's Llama rotates. `state_from_gguf`
undoes that permutation (`unpermute_rotary_rows`), as transformers does, so one
rotary embedding serves GGUF and safetensors checkpoints alike.

What a Llama GGUF may carry beyond the plain model, and what attnkit does with it:

- `blk.N.attn_{q,k,v,output}.bias`, `blk.N.ffn_{gate,up,down}.bias`: biases
  (a missing one of a set is zero). llama.cpp uses them; transformers' GGUF
  loader drops them.
- `rope_freqs.weight`: llama.cpp's per-frequency divisors of the rotary
  frequencies, which is how its converter stores Llama 3.1's rope scaling
  (no scaling-type key). transformers' GGUF loader ignores it.
- `{arch}.rope.scaling.type` "linear" (or `rope.scale_linear`) with its
  factor; "yarn" and "longrope" are refused.

Speed: a decode step is a chain of matrix-vector products, bound by reading
the weights once per token. Each layer keeps its query/key/value projections
fused into one pre-transposed (d_model, (Hq + 2 Hkv) E) matrix and its gate/up
projections into one (d_model, 2 d_ff) matrix, so a token costs two products
per sublayer instead of five; the head keeps a (d_model, vocab) transposed copy.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from attnkit.models.causal_lm import CausalLM
from attnkit.models.chat import folder_tokenizer
from attnkit.models.checkpoint import check_folder, check_tensors, check_tied_copy, find_safetensors, map_names, \
    read_config, read_header, read_safetensors
from attnkit.models.gguf import GGUFFile, tokenizer_from_gguf
from attnkit.models.llama.config import LlamaConfig, _describe, _with_generation_config
from attnkit.models.llama.fused import fused_logits
from attnkit.models.llama.sliding import QuantizedSlidingWindowSelfAttention, SlidingWindowSelfAttention
from attnkit.models.llama.weights import _HF_LLAMA_IGNORE, _HF_LLAMA_NAMES, hf_tensor_shapes, state_from_gguf
from attnkit.quant.layers import (
    QuantizedCausalSelfAttention,
    QuantizedEmbedding,
    QuantizedLinear,
    QuantizedSwiGLU,
    QuantizedTensor,
    quantized_types,
)
from attnkit.nn.cache import KVCache
from attnkit.nn.decoder_layers import CausalSelfAttention, Embedding, RMSNorm, RotaryEmbedding, SwiGLU
from attnkit.nn.linear import Linear
from attnkit.nn.module import Module, ModuleList, make_rng

__all__ = ["LlamaBlock", "LlamaForCausalLM", "SlidingWindowSelfAttention"]


class LlamaBlock(Module):
    """Pre-norm decoder block: attention then SwiGLU, each around a residual.

    Children: ``attn_norm``, ``attn``, ``mlp_norm``, ``mlp``.
    """

    def __init__(
        self, config: LlamaConfig, layer: int = 0, *, seed: int | np.random.Generator | None = None
    ) -> None:
        super().__init__()
        rng = make_rng(seed)
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        window = config.window_of(layer)
        sizes = (config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim)
        bias = config.attention_bias or config.qkv_bias
        if window is None:
            self.attn = CausalSelfAttention(*sizes, bias=bias, seed=rng)
        else:
            self.attn = SlidingWindowSelfAttention(*sizes, window=window, bias=bias, seed=rng)
        if config.qkv_bias and not config.attention_bias:
            self.attn.out_proj.bias = np.zeros_like(self.attn.out_proj.bias)  # Qwen2: no output bias
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size, bias=config.mlp_bias, seed=rng)

    def forward(self, x, cos, sin, cache, layer) -> np.ndarray:
        """x: the residual stream (B, T, d), float64 (see `_hidden_states`); the
        sublayers compute in the parameters' dtype."""
        dt = self.attn_norm.weight.dtype
        h = x + self.attn(self.attn_norm(x, dt), cache, layer, cos=cos, sin=sin)
        h += self.mlp(self.mlp_norm(h, dt))
        return h


class LlamaForCausalLM(CausalLM):
    """A Llama-family language model: ids (B, T) -> logits (B, T, vocab).

    Children: ``embed``, ``layers.{i}`` (`LlamaBlock`), ``norm``, and ``lm_head`` unless the
    head is tied to the embedding. Random weights from `seed`; load real ones with
    `from_gguf`, `from_folder` or `attnkit.models.AutoCausalLM.from_pretrained`.
    """

    def __init__(self, config: LlamaConfig, *, seed: int | np.random.Generator | None = None, tokenizer=None):
        super().__init__()
        rng = make_rng(seed)
        self.config = config
        self.tokenizer = tokenizer
        self.embed = Embedding(config.vocab_size, config.hidden_size, seed=rng)
        self.layers = ModuleList(LlamaBlock(config, i, seed=rng) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, seed=rng)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self._head_from = None

    def new_cache(self, batch_size: int, max_length: int) -> KVCache:
        c = self.config
        return KVCache(c.num_layers, batch_size, c.num_kv_heads, c.head_dim, max_length, dtype=self.dtype)

    def embed_inputs(self, ids, positions):
        # The residual stream is carried in float64: 30 layers each add a float32
        # sublayer output to it, and rounding those sums in float32 doubled the
        # logits' distance from transformers (1.04e-4 -> 7.9e-5 on SmolLM2). It is
        # one d-wide vector per token, so this costs nothing next to the matmuls.
        return self.embed.weight[ids].astype(np.float64)  # (B, T, d)

    def run_layers(self, x, positions, cache, start=0, stop=None):
        cos, sin = self.rotary.cos_sin(positions)  # (B, T, E) each
        for index in range(start, len(self.layers) if stop is None else stop):
            x = self.layers[index](x, cos, sin, cache, index)
        return x

    def final_norm(self, x):
        return self.norm(x).astype(self.norm.weight.dtype, copy=False)  # the parameters' dtype

    def _compiled_step(self, ids, positions, cache, threads):
        # a quantized model's decode step runs in one compiled call when nothing watches the
        # layers (attnkit.models.llama.fused: compiled_step_reason says when not); else layer by layer
        return fused_logits(self, ids, positions, cache, parts=threads)

    def _logits(self, hidden: np.ndarray) -> np.ndarray:
        source = self.embed.weight if self.config.tie_word_embeddings else self.lm_head.weight
        if self._head_from is not source:  # (d, vocab); blocks stay blocks (`QuantizedTensor.T`)
            self._head_t = source.T if isinstance(source, QuantizedTensor) else np.ascontiguousarray(source.T)
            self._head_from = source
        return hidden @ self._head_t  # (B, T, vocab)

    @property
    def context_length(self) -> int:
        """`max_position_embeddings`; with "dynamic" rope scaling, `factor` times that (the
        length dynamic NTK scaling stretches the model to; transformers sets no limit)."""
        c = self.config
        if c.rope_scaling is not None and c.rope_scaling.is_dynamic:
            return int(c.max_position_embeddings * c.rope_scaling.factor)
        return int(c.max_position_embeddings)

    # -- loading ---------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str] | GGUFFile, *, quantized: bool | None = None) -> "LlamaForCausalLM":
        """Load a llama.cpp GGUF file (tokenizer from metadata).

        The metadata and the tensor shapes are checked before any tensor is read; every
        tensor is used (`LlamaConfig.from_gguf`, `state_from_gguf`).

        Arguments:
            path: the `.gguf` file, or the `GGUFFile` already opened on it.
            quantized: True: weight matrices stay in the file's blocks, memory-mapped, and run
                on the compiled kernels (`attnkit.quant.layers`; no float32 copy, loads in a
                fraction of a second); False: every weight dequantized to float32 (the
                reference); None (default): quantized when `attnkit.kernels.enabled()`, every
                matrix's type is one `quantized_types()` lists.

        Raises:
            ValueError: naming the file: not a GGUF file, not a Llama model, a key or tensor
                attnkit does not implement, sizes that disagree, an unsupported tensor type.
            MissingExtraError: the `gguf` package is not installed (`pip install 'attnkit[gguf]'`).
        """
        gguf_file = path if isinstance(path, GGUFFile) else GGUFFile(path)
        config = LlamaConfig.from_gguf(gguf_file)
        tokenizer = tokenizer_from_gguf(gguf_file)
        if quantized is None:
            quantized = _runs_quantized(gguf_file, config)
        if quantized:
            return _quantized_model(cls, config, state_from_gguf(gguf_file, config, quantized=True), tokenizer)
        state = state_from_gguf(gguf_file, config)
        model = cls(config, seed=0, tokenizer=tokenizer)
        model.load_state_dict(state)
        return model

    @classmethod
    def from_folder(cls, folder: str | os.PathLike[str]) -> "LlamaForCausalLM":
        """Load a Hugging Face Llama folder: config.json, model.safetensors (or shards),
        generation_config.json and tokenizer.json if present.

        The config is validated, then checked against the tensor shapes in the safetensors
        headers, before any weight is read; every tensor must be used (rotary `inv_freq`
        buffers excepted). `eos_token_id` from generation_config.json, when there, is what
        transformers' `generate` stops on, and so is it here.
        """
        folder = check_folder(folder)
        config = LlamaConfig.from_hf(read_config(folder), source=folder / "config.json")
        config = _with_generation_config(config, folder)
        files = find_safetensors(folder)
        source = files[0] if len(files) == 1 else f"{folder} ({len(files)} shards)"
        expected, optional = hf_tensor_shapes(config)
        check_tensors(read_header(files), expected, optional=optional, ignore=_HF_LLAMA_IGNORE, source=source,
                      config=_describe(config))
        tokenizer = folder_tokenizer(folder, config.vocab_size, source)  # checked before any weight is read
        tensors = read_safetensors(files)
        if config.tie_word_embeddings:
            check_tied_copy(tensors, "lm_head.weight", "model.embed_tokens.weight", source=source)
            tensors.pop("lm_head.weight", None)
        state, _ = map_names(tensors, _HF_LLAMA_NAMES, ignore=_HF_LLAMA_IGNORE, source=source)
        if config.qkv_bias and not config.attention_bias:  # Qwen2: no output bias, so zero
            for i in range(config.num_layers):
                state[f"layers.{i}.attn.out_proj.bias"] = np.zeros(config.hidden_size, np.float32)
        model = cls(config, seed=0)
        model.load_state_dict(state)
        model.tokenizer = tokenizer
        return model


def _runs_quantized(gguf_file: GGUFFile, config: LlamaConfig) -> bool:
    """Whether `from_gguf` keeps the blocks by default: compiled kernels on, every matrix of a
    type they run."""
    from attnkit.quant import compiled_available

    if not compiled_available():
        return False
    runs = set(quantized_types())
    return all(info.dtype in runs for info in gguf_file.tensor_infos.values() if len(info.shape) == 2)


def _quantized_model(cls, config: LlamaConfig, state: dict[str, Any], tokenizer) -> "LlamaForCausalLM":
    """A `LlamaForCausalLM` whose matrices are `state`'s `QuantizedTensor`s: built part by part
    as `LlamaForCausalLM.__init__` builds it, without drawing random weights to replace."""
    c = config
    def norm(name: str) -> RMSNorm:
        module = RMSNorm(c.hidden_size, c.rms_norm_eps)
        module.weight = state[name]
        return module

    def linear(name: str) -> QuantizedLinear:
        return QuantizedLinear(state[name + ".weight"], state.get(name + ".bias"))

    model = cls.__new__(cls)
    CausalLM.__init__(model)
    model.config = c
    model.tokenizer = tokenizer
    model.embed = QuantizedEmbedding(state["embed.weight"])
    blocks = []
    for i in range(c.num_layers):
        p = f"layers.{i}."
        block = LlamaBlock.__new__(LlamaBlock)
        Module.__init__(block)
        block.attn_norm = norm(p + "attn_norm.weight")
        projections = tuple(linear(p + f"attn.{part}_proj") for part in ("q", "k", "v", "out"))
        sizes = dict(num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim)
        window = c.window_of(i)
        if window is None:
            block.attn = QuantizedCausalSelfAttention(*projections, **sizes)
        else:
            block.attn = QuantizedSlidingWindowSelfAttention(*projections, **sizes, window=window)
        block.mlp_norm = norm(p + "mlp_norm.weight")
        block.mlp = QuantizedSwiGLU(*(linear(p + f"mlp.{part}_proj") for part in ("gate", "up", "down")))
        blocks.append(block)
    model.layers = ModuleList(blocks)
    model.norm = norm("norm.weight")
    if not c.tie_word_embeddings:
        model.lm_head = linear("lm_head")
    model.rotary = RotaryEmbedding(c.head_dim, c.rope_theta, c.rope_scaling)
    model._head_from = None
    return model
