"""attnkit.nn TransformerBlock and MultiHeadAttention against torch's
TransformerEncoderLayer and MultiheadAttention, float32, same thread count.

Run (benchmarks only): env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/bench_nn.py
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from threadpoolctl import threadpool_info, threadpool_limits

from attnkit import nn


def timeit(fns: dict, repeats: int) -> dict:
    """Interleaved runs (one warm-up each); median seconds per function."""
    for f in fns.values():
        f()
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return {k: float(np.median(v)) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    d_model, heads, d_ff = 384, 12, 1536  # all-MiniLM-L6-v2's layer
    blas = [f"{i['internal_api']} {i.get('architecture')}" for i in threadpool_info() if i["user_api"] == "blas"]
    print(f"BLAS: {', '.join(sorted(set(blas)))}; torch {torch.__version__}")
    print("| threads | B x L | module | attnkit ms | torch ms | attnkit / torch |")
    print("| --- | --- | --- | --- | --- | --- |")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for B, L in [(1, 16), (32, 32), (32, 128)]:
            rng = np.random.default_rng(0)
            x = rng.standard_normal((B, L, d_model), dtype=np.float32)
            key_mask = np.ones((B, L), bool)
            key_mask[B // 2 :, L // 2 :] = False  # half the batch padded to half length
            block = nn.TransformerBlock(d_model, heads, d_ff, activation="gelu", seed=0)
            layer = block.to_torch()
            xt, kpm = torch.from_numpy(x), torch.from_numpy(~key_mask)
            with threadpool_limits(threads), torch.inference_mode():
                t = timeit({
                    "block": lambda: block(x, key_mask=key_mask),
                    "torch block": lambda: layer(xt, src_key_padding_mask=kpm),
                    "mha": lambda: block.attn(x, key_mask=key_mask),
                    "torch mha": lambda: layer.self_attn(xt, xt, xt, key_padding_mask=kpm, need_weights=False),
                }, args.repeats)
            for name in ("block", "mha"):
                ours, theirs = t[name] * 1e3, t[f"torch {name}"] * 1e3
                label = "TransformerBlock (post-LN, gelu)" if name == "block" else "MultiHeadAttention"
                print(f"| {threads} | {B} x {L} | {label} | {ours:.2f} | {theirs:.2f} | {ours / theirs:.2f} |")


if __name__ == "__main__":
    main()
