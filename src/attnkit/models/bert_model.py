"""BERT-family encoders on attnkit's attention: the model, its one forward, the loader.

Read top to bottom: the model built from attnkit.nn modules, its one forward (padded or
packed input), and `load_bert`. The config is in attnkit.models.bert_config, the tokenizer
in attnkit.models.bert_tokenizer, the checkpoint names in attnkit.models.bert_checkpoint;
sentence embeddings on top (`SentenceEncoder`) are in attnkit.models.sentence.
`attnkit.models.bert` gathers the public names of all of them.

The model (Hugging Face `BertModel` without the pooler):

    x = LayerNorm(word[ids] + position[0..T-1] + token_type[types])     # (N, D) token rows
    for each layer:                                                       # post-LN block
        x = LayerNorm(x + attention(x))
        x = LayerNorm(x + fc2(gelu(fc1(x))))                              # exact (erf) GELU

Every step but attention works on token rows, so one forward serves both
inputs: a padded batch (B, T) is B*T rows, attending through each layer's
attention module (`AttentionModule.attend`) with a boolean key mask (True =
real token, never a large negative number); a packed batch (total,) with
`cu_seqlens` (FlashAttention's layout) is just the real tokens, attending
through `attnkit.functional.varlen_attention`, so projections, feed-forward and
LayerNorms never touch padding. A sentence embedding is what the folder's
sentence-transformers modules make of the last hidden states over the real
tokens (attnkit.models.sentence: Pooling, Dense, Normalize; for a plain folder
the mean, L2-normalized), with inputs truncated to the folder's max_seq_length.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from attnkit.functional import varlen_attention
from attnkit.kernels import elementwise as compiled
from attnkit.models.bert_checkpoint import read_bert_weights
from attnkit.models.bert_config import BertConfig
from attnkit.nn import LayerNorm, Module, ModuleList, TransformerBlock
from attnkit.nn.interface import AttentionModule, active_edits, active_recorders, record_attention, supports
from attnkit.nn.layers import gelu

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

    def forward(
        self, input_ids: np.ndarray, token_type_ids: np.ndarray, positions: np.ndarray | None = None
    ) -> np.ndarray:
        """(B, T) ids and types -> (B, T, D), positions 0..T-1; or any shape of ids,
        types and `positions` (packed (N,): each token's place in its sequence) -> (..., D)."""
        x = self.word(input_ids)  # (..., D)
        x += self.position(np.arange(input_ids.shape[-1]) if positions is None else positions)
        x += self.token_type(token_type_ids)
        return self.norm(x)


class BertOutput(NamedTuple):
    """What `BertModel` returns.

    last_hidden_state: (B, T, D) for a padded batch, (total, D) for a packed one.
    hidden_states: the embeddings' output then each layer's, num_layers + 1 of
        the same shape, or None unless asked for.
    attentions: the attention probabilities, or None unless asked for: for a
        padded batch each layer's (B, H, T, T); for a packed batch one
        (G, H, Lg, Lg) per group of up to `BertModel.ATTENTION_GROUP` sequences
        per layer, in call order (with one sequence: each layer's (1, H, L, L)).
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


def _check_cu_seqlens(cu_seqlens: Any, total: int, longest_allowed: int) -> np.ndarray:
    """Cumulative offsets (batch + 1,) from 0 to `total`, each sequence 1..longest_allowed tokens."""
    cu = np.asarray(cu_seqlens)
    if cu.dtype == np.bool_ or not np.issubdtype(cu.dtype, np.integer):
        raise TypeError(f"expected cu_seqlens to be an integer array, got dtype {cu.dtype}")
    if cu.ndim != 1 or cu.shape[0] < 2:
        raise ValueError(f"expected cu_seqlens of shape (batch + 1,) with batch >= 1, got shape {cu.shape}")
    cu = cu.astype(np.int64, copy=False)
    lengths = np.diff(cu)
    if cu[0] != 0 or cu[-1] != total or lengths.min() < 1:
        raise ValueError(
            f"expected cu_seqlens to rise from 0 to the {total} packed tokens by at least 1 per "
            f"sequence, got {cu.tolist() if cu.size <= 12 else cu}"
        )
    if lengths.max() > longest_allowed:
        raise ValueError(
            f"expected at most max_position_embeddings={longest_allowed} tokens per sequence, "
            f"got {lengths.max()}"
        )
    return cu


# ----------------------------------------------------------------------------- row kernels
#
# The forward's element-wise steps, in place on (N, ·) token rows: float32 GELU
# and LayerNorm with few passes over memory and no temporaries the size of the
# activations.

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
    by chunk (the bias is added while the chunk is in cache); returns x. With the
    compiled kernels (`attnkit.kernels.elementwise.gelu_bias`) one pass; these NumPy
    lines are their reference."""
    if compiled.usable(x) and (bias is None or (bias.dtype == np.float32 and bias.flags.c_contiguous)):
        if bias is None:
            compiled.gelu(x)
        else:
            compiled.gelu_bias(x, bias)
        return x
    rows = min(_GELU_ROWS, x.shape[0])
    a = np.empty((rows, x.shape[1]), np.float32)
    z = np.empty_like(a)
    t = np.empty_like(a)
    e = np.empty_like(a)
    for start in range(0, x.shape[0], rows):
        xs = x[start : start + rows]
        n = xs.shape[0]
        As, zs, ts, es = a[:n], z[:n], t[:n], e[:n]
        if bias is not None:
            xs += bias
        np.abs(xs, out=As)
        np.multiply(As, _INV_SQRT2, out=zs)  # z = |x| / sqrt(2)
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
        es *= As  # |x| erfc(|x|/sqrt(2))
        # 2 max(x, 0) = x + |x| exactly (np.maximum is several times slower than an add)
        xs += As
        xs -= es
        xs *= np.float32(0.5)  # max(x, 0) - |x|/2 erfc(|x|/sqrt(2)): no cancellation for x < 0
    return x


def _add_layer_norm_inplace(y: np.ndarray, add_bias: np.ndarray, residual: np.ndarray, norm: LayerNorm) -> np.ndarray:
    """y = norm((y + add_bias) + residual) for (N, D) rows, in place: a post-LN block's
    bias, residual and LayerNorm in one visit of each row with the compiled kernels
    (`attnkit.kernels.elementwise.add_layer_norm`), else these NumPy lines (the reference)."""
    if compiled.usable(y, residual, add_bias, norm.weight, norm.bias):
        compiled.add_layer_norm(y, add_bias, residual, norm.weight, norm.bias, norm.eps)
        return y
    y += add_bias
    y += residual
    return _layer_norm_inplace(y, norm.weight, norm.bias, norm.eps)


def _layer_norm_inplace(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    """torch's LayerNorm over the last axis of a (N, D) array, in place, in x's dtype."""
    dtype = x.dtype.type
    mean = x.mean(axis=1, keepdims=True)  # (N, 1)
    x -= mean
    var = np.einsum("nd,nd->n", x, x)[:, None]  # (N, 1) sum of squares
    var *= dtype(1.0 / x.shape[1])
    var += dtype(eps)
    np.sqrt(var, out=var)
    x /= var
    x *= weight
    x += bias
    return x


class BertModel(Module):
    """A BERT encoder (Hugging Face BertModel minus the pooler) from attnkit.nn modules.

    Attributes: `embeddings` (BertEmbeddings) and `blocks` (ModuleList of post-LN
    `TransformerBlock`s with exact GELU and the config's LayerNorm eps). The
    forward reads the blocks' parameters (and their attention modules' backend)
    on every call: change them and the next call uses them.
    """

    ATTENTION_GROUP = 16  # packed sequences padded together when attention goes through `attend`

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
        cu_seqlens: np.ndarray | None = None,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
    ) -> BertOutput:
        """Encode a padded batch, or a packed one.

        Arguments:
            input_ids: (B, T) integer token ids, T <= max_position_embeddings; or,
                with `cu_seqlens`, (total,) the tokens of every sequence packed
                one after another, without padding.
            attention_mask: (B, T), True / 1 = real token, False / 0 = padding
                (Hugging Face's convention); default all real. None for packed input.
            token_type_ids: segment ids shaped like input_ids; default zeros.
            cu_seqlens: packed input's cumulative offsets (batch + 1,), from 0 to
                total (FlashAttention's `cu_seqlens`): sequence b is tokens
                cu_seqlens[b]:cu_seqlens[b + 1], each 1..max_position_embeddings long.
            output_hidden_states, output_attentions: also return those.

        Returns:
            BertOutput(last_hidden_state (B, T, D) or (total, D), hidden_states,
            attentions), in the parameters' dtype. Padded positions get hidden
            states too (they attend to the real tokens), as in Hugging Face;
            padded keys get weight exactly 0.

        Attention: a padded batch attends through each layer's attention module
        (`attend`: its backend, recorded by `record_attention`). A packed batch
        runs `attnkit.functional.varlen_attention` with the module's backend
        ("naive" or "flash"; for "naive" in float32 with the compiled kernels on,
        the same attention runs on the fused projections directly, without
        copies); while the model is recorded or intervened on
        (`attnkit.nn.interface.intervene`), or for a backend
        varlen_attention does not know (one registered by a user), it goes
        through `attend` instead, for groups of up to ATTENTION_GROUP
        consecutive sequences padded to the group's longest.
        """
        config = self.config
        packed = cu_seqlens is not None
        ids = _as_index_array("input_ids", input_ids, None, config.vocab_size)
        if packed:
            if ids.ndim != 1:
                raise ValueError(f"expected packed input_ids of shape (total,) with cu_seqlens, got {ids.shape}")
            if attention_mask is not None:
                raise ValueError(
                    "expected attention_mask=None with cu_seqlens: packed input has no padding to mask, "
                    f"got an attention_mask of shape {np.shape(attention_mask)}"
                )
            cu = _check_cu_seqlens(cu_seqlens, ids.shape[0], config.max_position_embeddings)
            lengths = np.diff(cu)
            # each token's place in its sequence
            positions = np.arange(ids.shape[0]) - np.repeat(cu[:-1], lengths)
        else:
            if ids.ndim != 2:
                raise ValueError(f"expected input_ids of shape (B, T), or (total,) with cu_seqlens, got {ids.shape}")
            B, T = ids.shape
            if T > config.max_position_embeddings:
                raise ValueError(
                    f"expected at most max_position_embeddings={config.max_position_embeddings} "
                    f"tokens, got T={T}"
                )
            positions = None
        types = np.zeros_like(ids) if token_type_ids is None else _as_index_array(
            "token_type_ids", token_type_ids, ids.shape, config.type_vocab_size
        )
        key_mask = None
        if attention_mask is not None:
            key_mask = np.asarray(attention_mask)
            if key_mask.shape != (B, T):
                raise ValueError(f"expected attention_mask of shape {(B, T)}, got {key_mask.shape}")
            key_mask = key_mask.astype(bool)

        def attend(module: AttentionModule, qkv: np.ndarray, qkv_bias: np.ndarray | None):
            if packed:
                return self._attend_packed(module, qkv, qkv_bias, cu)
            return self._attend_padded(module, _add_bias(qkv, qkv_bias), B, key_mask), None

        recording = record_attention(self) if output_attentions else contextlib.nullcontext()
        with recording as recorded:
            x = self.embeddings(ids, types, positions)  # (B, T, D) or (total, D)
            shape = x.shape
            x = x.reshape(-1, shape[-1])  # token rows (N, D)
            hidden_states = [x] if output_hidden_states else None
            for block in self.blocks:
                x = self._block(block, x, attend)
                if output_hidden_states:
                    hidden_states.append(x)
        attentions = None
        if output_attentions:
            attentions = tuple(w.astype(x.dtype, copy=False) for w in recorded.maps)
        return BertOutput(
            last_hidden_state=x.reshape(shape),
            hidden_states=tuple(h.reshape(shape) for h in hidden_states) if output_hidden_states else None,
            attentions=attentions,
        )

    # ----- one layer, on token rows

    def _block(self, block: TransformerBlock, x: np.ndarray, attend: Callable) -> np.ndarray:
        """One post-LN layer on token rows (N, D) -> new rows (N, D). `attend(module, qkv,
        qkv_bias)` turns the fused (N, 3D) products and their bias into the (N, D) attention
        context, and returns it with the value bias when it left that out (else None):
        each row of softmax weights sums to 1, so P (V + b_v) = P V + b_v, and b_v passes
        through the output projection into its bias. Never writes to x (so the returned
        rows can be kept as hidden states)."""
        attn, ffn = block.attn, block.ffn
        qkv_weight, qkv_bias = attn.fused_weights("qkv", x.dtype)
        qkv = x @ qkv_weight.T  # (N, 3D): one matrix product for the three projections
        context, value_bias = attend(attn, qkv, qkv_bias)  # (N, D)
        out_weight, out_bias = attn.out_proj.weight, attn.out_proj.bias
        y = context @ out_weight.T  # (N, D)
        if value_bias is not None:
            out_bias = out_bias + value_bias @ out_weight.T  # (D,): b_o + W_o b_v
        x = _add_layer_norm_inplace(y, out_bias, x, block.norm1)  # LayerNorm(y + bias + x)
        h = x @ ffn.fc1.weight.T  # (N, F)
        if h.dtype == np.float32:
            gelu_inplace(h, ffn.fc1.bias)
        else:
            h += ffn.fc1.bias
            h = gelu(h)  # float64: the C library's erf
        y = h @ ffn.fc2.weight.T  # (N, D)
        return _add_layer_norm_inplace(y, ffn.fc2.bias, x, block.norm2)  # LayerNorm(y + bias + x)

    def _attend_padded(
        self, module: AttentionModule, qkv: np.ndarray, B: int, key_mask: np.ndarray | None
    ) -> np.ndarray:
        """(B*T, 3D) projections of a padded batch -> (B*T, D) context, through `module.attend`."""
        H, E = self.config.num_attention_heads, self.config.head_dim
        T = qkv.shape[0] // B
        q, k, v = qkv.reshape(B, T, 3, H, E).transpose(2, 0, 3, 1, 4)  # each (B, H, T, E)
        out = module.attend(q, k, v, attn_mask=None if key_mask is None else key_mask[:, None, None, :])
        return out.transpose(0, 2, 1, 3).reshape(B * T, H * E)  # (B, T, H, E) -> rows

    def _attend_packed(
        self, module: AttentionModule, qkv: np.ndarray, qkv_bias: np.ndarray | None, cu: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """(total, 3D) products of packed sequences and their bias -> ((total, D) context, the
        value bias when left out (see `_block`), else None).

        With the compiled kernels, the naive backend and nobody recording or editing, the
        attention runs on the products directly (`_packed_attention_compiled`) and only
        the query bias is added: the key bias shifts each row of scores by one constant,
        q . b_k, which the softmax removes, and the value bias is left to `_block`. Else the
        whole bias is added and `varlen_attention` (the reference) or `attend` runs."""
        H, E = self.config.num_attention_heads, self.config.head_dim
        D = H * E
        N = qkv.shape[0]
        plain = not (active_recorders(module) or active_edits(module))
        if plain and supports(module.backend, "reference") and compiled.usable(qkv):
            if qkv_bias is None:
                return _packed_attention_compiled(qkv, cu, H, E), None
            compiled.add_bias_to_leading_columns(qkv, qkv_bias[:D])  # qkv[:, :D] += b_q
            return _packed_attention_compiled(qkv, cu, H, E), qkv_bias[2 * D :]
        heads = _add_bias(qkv, qkv_bias).reshape(N, 3, H, E)
        if plain and supports(module.backend, "varlen"):
            out = varlen_attention(heads[:, 0], heads[:, 1], heads[:, 2], cu, cu, backend=module.backend)
            return out.reshape(N, D), None
        # Through `attend` (recorded, edited, or a backend varlen_attention does not know): pad
        # groups of consecutive sequences into contiguous (3, G, H, L, E) heads, masked.
        context = np.empty((N, H * E), qkv.dtype)
        lengths = np.diff(cu)
        for first in range(0, len(lengths), self.ATTENTION_GROUP):
            last = min(first + self.ATTENTION_GROUP, len(lengths))
            group = lengths[first:last]
            G, L = len(group), int(group.max())
            real = np.arange(L)[None, :] < group[:, None]  # (G, L) True = real token
            rows = slice(int(cu[first]), int(cu[last]))
            padded = np.zeros((3, G, H, L, E), qkv.dtype)  # padding rows stay zero
            padded.transpose(1, 3, 0, 2, 4)[real] = heads[rows]
            out = module.attend(
                padded[0], padded[1], padded[2],
                attn_mask=None if G == 1 else real[:, None, None, :],  # (G, 1, 1, L)
            )  # (G, H, L, E)
            context[rows] = out.transpose(0, 2, 1, 3)[real].reshape(-1, H * E)
        return context, None


def _add_bias(products: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """products += bias (in place, when there is one); returns products."""
    if bias is not None:
        products += bias
    return products


def _packed_attention_compiled(qkv: np.ndarray, cu: np.ndarray, H: int, E: int) -> np.ndarray:
    """softmax(q k^T / sqrt(E)) v per packed sequence and head, straight from the fused
    (total, 3 H E) projections, with the compiled softmax for short rows
    (`attnkit.kernels.elementwise.attention_softmax`): `varlen_attention`'s naive backend
    (the reference) without its copies. Each run of consecutive sequences of one length L
    is one batch: q, k and v are strided views of the projections, both products are
    batched BLAS products on them, and P V lands in the context rows directly. Returns the
    (total, H E) context."""
    context = np.empty((qkv.shape[0], H * E), qkv.dtype)
    lengths = np.diff(cu)
    bounds = [0, *(np.flatnonzero(lengths[1:] != lengths[:-1]) + 1).tolist(), len(lengths)]
    scale = 1.0 / math.sqrt(E)
    for first, last in zip(bounds[:-1], bounds[1:]):
        n, L = last - first, int(lengths[first])
        rows = slice(int(cu[first]), int(cu[last]))
        x = qkv[rows].reshape(n, L, 3, H, E)
        scores = np.matmul(x[:, :, 0].transpose(0, 2, 1, 3), x[:, :, 1].transpose(0, 2, 3, 1))  # (n, H, L, L)
        compiled._attention_softmax(scores, scale)
        out = context[rows].reshape(n, L, H, E).transpose(0, 2, 1, 3)  # (n, H, L, E), a view
        np.matmul(scores, x[:, :, 2].transpose(0, 2, 1, 3), out=out)  # P V
    return context


def load_bert(folder: str | Path) -> BertModel:
    """A `BertModel` with the weights of a Hugging Face BERT folder.

    The config is validated, then checked against the safetensors headers
    (attnkit.models.bert_checkpoint), and only then is the model built and the weights read.

    Raises:
        CheckpointError: unsupported architecture or setting, a missing or
            malformed config key, no weights, a corrupt file, or a missing /
            unexpected / mis-shaped tensor (named, with the config key it disagrees with).
    """
    config, state = read_bert_weights(folder)
    model = BertModel(config)
    model.load_state_dict(state)
    return model


__all__ = [
    "BertEmbeddings",
    "BertModel",
    "BertOutput",
    "gelu_inplace",
    "load_bert",
]
