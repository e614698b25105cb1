"""Multi-head attention built from a list of independent heads (the third seed).

Each head is a SingleHeadSelfAttention with its own (head_dim, d_model) query,
key and value projections; the head outputs are concatenated and projected by
``out_proj``. This is the same function as the split-head MultiHeadAttention:
stacking the heads' projection matrices row-wise gives the split-head
matrices, which is what `from_split` and `to_split` do and what the tests
prove. The split-head form is faster (one matrix product per role instead of
one per head and role); this one is easier to read.
"""

from __future__ import annotations

import numpy as np

from attnkit.nn.attention import (
    AttentionResult,
    MultiHeadAttention,
    SingleHeadSelfAttention,
    _positive_int,
    attention_options,
)
from attnkit.nn.layers import check_dropout
from attnkit.nn.linear import Linear, linear
from attnkit.nn.interface import AttentionModule
from attnkit.nn.module import ModuleList, check_float_input, compute_dtype, make_rng


class PerHeadMultiHeadAttention(AttentionModule):
    """Multi-head attention as num_heads separate heads, concatenated, then out_proj.

    Arguments:
        d_model: model width; head_dim = d_model // num_heads.
        num_heads: number of heads.
        bias: biases on every projection.
        dropout: dropout on the attention weights, only in training mode.
        seed: int, Generator or None; initializes head 0 (q, k, v), head 1, ...,
            then out_proj, then drives dropout.

    Parameters: ``heads.{h}.q_proj.weight`` (head_dim, d_model), likewise
    ``k_proj``/``v_proj`` (and their biases), ``out_proj.weight`` (d_model, d_model).
    Called like MultiHeadAttention (self or cross attention with key/value of
    width d_model).
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        bias: bool = True,
        dropout: float = 0.0,
        seed: int | np.random.Generator | None = None,
    ) -> None:
        super().__init__()
        self.d_model = _positive_int("d_model", d_model)
        self.num_heads = _positive_int("num_heads", num_heads)
        if self.d_model % self.num_heads:
            raise ValueError(f"expected num_heads to divide d_model, got d_model={d_model} and num_heads={num_heads}")
        self.head_dim = self.d_model // self.num_heads
        self.dropout = check_dropout(dropout)
        rng = make_rng(seed)
        self.heads = ModuleList(
            SingleHeadSelfAttention(self.d_model, self.head_dim, bias, seed=rng) for _ in range(self.num_heads)
        )
        self.out_proj = Linear(self.d_model, self.d_model, bias, seed=rng)
        self.rng = rng

    def forward(
        self,
        query: np.ndarray,
        key: np.ndarray | None = None,
        value: np.ndarray | None = None,
        *,
        attn_mask: np.ndarray | None = None,
        key_mask: np.ndarray | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
        average_attn_weights: bool = True,
    ) -> AttentionResult:
        """Same arguments and result as MultiHeadAttention.forward."""
        query = check_float_input("query", query)
        if query.ndim != 3 or query.shape[-1] != self.d_model:
            raise ValueError(f"expected query of shape (B, L, d_model={self.d_model}), got {query.shape}")
        if key is None and value is not None:
            raise ValueError("got value without key; pass key too (or neither, for self-attention)")
        key = query if key is None else check_float_input("key", key)
        value = key if value is None else check_float_input("value", value)
        for name, x in (("key", key), ("value", value)):
            if x.ndim != 3 or x.shape[0] != query.shape[0] or x.shape[-1] != self.d_model:
                raise ValueError(f"expected {name} of shape (B={query.shape[0]}, S, {self.d_model}), got {x.shape}")
        if value.shape[1] != key.shape[1]:
            raise ValueError(f"expected value of key's shape {key.shape}, got {value.shape}")
        B, L, _ = query.shape
        S = key.shape[1]
        dt = compute_dtype(np.result_type(query, key, value), self.out_proj.weight.dtype)
        options = attention_options(attn_mask, key_mask, is_causal=is_causal, batch=B, num_heads=self.num_heads,
                                    L=L, S=S, dtype=dt)
        query, key, value = (x.astype(dt, copy=False) for x in (query, key, value))

        # Each head projects with its own weights; the heads then attend in one call
        # through this module's backend (`attend`: recorded, any backend).
        q = np.stack([linear(query, h.q_proj.weight, h.q_proj.bias) for h in self.heads], axis=1)  # (B, H, L, E)
        k = np.stack([linear(key, h.k_proj.weight, h.k_proj.bias) for h in self.heads], axis=1)  # (B, H, S, E)
        v = np.stack([linear(value, h.v_proj.weight, h.v_proj.bias) for h in self.heads], axis=1)  # (B, H, S, E)
        result = self.attend(q, k, v, dropout_p=self.dropout if self.training else 0.0, rng=self.rng,
                             return_weights=need_weights, **options)
        heads = result.output if need_weights else result  # (B, H, L, E)
        concatenated = heads.transpose(0, 2, 1, 3).reshape(B, L, -1)  # (B, L, d_model)
        out = linear(concatenated, self.out_proj.weight, self.out_proj.bias).astype(query.dtype, copy=False)
        all_weights = None
        if need_weights:
            all_weights = result.weights  # (B, H, L, S)
            if average_attn_weights:
                all_weights = all_weights.mean(axis=1)  # (B, L, S)
        return AttentionResult(out, all_weights)

    # ----- conversion to and from the split-head form ------------------------------------

    @classmethod
    def from_split(cls, mha: MultiHeadAttention) -> PerHeadMultiHeadAttention:
        """The per-head module computing the same function as `mha`.

        Head h takes rows h*E:(h+1)*E of q_proj; with grouped-query attention
        it gets a copy of key/value head h // (num_heads // num_kv_heads).
        """
        if not isinstance(mha, MultiHeadAttention):
            raise TypeError(f"expected a MultiHeadAttention, got {type(mha).__name__}")
        if mha.kdim != mha.d_model or mha.vdim != mha.d_model:
            raise ValueError(f"per-head attention needs kdim = vdim = d_model, got kdim={mha.kdim}, vdim={mha.vdim}")
        has_bias = mha.q_proj.bias is not None
        ours = cls(mha.d_model, mha.num_heads, bias=has_bias, dropout=mha.dropout, seed=0).astype(mha.dtype)
        E, group = mha.head_dim, mha.num_heads // mha.num_kv_heads
        state = {"out_proj.weight": mha.out_proj.weight}
        if has_bias:
            state["out_proj.bias"] = mha.out_proj.bias
        for h in range(mha.num_heads):
            q_rows = slice(h * E, (h + 1) * E)
            kv_rows = slice((h // group) * E, (h // group + 1) * E)
            for role, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
                proj = getattr(mha, f"{role}_proj")
                state[f"heads.{h}.{role}_proj.weight"] = proj.weight[rows]
                if has_bias:
                    state[f"heads.{h}.{role}_proj.bias"] = proj.bias[rows]
        ours.load_state_dict(state)
        return ours

    def to_split(self, num_kv_heads: int | None = None) -> MultiHeadAttention:
        """The split-head MultiHeadAttention computing the same function.

        With `num_kv_heads` smaller than num_heads, the heads of each group must
        have identical key and value projections (as `from_split` makes them);
        otherwise this raises ValueError.
        """
        H = self.num_heads
        Hkv = H if num_kv_heads is None else _positive_int("num_kv_heads", num_kv_heads)
        if H % Hkv:
            raise ValueError(f"expected num_kv_heads to divide num_heads={H}, got {Hkv}")
        group = H // Hkv
        has_bias = self.out_proj.bias is not None
        for h in range(H):
            leader = self.heads[(h // group) * group]
            for role in ("k", "v"):
                mine, theirs = getattr(self.heads[h], f"{role}_proj"), getattr(leader, f"{role}_proj")
                same = np.array_equal(mine.weight, theirs.weight) and (
                    not has_bias or np.array_equal(mine.bias, theirs.bias)
                )
                if not same:
                    raise ValueError(
                        f"cannot share key/value heads with num_kv_heads={Hkv}: head {h}'s {role}_proj differs "
                        f"from head {(h // group) * group}'s"
                    )
        mha = MultiHeadAttention(self.d_model, H, Hkv, bias=has_bias, dropout=self.dropout, seed=0).astype(self.dtype)
        kv_heads = [self.heads[g * group] for g in range(Hkv)]
        state = {
            "q_proj.weight": np.concatenate([head.q_proj.weight for head in self.heads]),
            "k_proj.weight": np.concatenate([head.k_proj.weight for head in kv_heads]),
            "v_proj.weight": np.concatenate([head.v_proj.weight for head in kv_heads]),
            "out_proj.weight": self.out_proj.weight,
        }
        if has_bias:
            state.update({
                "q_proj.bias": np.concatenate([head.q_proj.bias for head in self.heads]),
                "k_proj.bias": np.concatenate([head.k_proj.bias for head in kv_heads]),
                "v_proj.bias": np.concatenate([head.v_proj.bias for head in kv_heads]),
                "out_proj.bias": self.out_proj.bias,
            })
        mha.load_state_dict(state)
        return mha

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, num_heads={self.num_heads}, dropout={self.dropout}"
