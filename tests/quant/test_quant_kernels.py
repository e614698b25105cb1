"""Products on GGUF blocks (attnkit.quant and its layers) against their oracles.

- The NumPy reference `dequantize` against the gguf package's `gguf.quants.dequantize`,
  value for value, for every type, on random blocks and adversarial ones (zero, huge, tiny,
  infinite scales).
- The compiled dequantizer against the reference: each value within one float32 rounding of
  the block's largest (a fused multiply-add may round d*q + m once where NumPy rounds twice).
- Products, compiled (decode and prefill) and reference, against the float64 product of the
  dequantized weights. The budget: the float32 BLAS product of the same dequantized weights
  errs by some e_ref; attnkit's error may be 2 e_ref plus one float32 rounding of |W| @ |x|
  (both sum K float32 terms, in different orders; the kernel scales a block once instead of
  each weight, which moves each term by at most one rounding).
- Threads: 1 and 2 threads give the same bits (rows are split, never a sum).
- The model: SmolLM2 on its blocks against the dequantized float32 model (slow), logits
  within the same 2x rule against the float64 model, and the same 128 greedy tokens.
"""

from __future__ import annotations

import numpy as np
import pytest

from attnkit import kernels
from attnkit import quant
from attnkit.quant import compiled as quant_compiled, ir as quant_ir
from attnkit.quant.reference import TILE_VALUES
from attnkit.runtime import blas_threads

TYPES = [kind.name for kind in quant.GGMLType]
SCALE_BYTES = {  # where each block keeps its float16 scales (and minimums)
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2],
    "Q6_K": [208],
}
U = 2.0 ** -24  # one float32 rounding


def random_blocks(kind: str, rows: int, columns: int, rng, scales=None) -> np.ndarray:
    """(rows, bytes) random blocks of `kind`; block scales drawn from `scales(shape)` (float16),
    default N(0, 0.01); F32/F16/BF16 rows of N(0, 1) values."""
    if kind == "F32":
        return rng.standard_normal((rows, columns)).astype(np.float32).view(np.uint8)
    if kind == "F16":
        return rng.standard_normal((rows, columns)).astype(np.float16).view(np.uint8)
    if kind == "BF16":
        bits = rng.standard_normal((rows, columns)).astype(np.float32).view(np.uint32) >> 16
        return bits.astype(np.uint16).view(np.uint8)
    raw = rng.integers(0, 256, (rows, quant.row_bytes(kind, columns)), dtype=np.uint8)
    size = quant.GGMLType[kind].type_size
    blocks = raw.reshape(rows, -1, size)
    for at in SCALE_BYTES[kind]:
        values = (scales or (lambda shape: rng.standard_normal(shape) * 0.01))(blocks.shape[:2])
        blocks[..., at:at + 2] = np.asarray(values, np.float16).view(np.uint8).reshape(*blocks.shape[:2], 2)
    return raw


def oracle(raw: np.ndarray, kind: str, columns: int) -> np.ndarray:
    import gguf
    from gguf.quants import dequantize

    return np.asarray(dequantize(raw, gguf.GGMLQuantizationType[kind]), np.float32).reshape(raw.shape[0], columns)


def columns_of(kind: str) -> int:
    return 512 if quant.GGMLType[kind].block_size == 256 else 96  # two K-quant blocks, three small ones


def compiled_or_skip() -> None:
    if not kernels.enabled():
        pytest.skip(f"compiled kernels are off ({kernels.reason_disabled()}); the reference is tested above")


@pytest.mark.parametrize("kind", TYPES)
def test_reference_dequantize_is_ggufs(kind, gguf):
    rng = np.random.default_rng(0)
    K = columns_of(kind)
    for rows in (1, 3, 8):
        raw = random_blocks(kind, rows, K, rng)
        ours = quant.dequantize(raw, kind, K)
        assert ours.dtype == np.float32 and ours.shape == (rows, K)
        np.testing.assert_array_equal(ours, oracle(raw, kind, K))


