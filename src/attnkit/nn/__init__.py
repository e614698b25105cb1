"""attnkit's NumPy modules, built on attnkit.functional.

Weights are in torch's layout (Linear.weight is (out_features, in_features),
y = x @ W.T + b) and state-dict keys are dotted attribute paths
(``attn.q_proj.weight``). Masks: boolean True = may attend; ``key_mask`` (B, S)
True = a real token. See docs/nn.md.
"""

from __future__ import annotations

from attnkit.nn.interface import (
    AttentionCall,
    AttentionModule,
    AttentionRecording,
    BackendCapabilities,
    active_edits,
    active_recorders,
    backend_capabilities,
    intervene,
    record_attention,
    supports,
)
from attnkit.nn.attention import AttentionResult, MultiHeadAttention, SingleHeadSelfAttention
from attnkit.nn.block import BlockOutput, TransformerBlock
from attnkit.nn.layers import ACTIVATIONS, FeedForward, LayerNorm, dropout, gelu, gelu_tanh, layer_norm, relu
from attnkit.nn.linear import Linear, linear
from attnkit.nn.module import LoadResult, Module, ModuleList
from attnkit.nn.perhead import PerHeadMultiHeadAttention
from attnkit.nn.positional import sinusoidal_positional_encoding

# Decoder pieces (KV cache, RMSNorm, rotary) are imported here by their own module.
from attnkit.nn.cache import KVCache
from attnkit.nn.paged import CacheFull, PagedKVCache
from attnkit.nn.decoder_layers import CausalSelfAttention, Embedding, RMSNorm, RotaryEmbedding, SwiGLU

__all__ = [
    "ACTIVATIONS",
    "BackendCapabilities",
    "backend_capabilities",
    "supports",
    "AttentionModule",
    "AttentionRecording",
    "active_recorders",
    "AttentionResult",
    "BlockOutput",
    "CacheFull",
    "CausalSelfAttention",
    "Embedding",
    "FeedForward",
    "KVCache",
    "LayerNorm",
    "Linear",
    "LoadResult",
    "Module",
    "ModuleList",
    "MultiHeadAttention",
    "PagedKVCache",
    "PerHeadMultiHeadAttention",
    "RMSNorm",
    "RotaryEmbedding",
    "SwiGLU",
    "SingleHeadSelfAttention",
    "TransformerBlock",
    "dropout",
    "gelu",
    "gelu_tanh",
    "layer_norm",
    "linear",
    "record_attention",
    "intervene",
    "active_edits",
    "AttentionCall",
    "relu",
    "sinusoidal_positional_encoding",
]
