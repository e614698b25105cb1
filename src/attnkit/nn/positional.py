"""Position encodings: the sinusoidal table of Vaswani et al. 2017 (section 3.5), and the
inverse frequencies of rotary embeddings with the scalings checkpoints use (`RopeScaling`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from attnkit.nn.module import parameter_dtype


def sinusoidal_positional_encoding(
    num_positions: int,
    d_model: int,
    *,
    start: int = 0,
    base: float = 10000.0,
    dtype: np.dtype | type = np.float32,
) -> np.ndarray:
    """The fixed sinusoidal table of "Attention Is All You Need".

    PE[pos, 2i]   = sin(pos / base^(2i / d_model))
    PE[pos, 2i+1] = cos(pos / base^(2i / d_model))

    for pos = start, ..., start + num_positions - 1 (pass `start` to continue a
    sequence, e.g. when decoding token by token). An odd d_model ends with a
    sine column. Computed in float64, returned in `dtype`.

    Returns:
        (num_positions, d_model) array; add it to (B, L, d_model) embeddings.
    """
    for name, value in (("num_positions", num_positions), ("d_model", d_model), ("start", start)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise TypeError(f"expected {name} to be an int, got {type(value).__name__}")
    if num_positions < 0:
        raise ValueError(f"expected num_positions >= 0, got {num_positions}")
    if d_model < 1:
        raise ValueError(f"expected d_model >= 1, got {d_model}")
    if start < 0:
        raise ValueError(f"expected start >= 0, got {start}")
    if not (isinstance(base, (int, float)) and math.isfinite(base) and base > 1):
        raise ValueError(f"expected base to be a finite number > 1, got {base!r}")
    dt = parameter_dtype(dtype)
    position = np.arange(start, start + num_positions, dtype=np.float64)[:, None]  # (P, 1)
    two_i = np.arange(0, d_model, 2, dtype=np.float64)  # (ceil(d/2),)
    inv_freq = np.exp(two_i * (-math.log(base) / d_model))  # base^(-2i/d)
    angles = position * inv_freq  # (P, ceil(d/2))
    table = np.empty((num_positions, d_model), dtype=np.float64)
    table[:, 0::2] = np.sin(angles)
    table[:, 1::2] = np.cos(angles[:, : d_model // 2])
    return table.astype(dt)


# ----------------------------------------------------------------------------- rotary scaling


ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "divisors")


@dataclass(frozen=True)
class RopeScaling:
    """How a checkpoint stretches its rotary embeddings past the length it was trained on.

    The names are those of Hugging Face's `rope_scaling` / `rope_parameters`; `rope_frequencies`
    turns them into inverse frequencies exactly as `transformers.modeling_rope_utils` does.

    - "default": theta_i = base^(-2i/E).
    - "linear": theta_i / factor (positions interpolated by `factor`).
    - "dynamic": NTK-aware; once a sequence reaches length L > `max_position_embeddings`,
      base grows to base * (factor L / max_position_embeddings - (factor - 1))^(E/(E-2)).
    - "yarn": a ramp between interpolated (theta_i / factor) and original frequencies over the
      dimensions set by `beta_fast`/`beta_slow`, and cos/sin multiplied by `attention_factor`
      (default 0.1 ln(factor) + 1, or the `mscale`/`mscale_all_dim` ratio).
    - "llama3": Llama 3.1's: low frequencies (wavelength > original/low_freq_factor) divided by
      `factor`, high ones (wavelength < original/high_freq_factor) kept, a smooth blend between.
    - "divisors": theta_i / divisors[i], llama.cpp's `rope_freqs.weight` (how its converter
      stores Llama 3.1 scaling in a GGUF file: per-frequency factors, no type key).
    """

    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None  # llama3, yarn
    max_position_embeddings: int | None = None  # dynamic: the length where the base starts to grow
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn: round the ramp's ends to whole dimensions
    divisors: tuple[float, ...] | None = None  # divisors: one per frequency (E/2)

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"expected rope_type to be one of {', '.join(ROPE_TYPES)}, got {self.rope_type!r}")
        if not (math.isfinite(self.factor) and self.factor > 0):
            raise ValueError(f"expected a finite rope scaling factor > 0, got {self.factor!r}")
        if self.rope_type in ("llama3", "yarn") and not self.original_max_position_embeddings:
            raise ValueError(f"rope_type {self.rope_type!r} needs original_max_position_embeddings")
        if self.rope_type == "dynamic" and not self.max_position_embeddings:
            raise ValueError("rope_type 'dynamic' needs max_position_embeddings")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"expected high_freq_factor > low_freq_factor for llama3 rope scaling, got "
                f"{self.high_freq_factor} and {self.low_freq_factor}"
            )
        if self.rope_type == "divisors" and not self.divisors:
            raise ValueError("rope_type 'divisors' needs one divisor per frequency")

    @property
    def is_dynamic(self) -> bool:
        """Whether the frequencies depend on the sequence length."""
        return self.rope_type == "dynamic"

    def attention_scaling(self) -> float:
        """The factor transformers multiplies cos and sin by (1 except for yarn)."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)

        def get_mscale(scale: float, mscale: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return float(get_mscale(self.factor, self.mscale) / get_mscale(self.factor, self.mscale_all_dim))
        return get_mscale(self.factor)


def rope_frequencies(
    head_dim: int,
    base: float,
    scaling: RopeScaling | None = None,
    *,
    seq_len: int | None = None,
    dtype: np.dtype | type = np.float32,
) -> np.ndarray:
    """Inverse frequencies theta_i (E/2,) of rotary embeddings, scaled as `scaling` says.

    In float32 the operations are transformers' own, one by one and in the same order
    (torch's `scalar / tensor` is `reciprocal(tensor) * scalar`, and is written so here), so
    the result equals `ROPE_INIT_FUNCTIONS[rope_type](config)` bit for bit; in float64 the
    same formulas give the reference.

    Arguments:
        head_dim: E (even).
        base: `rope_theta`.
        scaling: None or a `RopeScaling`.
        seq_len: the current sequence length (max position + 1), for "dynamic" only.
        dtype: float32 (what models use) or float64.
    """
    scaling = scaling or RopeScaling()
    dt = np.dtype(dtype)
    dim = int(head_dim)
    exponents = np.arange(0, dim, 2).astype(dt) / dim  # (E/2,) 2i/E
    kind = scaling.rope_type
    if kind == "dynamic" and seq_len is not None and seq_len > scaling.max_position_embeddings:
        # transformers' forward-time update, on tensors (float32 throughout)
        grown = np.asarray(scaling.factor * np.asarray(seq_len, dt) / scaling.max_position_embeddings, dt)
        grown = np.asarray(grown - (scaling.factor - 1), dt) ** (dim / (dim - 2))
        base_now = np.asarray(base * grown, dt)
        return (1 / (base_now**exponents)).astype(dt)
    inv_freq = (1 / (dt.type(base) ** exponents)).astype(dt)  # theta_i = base^(-2i/E)
    if kind == "linear":
        inv_freq = inv_freq / scaling.factor
    elif kind == "llama3":
        old = scaling.original_max_position_embeddings
        low_wavelen = old / scaling.low_freq_factor
        high_wavelen = old / scaling.high_freq_factor
        wavelen = (1 / inv_freq) * (2 * math.pi)
        scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = ((1 / wavelen) * old - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled)
    elif kind == "yarn":
        inv_freq = _yarn_frequencies(dim, base, scaling, dt)
    elif kind == "divisors":
        divisors = np.asarray(scaling.divisors, dtype=dt)
        if divisors.shape != inv_freq.shape:
            raise ValueError(f"expected {len(inv_freq)} rope divisors (head_dim / 2), got {divisors.shape[0]}")
        inv_freq = inv_freq / divisors
    return np.asarray(inv_freq, dtype=dt)


def _yarn_frequencies(dim: int, base: float, scaling: RopeScaling, dt: np.dtype) -> np.ndarray:
    """YaRN (Peng et al. 2023) as transformers' `_compute_yarn_parameters` computes it."""
    factor = scaling.factor
    original = scaling.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = dt.type(base) ** (np.arange(0, dim, 2).astype(dt) / dim)  # base^(2i/E)
    extrapolation = 1 / pos_freqs
    interpolation = 1 / (factor * pos_freqs)
    ramp = np.clip((np.arange(dim // 2, dtype=dt) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: original frequency, 0: interpolated
    return interpolation * (1 - keep) + extrapolation * keep