ADVERSARIAL = {
    "zero": lambda shape: np.zeros(shape),
    "largest": lambda shape: np.full(shape, 65504.0),
    "subnormal": lambda shape: np.full(shape, 2.0 ** -24),
    "mixed": lambda shape: np.where(np.arange(np.prod(shape)).reshape(shape) % 2, 65504.0, -(2.0 ** -20)),
    "infinite": lambda shape: np.where(np.arange(np.prod(shape)).reshape(shape) % 3 == 0, np.inf, 1.0),
}


@pytest.mark.parametrize("case", list(ADVERSARIAL))
@pytest.mark.parametrize("kind", [k for k in TYPES if k in SCALE_BYTES])
def test_adversarial_scales(kind, case, gguf):
    """Zero, the largest and the smallest float16 scales, and infinite ones: reference and
    compiled dequantizers as gguf's (inf and NaN where gguf has them), products as the
    float32 product of gguf's weights where that is finite."""
    rng = np.random.default_rng(1)
    K = columns_of(kind)
    raw = random_blocks(kind, 5, K, rng, scales=ADVERSARIAL[case])
    with np.errstate(all="ignore"):
        expected = oracle(raw, kind, K)
        np.testing.assert_array_equal(quant.dequantize(raw, kind, K), expected)
        if case == "zero" and kind not in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"):  # no minimum: all zero
            assert not expected.any()
        if kernels.enabled():
            compiled = quant.dequantize_compiled(raw, kind, K)
            assert np.array_equal(np.isnan(compiled), np.isnan(expected))
            finite = np.isfinite(expected)
            assert np.array_equal(compiled[~finite], expected[~finite], equal_nan=True)
            bound = 2 * U * np.abs(np.where(finite, expected, 0)).max(axis=1, keepdims=True)
            assert (np.abs(compiled[finite] - expected[finite]) <= np.broadcast_to(bound, expected.shape)[finite]).all()
            x = rng.standard_normal((1, K)).astype(np.float32)
            y = quant.matmul(x, raw, kind, K)
            reference = x @ expected.T
            both = np.isfinite(reference)
            assert np.array_equal(np.isnan(y[~both]), np.isnan(reference[~both]))
            if case == "zero":
                assert np.array_equal(y, reference)


@pytest.mark.parametrize("kind", TYPES)
def test_compiled_dequantize_within_one_rounding(kind, gguf):
    compiled_or_skip()
    rng = np.random.default_rng(2)
    K = columns_of(kind)
    raw = random_blocks(kind, 7, K, rng)
    expected = oracle(raw, kind, K)
    got = quant.dequantize_compiled(raw, kind, K)
    bound = 2 * U * np.abs(expected).max(axis=1, keepdims=True)
    assert (np.abs(got - expected) <= bound).all(), np.abs(got - expected).max()


def check_product(y: np.ndarray, x: np.ndarray, weights: np.ndarray, what: str) -> None:
    """attnkit's y = x @ W.T against the float64 truth: within 2x the float32 BLAS error plus
    one float32 rounding of |W| @ |x| (the module docstring's budget)."""
    truth = x.astype(np.float64) @ weights.astype(np.float64).T
    reference_error = np.abs((x @ weights.T) - truth).max()
    allowed = 2 * reference_error + U * (np.abs(x).astype(np.float64) @ np.abs(weights).astype(np.float64).T)
    error = np.abs(y - truth)
    print(f"{what}: max error {error.max():.3g}, reference {reference_error:.3g}, "
          f"{'OK' if (error <= allowed).all() else 'NOT OK'}")
    assert y.dtype == np.float32
    assert (error <= allowed).all(), f"{what}: error {error.max():.3g} over the budget (reference {reference_error:.3g})"


