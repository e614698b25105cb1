"""Layers whose weights stay in a GGUF file's quantized blocks.

A GGUF model loaded with the compiled kernels on (`attnkit.kernels.enabled()`) keeps every
weight matrix as the file stores it: a read-only view of the memory-mapped file, blocks of
Q4_1, Q8_0, ... (`QuantizedTensor`); no float32 copy is made. Products dequantize inside
the kernel (`attnkit.quant.matmul`): a decode step's matrix-vector products read the
blocks once, a prompt's matrix products dequantize a tile at a time into BLAS.

- `QuantizedTensor`: a (rows, K) matrix as blocks. `W.T` is an operator for `x @ W.T`
  (what the fused projections of `CausalSelfAttention` and `SwiGLU` compute), `W[ids]`
  dequantizes rows (an embedding lookup), `W.dequantize()` the whole matrix.
- `QuantizedLinear`, `QuantizedEmbedding`: `Linear` and `Embedding` on such a matrix; their
  `weight` is the float32 matrix, dequantized when read (for inspection, not for the math).
- `QuantizedCausalSelfAttention`, `QuantizedSwiGLU`: the decoder's attention and gated
  feed-forward, the same forward, their fused products on the blocks.

Products of float32 (or float16) inputs run on the compiled loops in float32; float64
inputs (a model converted with `astype(np.float64)`: its norms then give float64) run the
NumPy reference in float64 on the same dequantized values. The dequantized float32 model
(`LlamaForCausalLM.from_gguf(path, quantized=False)`) is the reference they are tested against.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from attnkit.quant.products import matmul_stack
from attnkit.quant.reference import dequantize
from attnkit.quant.types import GGMLType, ggml_type, row_bytes
from attnkit.nn.decoder_layers import CausalSelfAttention, SwiGLU
from attnkit.nn.interface import AttentionModule
from attnkit.nn.module import Module

__all__ = [
    "QuantizedCausalSelfAttention",
    "QuantizedEmbedding",
    "QuantizedLinear",
    "QuantizedSwiGLU",
    "QuantizedTensor",
    "quantized_types",
]


def quantized_types() -> tuple[str, ...]:
    """The names of the GGML types a `QuantizedTensor` holds (`GGMLType`: F32, F16, Q4_0,
    Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16)."""
    return tuple(GGMLType.__members__)


class QuantizedTensor:
    """A weight matrix W (rows, K) kept as GGUF blocks.

    Arguments:
        raw: uint8 (rows, bytes per row), each row `K` values of type `kind` in blocks (a view
            of the memory-mapped file, or any array of that layout; never copied).
        kind: the GGML type: a `GGMLType` or its name, one of `quantized_types()` (kept as
            the name, `kind`; `ggml_type` is the member).
        columns: K.
        row_order: optional (rows,) integer array: row r of W is stored row `row_order[r]`
            (llama.cpp's permuted query/key rows, undone without moving a byte).
    """

    dtype = np.dtype(np.float32)  # what its lookups give (products follow x: float64 stays float64)
    __array_ufunc__ = None  # x @ W.T reaches `_Transposed.__rmatmul__`, never NumPy's matmul

    def __init__(self, raw: np.ndarray, kind: str | GGMLType, columns: int,
                 row_order: np.ndarray | None = None) -> None:
        member = ggml_type(kind)
        kind = member.name
        if not isinstance(raw, np.ndarray):
            raise TypeError(f"expected {kind} blocks as a uint8 NumPy array, got {type(raw).__name__}")
        if raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[1] != row_bytes(kind, columns):
            raise ValueError(
                f"expected {kind} blocks as uint8 (rows, {row_bytes(kind, columns)}), got {raw.dtype} {raw.shape}"
            )
        if row_order is not None:
            row_order = np.asarray(row_order, dtype=np.intp)
            if sorted(row_order.tolist()) != list(range(raw.shape[0])):
                raise ValueError(f"expected row_order to be a permutation of range({raw.shape[0]})")
        self.raw, self.kind, self.ggml_type, self.columns, self.row_order = raw, kind, member, int(columns), row_order

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.raw.shape[0]), self.columns)

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks (what a product reads)."""
        return int(self.raw.nbytes)

    @property
    def T(self) -> "_Transposed":  # noqa: N802 - NumPy's spelling
        """The operator of `x @ W.T`: x (..., K) -> (..., rows)."""
        return _Transposed((self,))

    def dequantize(self) -> np.ndarray:
        """W as float32 (rows, K): a new array (the NumPy reference, `attnkit.quant.dequantize`)."""
        values = dequantize(self.raw, self.kind, self.columns)
        return values if self.row_order is None else values[self.row_order]

    def __getitem__(self, ids) -> np.ndarray:
        """Rows `ids` (an integer array of any shape) dequantized: (*ids.shape, K) float32."""
        ids = np.asarray(ids)
        if not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"expected integer row ids, got dtype {ids.dtype}")
        flat = ids.reshape(-1)
        if self.row_order is not None:
            flat = self.row_order[flat]
        rows = dequantize(np.ascontiguousarray(self.raw[flat]), self.kind, self.columns)  # (n, K)
        return rows.reshape(*ids.shape, self.columns)

    def __repr__(self) -> str:
        return f"QuantizedTensor({self.kind}, shape={self.shape})"


