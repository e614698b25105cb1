"""A module's causal and padded calls on the flash backend: masks as keywords (what
`attnkit.nn` modules pass since 0.2.0) against the dense (L, S) mask they built before.

    python benchmarks/module_masks.py [--length 4096] [--repeats 3]

Prints, for MultiHeadAttention (d_model 512, 8 heads, one sequence) with is_causal=True
and with key padding, the best of `--repeats` times of each route and their ratio, in one
run on the same inputs. With keywords the flash backend skips the tiles above the
diagonal (and past the padding); with a dense mask it must read every tile.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from attnkit import nn
from attnkit.functional.masks import causal_mask


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    L = args.length
    mha = nn.MultiHeadAttention(512, 8, seed=0).set_attention_backend("flash")
    x = np.random.default_rng(0).standard_normal((1, L, 512)).astype(np.float32)
    key_mask = np.ones((1, L), bool)
    key_mask[:, L // 2:] = False  # half the keys are padding
    cases = {
        "causal": (dict(is_causal=True), dict(attn_mask=causal_mask(L, L))),
        "key padding": (dict(key_mask=key_mask), dict(attn_mask=key_mask[:, None, None, :] & np.ones((L, L), bool))),
    }
    print(f"MultiHeadAttention(512, 8) on flash, L = S = {L}, float32, best of {args.repeats}")
    print(f"{'case':<12} {'keywords (s)':>13} {'dense mask (s)':>15} {'speedup':>8}")
    for name, (keywords, dense) in cases.items():
        out = mha(x, **keywords)
        np.testing.assert_allclose(out.output, mha(x, **dense).output, rtol=0, atol=1e-4)
        fast = best(lambda: mha(x, **keywords), args.repeats)
        slow = best(lambda: mha(x, **dense), args.repeats)
        print(f"{name:<12} {fast:>13.3f} {slow:>15.3f} {slow / fast:>7.2f}x")


if __name__ == "__main__":
    main()