@pytest.mark.parametrize("compiled", [False, True], ids=["reference", "compiled"])
@pytest.mark.parametrize("kind", TYPES)
def test_products_within_budget(kind, compiled, gguf):
    if compiled:
        compiled_or_skip()
    rng = np.random.default_rng(3)
    K = columns_of(kind)
    for rows in (1, 2, 7, 33):  # odd counts: the two-row loops' last row alone
        raw = random_blocks(kind, rows, K, rng)
        weights = oracle(raw, kind, K)
        for n in (1, 3, quant.DECODE_ROWS + 3):  # decode (fused loops) and prefill (tiles + BLAS)
            x = rng.standard_normal((n, K)).astype(np.float32)
            y = quant.matmul(x, raw, kind, K, compiled=compiled)
            assert y.shape == (n, rows)
            check_product(y, x, weights, f"{kind} {rows}x{K}, {n} rows of x")


@pytest.mark.parametrize("kind", ["Q5_0", "Q4_K", "Q6_K"])
def test_four_row_float32_loops_of_q5_0_and_k_quants(kind, gguf):
    """Q5_0, Q4_K and Q6_K on float32 x have four-row IR loops of their own (`_matvec_q5_0`,
    `_matvec_k`); called directly on a row range (5 rows: a short last group), they give the
    product of the dequantized weights within the budget, and write only their rows."""
    compiled_or_skip()
    loops = quant_compiled.compiled().loops
    rng = np.random.default_rng(11)
    K = 2 * columns_of(kind)
    raw = random_blocks(kind, 9, K, rng)
    weights = oracle(raw, kind, K)
    x = rng.standard_normal((3, K)).astype(np.float32)
    out = np.full((3, 9), -7.0, np.float32)
    if kind == "Q5_0":
        loops["_matvec_q5_0"](raw, x, out, 2, 7)
    else:
        loops["_matvec_k"](raw, int(quant.GGMLType[kind]), x, out, 2, 7)
    check_product(out[:, 2:7], x, weights[2:7], f"{kind} four-row loop, rows 2..6")
    assert (out[:, :2] == -7.0).all() and (out[:, 7:] == -7.0).all()


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q6_K"])
def test_two_threads_give_the_same_bits(kind, gguf):
    compiled_or_skip()
    rng = np.random.default_rng(4)
    K = columns_of(kind) * 4
    rows = quant.PARALLEL_MACS // K + 9  # over the size that splits rows
    raw = random_blocks(kind, rows, K, rng)
    for n in (1, quant.DECODE_ROWS + 1):
        x = rng.standard_normal((n, K)).astype(np.float32)
        with blas_threads(1):
            one = quant.matmul(x, raw, kind, K)
        with blas_threads(2):
            two = quant.matmul(x, raw, kind, K)
        if n == 1:
            np.testing.assert_array_equal(one, two)
        else:  # BLAS may split its sums differently with more threads
            check_product(two, x, oracle(raw, kind, K), f"{kind} prefill, 2 threads")


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q6_K"])
def test_prefill_tiles_claimed_by_worker_threads(kind, gguf, monkeypatch):
    """A prefill product under `worker_threads(n)` with BLAS on one thread: the tiles (each
    thread's own scratch, more of them than threads, evenly sized) are claimed by n threads,
    every output column written once and within the float32 rule of the float64 product;
    with BLAS on more threads the calling thread runs the tiles alone."""
    import threading

    from attnkit import runtime
    from attnkit.runtime import worker_threads

    compiled_or_skip()
    rng = np.random.default_rng(5)
    K = columns_of(kind) * 2
    raw = random_blocks(kind, TILE_VALUES // K * 3 + 5, K, rng)  # 4 tiles at one thread
    x = rng.standard_normal((quant.DECODE_ROWS + 5, K)).astype(np.float32)
    calls = []
    claimed = runtime.run_claimed

    def recorded(count, fn, threads):
        calls.append((count, threads))
        ran = []
        claimed(count, lambda i: (ran.append(threading.get_ident()), fn(i)), threads)
        calls.append(len(set(ran)))

    monkeypatch.setattr(runtime, "run_claimed", recorded)
    for n in (1, 2, 3):
        calls.clear()
        with blas_threads(1), worker_threads(n):
            y = quant.matmul_stack(x, [(raw, kind), (raw[::-1], kind)], K)
        (count, threads), used = calls
        assert threads == n and count % n == 0 and count >= 4, (count, threads)
        assert 1 <= used <= n
        assert not np.isnan(y).any()
        check_product(y[:, :raw.shape[0]], x, oracle(raw, kind, K), f"{kind} prefill on {n} worker threads")
        check_product(y[:, raw.shape[0]:], x, oracle(raw[::-1], kind, K), f"{kind} prefill, second part")
    calls.clear()
    with blas_threads(2), worker_threads(2):
        quant.matmul_stack(x, [(raw, kind)], K)
        blas_split = runtime.blas_thread_count() > 1  # (a BLAS built single-threaded stays at one)
    assert calls[0][1] == (1 if blas_split else 2)


def test_bad_arguments_are_refused():
    raw = np.zeros((2, 20), np.uint8)
    with pytest.raises(ValueError, match="expected a GGML type of"):
        quant.matmul(np.zeros((1, 32), np.float32), raw, "Q3_K", 32)
    with pytest.raises(ValueError, match=r"expected 40 bytes per row for 64 Q4_1 values, got 20"):
        quant.matmul(np.zeros((1, 64), np.float32), raw, "Q4_1", 64)
    with pytest.raises(ValueError, match=r"expected x of shape \(N, 32\), got \(1, 16\)"):
        quant.matmul(np.zeros((1, 16), np.float32), raw, "Q4_1", 32)
    with pytest.raises(ValueError, match="multiple of 32 for Q4_1, got 40"):
        quant.row_bytes("Q4_1", 40)


# ----------------------------------------------------------------------------- 8-bit activations


def activation_error(x: np.ndarray, dx: np.ndarray) -> np.ndarray:
    """The bound on |x - dx q| that `quantize_activations` promises, per value: half a step,
    plus what the float32 rounding (or underflow) of dx leaves above 127 steps."""
    amax = np.abs(x.astype(np.float64)).reshape(x.shape[0], -1, 32).max(axis=2)  # (N, blocks)
    step = dx.astype(np.float64)
    per_block = step / 2 + np.maximum(0.0, amax - 127 * step)
    return np.repeat(per_block, 32, axis=1)  # (N, K)


def minimums(raw: np.ndarray, kind: str, columns: int) -> np.ndarray:
    """|m| of each weight's block, (R, K) float64 (zero for the types without one)."""
    if kind != "Q4_1":
        return np.zeros((raw.shape[0], columns))
    m = np.ascontiguousarray(raw.reshape(raw.shape[0], -1, 20)[..., 2:4]).view(np.float16)[..., 0]
    return np.repeat(np.abs(m.astype(np.float64)), 32, axis=1)


def check_int8_product(y: np.ndarray, x: np.ndarray, raw: np.ndarray, kind: str, what: str) -> None:
    """The int8 products' budget (docs/kernels.md), element by element, against the float64
    truth W @ x:

        |y - truth| <= 2 e_ref + (|W| + |M|) @ eps + (B + 4) u (|W| + |M|) @ (|x| + eps)

    eps: `activation_error` (x's 8-bit rounding, met by the whole weight, the minimum M
    included); the last term: the float32 roundings of the B block terms
    d dx I + m xs and of their sum (I is an exact integer); e_ref: the float32 BLAS error."""
    K = x.shape[1]
    weights = oracle(raw, kind, K).astype(np.float64)
    truth = x.astype(np.float64) @ weights.T
    reference_error = np.abs(x @ weights.astype(np.float32).T - truth).max()
    _, dx, _ = quant.quantize_activations(x)
    eps = activation_error(x, dx)
    size = np.abs(weights) + minimums(raw, kind, K)  # (R, K)
    allowed = 2 * reference_error + eps @ size.T + (K // 32 + 4) * U * ((np.abs(x) + eps) @ size.T)
    error = np.abs(y - truth)
    print(f"{what}: max error {error.max():.3g} ({(error / allowed).max():.2f} of the budget)")
    assert y.dtype == np.float32
    assert (error <= allowed).all(), f"{what}: error {error.max():.3g} over the budget"


def test_quantize_activations_reference_and_compiled():
    """q within [-127, 127], |x - dx q| within `activation_error`, the compiled quantizer
    bit for bit the NumPy one, on normal, huge, tiny (subnormal: dx underflows) and zero
    blocks; a block with inf or NaN gets dx NaN and q 0."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((3, 32 * 6)).astype(np.float32)
    x[0, 32:64] *= np.float32(1e30)
    x[1, 64:96] = rng.standard_normal(32).astype(np.float32) * np.float32(1e-42)
    x[1, 96:128] = 0.0
    x[2, 128] = np.inf
    x[2, 160] = np.nan
    q, dx, xs = quant.quantize_activations(x)
    assert q.dtype == np.int8 and q.shape == x.shape and np.abs(q.astype(int)).max() <= 127
    assert np.isnan(dx[2, 4:]).all() and not q[2, 128:].any()
    finite = np.repeat(np.isfinite(dx), 32, axis=1)
    restored = np.repeat(dx.astype(np.float64), 32, axis=1) * q
    assert (np.abs(restored - x)[finite] <= activation_error(x, dx)[finite]).all()
    sums = (dx.astype(np.float64) * q.reshape(3, -1, 32).astype(np.float64).sum(axis=2)).astype(np.float32)
    np.testing.assert_array_equal(xs, sums)  # the 8-bit values' block sums (llama.cpp's Q8_1 s)
    if kernels.enabled():
        out = (np.empty_like(q), np.empty_like(dx), np.empty_like(xs), np.empty(dx.shape, np.int32))
        quant_compiled.compiled().loops["_quantize_x"](x, x.view(np.uint32), *out)
        np.testing.assert_array_equal(out[0], q)
        np.testing.assert_array_equal(out[1], dx)
        np.testing.assert_array_equal(out[3], q.reshape(3, -1, 32).astype(np.int32).sum(axis=2))
        np.testing.assert_array_equal(out[2], xs)


@pytest.mark.parametrize("kind", quant.INT8_TYPES)
def test_int8_products_within_their_budget(kind, gguf):
    """Decode products on 8-bit activations (`quant.activations("int8")`), random blocks and
    x with a wide range of magnitudes (so blocks have outliers), against the float64 truth;
    the kernel against `matmul_int8_reference` (what it computes, in float64) within float32
    roundings; and 1 and 2 threads give the same bits."""
    compiled_or_skip()
    rng = np.random.default_rng(7)
    K = 96 * 4
    for rows in (1, 2, 5, 7, 33):  # the four-row loops' short last group
        raw = random_blocks(kind, rows, K, rng)
        for n in (1, 3):
            x = (rng.standard_normal((n, K)) * np.exp(2 * rng.standard_normal((n, K)))).astype(np.float32)
            with quant.activations("int8"):
                y = quant.matmul(x, raw, kind, K)
            check_int8_product(y, x, raw, kind, f"{kind} {rows}x{K}, {n} rows of x, int8")
            exact = quant.matmul_int8_reference(x, raw, kind, K)
            size = (np.abs(x) + 1) @ (np.abs(oracle(raw, kind, K).astype(np.float64)) + minimums(raw, kind, K)).T
            assert (np.abs(y - exact) <= (K // 32 + 4) * U * size).all()
    raw = random_blocks(kind, quant.PARALLEL_MACS // K + 9, K, rng)
    x = rng.standard_normal((1, K)).astype(np.float32)
    with quant.activations("int8"):
        with blas_threads(1):
            one = quant.matmul(x, raw, kind, K)
        with blas_threads(2):
            two = quant.matmul(x, raw, kind, K)
    np.testing.assert_array_equal(one, two)


def test_int8_block_dots_on_every_instruction_set(gguf):
    """The IR loops' three ways to a block's dot product (AVX-512 VNNI, AVX2, LLVM's generic
    lowering), each the host can run, give the same sums, within float32 roundings of the
    float64 `matmul_int8_reference` (another CPU takes another branch: all are checked here)."""
    compiled_or_skip()
    nb = kernels.numba()
    available = ["generic"] + [dot for dot in ("avx2", "vnni") if dot == quant_ir.dot_instructions()
                               or (dot == "avx2" and quant_ir.dot_instructions() == "vnni")]
    rng = np.random.default_rng(9)
    K = 32 * 6
    for kind in quant.INT8_TYPES:
        raw = random_blocks(kind, 9, K, rng)
        x = (rng.standard_normal((1, K)) * np.exp(rng.standard_normal((1, K)))).astype(np.float32)
        q, dx, xs = quant.quantize_activations(x)
        qsum = q.reshape(1, -1, 32).astype(np.int32).sum(axis=2)
        exact = quant.matmul_int8_reference(x, raw, kind, K)[0]
        size = ((np.abs(x) + 1) @ (np.abs(oracle(raw, kind, K).astype(np.float64)) + minimums(raw, kind, K)).T)[0]
        sums = {}
        for dot in available:
            rows4 = quant_ir.rows4_intrinsic(quant.GGMLType[kind.upper()], dot)

            @nb.njit
            def run(raw, q, dx, xs, qsum, rows4=rows4):
                out = np.empty(raw.shape[0], np.float32)
                for r0 in range(0, raw.shape[0], 4):
                    r1, r2, r3 = min(r0 + 1, raw.shape[0] - 1), min(r0 + 2, raw.shape[0] - 1), min(r0 + 3, raw.shape[0] - 1)
                    out[r0], out[r1], out[r2], out[r3] = rows4(raw, r0, r1, r2, r3, q, dx, xs, qsum)
                return out

            sums[dot] = run(raw, q[0], dx[0], xs[0], qsum[0])
            assert (np.abs(sums[dot] - exact) <= (K // 32 + 4) * U * size).all(), (kind, dot)
        for dot in available[1:]:
            np.testing.assert_allclose(sums[dot], sums["generic"], rtol=0, atol=(K // 32 + 4) * U * size.max())


def test_int8_activations_leave_other_paths_alone(gguf):
    """Prefill, the other types and the NumPy reference ignore the setting; the default is
    float32; a wrong name is refused."""
    rng = np.random.default_rng(8)
    K = 64
    raw = random_blocks("Q4_1", 5, K, rng)
    x = rng.standard_normal((quant.DECODE_ROWS + 1, K)).astype(np.float32)
    with quant.activations("int8"):
        np.testing.assert_array_equal(quant.matmul(x, raw, "Q4_1", K, compiled=False),
                                      quant.matmul_reference(x, raw, "Q4_1", K))
        prefill = quant.matmul(x, raw, "Q4_1", K)
    check_product(prefill, x, oracle(raw, "Q4_1", K), "Q4_1 prefill under int8")
    if kernels.enabled():
        check_product(quant.matmul(x[:1], raw, "Q4_1", K), x[:1], oracle(raw, "Q4_1", K), "Q4_1 decode, default")
    with pytest.raises(ValueError, match='expected activations "int8" or "float32", got \'int4\''):
        with quant.activations("int4"):
            pass


# ----------------------------------------------------------------------------- modules


def test_quantized_tensor_rows_products_and_order(gguf):
    from attnkit.models.quantized import QuantizedLinear, QuantizedTensor

    rng = np.random.default_rng(5)
    raw = random_blocks("Q4_1", 6, 64, rng)
    weights = oracle(raw, "Q4_1", 64)
    order = np.array([3, 0, 5, 1, 4, 2])
    tensor = QuantizedTensor(raw, "Q4_1", 64, row_order=order)
    np.testing.assert_array_equal(tensor.dequantize(), weights[order])
    np.testing.assert_array_equal(tensor[np.array([[1, 2], [0, 0]])], weights[order][[[1, 2], [0, 0]]])
    x = rng.standard_normal((2, 3, 64)).astype(np.float32)
    check_product((x @ tensor.T).reshape(6, 6), x.reshape(6, 64), weights[order], "row_order")
    bias = rng.standard_normal(6).astype(np.float32)
    layer = QuantizedLinear(tensor, bias)
    check_product((layer(x) - bias).reshape(6, 6), x.reshape(6, 64), weights[order], "QuantizedLinear")
    np.testing.assert_array_equal(layer.weight, weights[order])
    assert [name for name, _ in layer.named_parameters()] == ["bias"]
    with pytest.raises(ValueError, match="permutation"):
        QuantizedTensor(raw, "Q4_1", 64, row_order=np.zeros(6, int))


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, gguf):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: the shared helpers
    from tiny_checkpoints import write_tiny_llama_gguf

    path = tmp_path_factory.mktemp("quant") / "tiny.gguf"
    write_tiny_llama_gguf(path)
    return path


def test_tiny_model_on_its_blocks_matches_the_dequantized_model(tiny_gguf):
    """Q8_0, Q4_1, F16 and F32 matrices, permuted query/key rows: logits within the 2x rule of
    the float32 model against the float64 model, the same greedy tokens, the same structure."""
    from attnkit.models.llama import LlamaForCausalLM
    from attnkit.models.quantized import QuantizedCausalSelfAttention, QuantizedSwiGLU

    blocks = LlamaForCausalLM.from_gguf(tiny_gguf, quantized=True)
    reference = LlamaForCausalLM.from_gguf(tiny_gguf, quantized=False)
    assert isinstance(blocks.layers[0].attn, QuantizedCausalSelfAttention)
    assert isinstance(blocks.layers[0].mlp, QuantizedSwiGLU)
    assert set(dict(blocks.named_modules())) == set(dict(reference.named_modules()))
    assert set(vars(blocks)) == set(vars(reference)), "the quantized model lacks what __init__ sets"
    ids = np.array([[1, 5, 40, 80, 120, 160, 200, 7, 9, 11, 13, 17, 19]])
    truth = LlamaForCausalLM.from_gguf(tiny_gguf, quantized=False).astype(np.float64)(ids)
    reference_error = np.abs(reference(ids) - truth).max()
    for last in (1, ids.shape[1]):  # a decode-sized product and a prefill-sized one
        error = np.abs(blocks(ids[:, :last]) - truth[:, :last]).max()
        assert error <= 2 * reference_error + U * np.abs(truth).max() * 64, (error, reference_error)
    np.testing.assert_array_equal(blocks.generate(ids[0], 16, stop=()), reference.generate(ids[0], 16, stop=()))


@pytest.mark.slow
def test_smollm2_on_its_blocks_decodes_as_the_dequantized_model(smollm2_file, gguf):
    """The decoder bench's prompt: logits within the 2x rule (float64 model as truth), the same
    128 greedy tokens as the dequantized float32 model."""
    from attnkit.bench.decoder import PROMPT
    from attnkit.models.llama import LlamaForCausalLM

    blocks = LlamaForCausalLM.from_gguf(smollm2_file, quantized=True)
    reference = LlamaForCausalLM.from_gguf(smollm2_file, quantized=False)
    ids = np.array(blocks.tokenizer.encode(PROMPT))
    truth = reference.astype(np.float64)(ids[None])[0]
    reference.astype(np.float32)
    reference_error = np.abs(reference(ids[None])[0] - truth).max()
    error = np.abs(blocks(ids[None])[0] - truth).max()
    print(f"SmolLM2 logits: blocks {error:.3g}, float32 reference {reference_error:.3g} (float64 truth)")
    assert error <= 2 * reference_error + U * np.abs(truth).max(), (error, reference_error)
    np.testing.assert_array_equal(blocks.generate(ids, 128, stop=()), reference.generate(ids, 128, stop=()))


def test_tiny_model_on_its_blocks_in_float64_is_the_float64_model(tiny_gguf):
    """`astype(np.float64)` on a model on blocks: float64 logits, those of the float64
    dequantized model up to float64 roundings."""
    from attnkit.models.llama import LlamaForCausalLM

    ids = np.array([[1, 5, 40, 80, 120, 160, 200, 7, 9, 11, 13]])
    blocks = LlamaForCausalLM.from_gguf(tiny_gguf, quantized=True).astype(np.float64)
    truth = LlamaForCausalLM.from_gguf(tiny_gguf, quantized=False).astype(np.float64)(ids)
    got = blocks(ids)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, truth, rtol=0, atol=1e-12 * np.abs(truth).max())
    blocks.astype(np.float32)
    assert blocks(ids).dtype == np.float32


# ----------------------------------------------------------------------------- the bench's lines


def test_bench_goal_lines_against_llama_cpp():
    """`attnkit bench decoder`'s rows and goal lines for prefill, load and memory, computed from
    what was measured (a result without them, as before llama.cpp was measured, gives none)."""
    from attnkit.bench import decoder

    result = {
        "threads": 1, "tokens_per_second": {"attnkit": 40.0, "transformers": 20.0, "llama.cpp": 50.0,
                                            "attnkit int8": 60.0},
        "decode_tokens_per_second": 42.0, "ratio": 2.0, "ratio_paired_median": 2.0, "llama_cpp_ratio": 0.8,
        "llama_cpp_ratio_int8": 1.2,
        "times_s": {"attnkit": [3.2], "transformers": [6.4], "llama.cpp": [2.56]}, "bandwidth_gb_s": [10.0],
        "bound_tokens_per_second": 100.0, "bound_fraction": 0.42, "same_tokens": True, "llama_cpp": "installed",
        "prefill_s": {"attnkit": 0.5, "llama.cpp": 0.6},
        "footprint": {"attnkit": {"load_s": 0.4, "generate_s": 3.0, "added_bytes": 150e6},
                      "llama.cpp": {"load_s": 0.3, "generate_s": 2.5, "added_bytes": 120e6}},
    }
    raw = {"prompt_tokens": 50, "new_tokens": 128, "threads": [1], "weight_bytes": 98e6, "probe_bytes": 2**28,
           "results": [result], "load_s": {"attnkit": 0.4, "transformers": 9.0}, "per_token": [],
           "cpu_model": "Some CPU", "blas": "openblas", "file_bytes": 100e6, "quantized": True}
    goals = decoder.report_from_raw(raw).goals
    expected = {
        "prefill of 256 tokens >= 0.8x llama.cpp: PASS (1.20x)",
        "decode >= 1.0x llama.cpp, float32 activations (done at 0.8x): FAIL (0.80x; done)",
        "decode >= 1.0x llama.cpp, 8-bit activations (done at 0.8x): PASS (1.20x; done)",
        "load <= 1.0 s: PASS (0.40 s; llama.cpp 0.30 s)",
        "memory added <= 1.5x the file: PASS (1.50x, 150 MB)",
    }
    for line in expected:
        assert any(line in goal for goal in goals), (line, goals)
    del result["prefill_s"], result["footprint"]
    assert all("activations (done at" in goal for goal in decoder.report_from_raw(raw).goals)
    rows = decoder.report_from_raw(raw).rows
    assert any(row[0].startswith("the same, attnkit on 8-bit") and row[3] == 60.0 and row[6] == "1.20x llama.cpp"
               for row in rows)


def test_bench_counts_the_blocks_a_decode_step_reads(tiny_gguf):
    from attnkit.bench.decoder import weight_bytes
    from attnkit.models.llama import LlamaForCausalLM

    blocks = LlamaForCausalLM.from_gguf(tiny_gguf, quantized=True)
    stored = sum(m.quantized.nbytes for _, m in blocks.named_modules() if "quantized" in m.__dict__)
    assert weight_bytes(blocks) == stored + sum(a.nbytes for a in blocks.parameters())