class _Transposed:
    """`x @ W.T` for one or more matrices stacked by rows (fused projections): the outputs of
    each, side by side, as `x @ concatenate(Ws).T` would give them."""

    __array_ufunc__ = None  # ndarray @ this -> __rmatmul__

    def __init__(self, parts: Sequence[QuantizedTensor]) -> None:
        columns = {part.columns for part in parts}
        if len(columns) != 1:
            raise ValueError(f"expected matrices of one row length to stack, got {sorted(columns)}")
        self.parts = tuple(parts)
        self.columns = columns.pop()
        self.rows = sum(part.shape[0] for part in parts)
        orders, start = [], 0
        for part in parts:  # the stored rows each output column reads (llama.cpp's permuted rows)
            rows = part.shape[0]
            orders.append(start + (np.arange(rows) if part.row_order is None else part.row_order))
            start += rows
        reordered = any(part.row_order is not None for part in parts)
        self._order = np.concatenate(orders) if reordered else None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.columns, self.rows)

    def __rmatmul__(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x)
        if x.shape[-1] != self.columns:
            raise ValueError(f"expected x of shape (..., {self.columns}), got {x.shape}")
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.columns)  # (N, K)
        y = matmul_stack(flat, [(part.raw, part.kind) for part in self.parts], self.columns)  # (N, rows), stored order
        if self._order is not None:
            y = y[:, self._order]
        return y.reshape(*lead, self.rows)


class QuantizedLinear(Module):
    """y = x @ W.T + bias with W a `QuantizedTensor` (out_features, in_features).

    Parameters: ``bias`` (out_features,) when given. `weight` is W dequantized to float32,
    a new array at each read (inspection; `forward` never builds it).
    """

    def __init__(self, weight: QuantizedTensor, bias: np.ndarray | None = None) -> None:
        super().__init__()
        object.__setattr__(self, "quantized", weight)
        self.out_features, self.in_features = weight.shape
        self.register_parameter("bias", bias)

    @property
    def weight(self) -> np.ndarray:
        return self.quantized.dequantize()

    def forward(self, x: np.ndarray) -> np.ndarray:
        """x: (..., in_features) -> (..., out_features), float32 (float64 for float64 x)."""
        y = x @ self.quantized.T
        if self.bias is not None:
            y += self.bias
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"{self.quantized.kind}")


class QuantizedEmbedding(Module):
    """An embedding table kept as blocks: `forward(ids)` and `weight[ids]` dequantize the rows
    asked for; `weight` is the `QuantizedTensor` itself (so a tied output head can run
    `hidden @ weight.T` on the blocks)."""

    def __init__(self, weight: QuantizedTensor) -> None:
        super().__init__()
        object.__setattr__(self, "quantized", weight)
        self.num_embeddings, self.embedding_dim = weight.shape

    @property
    def weight(self) -> QuantizedTensor:
        return self.quantized

    def forward(self, ids: np.ndarray) -> np.ndarray:
        """ids (...) -> (..., embedding_dim) float32."""
        ids = np.asarray(ids)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_embeddings):
            raise ValueError(f"expected ids in [0, {self.num_embeddings}), got {ids.min()}..{ids.max()}")
        return self.quantized[ids]

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.quantized.kind}"


def _bias(linear: QuantizedLinear) -> np.ndarray | None:
    return linear.bias


class QuantizedCausalSelfAttention(CausalSelfAttention):
    """`CausalSelfAttention` on quantized projections: the same forward (KV cache, rotary,
    grouped-query attention, the backend), its two fused products on the blocks.

    Arguments:
        q_proj, k_proj, v_proj, out_proj: `QuantizedLinear` (their shapes give the heads).
        num_heads, num_kv_heads: Hq and Hkv; head_dim: E.
        window: a sliding window (keys within `window` positions), or None.
    """

    def __init__(self, q_proj: QuantizedLinear, k_proj: QuantizedLinear, v_proj: QuantizedLinear,
                 out_proj: QuantizedLinear, *, num_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float | None = None) -> None:
        AttentionModule.__init__(self)
        if num_heads % num_kv_heads:
            raise ValueError(f"expected num_heads ({num_heads}) to be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads, self.num_kv_heads, self.head_dim = int(num_heads), int(num_kv_heads), int(head_dim)
        self.scale = scale
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = q_proj, k_proj, v_proj, out_proj
        biases = [_bias(p) for p in (q_proj, k_proj, v_proj)]
        qkv_bias = None if biases[0] is None else np.concatenate(biases)
        self._quantized = (_Transposed([q_proj.quantized, k_proj.quantized, v_proj.quantized]), qkv_bias,
                           out_proj.quantized.T, _bias(out_proj))

    def _fused(self):
        """(qkv_t, qkv_bias, out_t, out_bias): the operators on the blocks."""
        return self._quantized


class QuantizedSwiGLU(SwiGLU):
    """`SwiGLU` on quantized projections: down(silu(gate(x)) * up(x)), gate and up as one
    product on the blocks."""

    def __init__(self, gate_proj: QuantizedLinear, up_proj: QuantizedLinear, down_proj: QuantizedLinear) -> None:
        Module.__init__(self)
        self.d_ff, self.d_model = gate_proj.quantized.shape
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj
        biases = [_bias(p) for p in (gate_proj, up_proj, down_proj)]
        gate_up_bias = None if biases[0] is None else np.concatenate(biases[:2])
        self._quantized = (_Transposed([gate_proj.quantized, up_proj.quantized]), gate_up_bias,
                           down_proj.quantized.T)
        # SwiGLU.forward reads the down bias at _fused_from[5] (weights, then biases)
        self._fused_from = (None, None, None, *biases)

    def _fused(self):
        return self._quantized
