"""The fused float32 loops of Q5_0, Q4_K and Q6_K against the path they replaced, in one process.

Before, a decode product of those types dequantized each row of W into a float32 scratch
row (`_dequantize_row`), then summed its products with x; now `_matvec_rows` sends them to
`_matvec_q5_0` / `_matvec_q4_k` / `_matvec_q6_k`, which make each row's weights block by
block and multiply at once. This script compiles the old loop (kept here, `old_rows`) in
the same namespace as the package's loops, takes Gemma 3 270M's matrices of each type and
shape from its GGUF, and times both on one row of x, alternating, best of `--repeat`;
one thread.

    python benchmarks/gemma3_products.py --repeat 200
"""

from __future__ import annotations

import argparse
import time
from types import FunctionType

import numpy as np

from attnkit import kernels
from attnkit.models import gemma3_gguf_path
from attnkit.models.gguf import GGUFFile
from attnkit.quant import GGMLType
from attnkit.quant.products import half_table
from attnkit.quant.compiled import compiled

SHAPES = [("ffn_gate", "Q5_0"), ("attn_q", "Q5_0"), ("attn_output", "Q4_K"), ("ffn_down", "Q4_K"),
          ("ffn_down", "Q6_K")]


def old_rows(raw, values, code, half, x, out, first, stop):  # pragma: no cover - compiled
    """The loop before: each row dequantized into a scratch row, then summed with x."""
    n, columns = x.shape[0], x.shape[1]
    row = np.empty(columns, np.float32)
    for r in range(first, stop):
        _dequantize_row(raw, values, r, code, half, row)  # noqa: F821 - the package's loop
        for i in range(n):
            s = np.float32(0.0)
            for k in range(columns):
                s += row[k] * x[i, k]
            out[i, r] = s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    nb = kernels.numba()
    loops = compiled().loops
    namespace = {"np": np, "_dequantize_row": loops["_dequantize_row"]}
    old = nb.njit(fastmath={"reassoc", "contract", "nsz"}, nogil=True)(
        FunctionType(old_rows.__code__, namespace, "old_rows"))
    new = loops["_matvec_rows"]
    half = half_table()
    gguf = GGUFFile(gemma3_gguf_path())
    rng = np.random.default_rng(0)
    print("| matrix | type | rows x K | before | after | speed-up | after, GMAC/s | max abs difference |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for part, kind in SHAPES:
        name = next(n for n, info in gguf.tensor_infos.items() if n.endswith(part + ".weight") and info.dtype == kind)
        raw = np.ascontiguousarray(gguf.raw(name))
        rows, K = raw.shape[0], gguf.tensor_infos[name].shape[1]
        code = int(GGMLType[kind])
        x = rng.standard_normal((1, K)).astype(np.float32)
        out_old, out_new = np.empty((1, rows), np.float32), np.empty((1, rows), np.float32)
        times = {"old": [], "new": []}
        for _ in range(args.repeat):
            for label, fn, out in (("old", old, out_old), ("new", new, out_new)):
                start = time.perf_counter()
                fn(raw, raw.view(np.int8), code, half, x, out, 0, rows)
                times[label].append(time.perf_counter() - start)
        before, after = min(times["old"]), min(times["new"])
        print(f"| {part} | {kind} | {rows} x {K} | {before * 1e6:.0f} µs | {after * 1e6:.0f} µs | "
              f"{before / after:.2f}x | {rows * K / after / 1e9:.1f} | {np.abs(out_old - out_new).max():.2g} |")


if __name__ == "__main__":
    main()
