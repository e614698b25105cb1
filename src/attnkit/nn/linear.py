"""Linear: y = x @ W.T + b, with W in torch's (out_features, in_features) layout."""

from __future__ import annotations

import math

import numpy as np

from attnkit.nn.module import Module, check_float_input, compute_dtype, make_rng


def linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """y = x @ weight.T + bias over the last axis of x, as one matrix product.

    Arguments:
        x: (..., in_features), already in the dtype to compute in.
        weight: (out_features, in_features).
        bias: (out_features,) or None.
    Returns:
        (..., out_features), in the promoted dtype of x and weight.
    """
    out_features, in_features = weight.shape
    lead = x.shape[:-1]
    # One GEMM over all rows; reshape is a view when x is contiguous.
    y = x.reshape(-1, in_features) @ weight.T  # (N, out_features)
    if bias is not None:
        y += bias
    return y.reshape(*lead, out_features)


class Linear(Module):
    """A fully connected layer, y = x @ weight.T + bias.

    Arguments:
        in_features, out_features: sizes of the last axis in and out.
        bias: whether to learn an additive bias.
        seed: int, numpy Generator or None for the initialization.

    Parameters (state-dict keys): ``weight`` (out_features, in_features),
    ``bias`` (out_features,). Initialization is torch-like: weight uniform in
    +-1/sqrt(in_features) (torch's kaiming_uniform with a=sqrt(5)), bias zero.
    Drawn in float64 and stored in float32, so the same seed gives the same
    weights (up to rounding) in either dtype. The weight is kept in
    column-major (Fortran) order; it is still an (out, in) array.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        seed: int | np.random.Generator | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"expected {name} to be a positive int, got {value!r}")
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        rng = make_rng(seed)
        bound = 1.0 / math.sqrt(self.in_features)
        # Stored column-major: weight.T is then a row-major (in, out) array and
        # x @ weight.T a plain GEMM, faster in OpenBLAS for few rows (docs/benchmarks.md).
        weight = rng.uniform(-bound, bound, (self.out_features, self.in_features))
        self.register_parameter("weight", weight, order="F")
        self.register_parameter("bias", np.zeros(self.out_features) if bias else None)

    def forward(self, x: np.ndarray) -> np.ndarray:
        """x: (..., in_features) -> (..., out_features), in x's dtype."""
        x = check_float_input("x", x)
        if x.ndim < 1 or x.shape[-1] != self.in_features:
            raise ValueError(f"expected x of shape (..., {self.in_features}), got {x.shape}")
        dt = compute_dtype(x.dtype, self.weight.dtype)
        y = linear(x.astype(dt, copy=False), self.weight, self.bias)
        return y.astype(x.dtype, copy=False)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
