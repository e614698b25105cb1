"""Few-row products over the keys summed in chunks, and softcap capped in float64
(issue 45), against the code they replaced, interleaved in one run.

    python benchmarks/flash_chunked_sums.py [--rounds 11] [--threads 1] [CASE ...]

"before" swaps `precision.matmul_in_chunks` for one `np.matmul` in the modules that
call it (flash's forward and backward, the dense path) and `mods.softcap` for its
float32 form; "now" is the code as it is. Each case runs before/now alternately
(the order flipped every round) and prints both medians, now / before, and the
ratio of the minima. The first case never takes the changed code (the fused tiles
of a full L = 1024 backward): it shows the machine's noise.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import attnkit
from attnkit.functional import attention, mods
from attnkit.functional.flash import backward, forward
from attnkit.functional.precision import matmul_in_chunks


def _one_product(a, b):
    return np.matmul(a, b)


def _use(now: bool) -> None:
    for module in (forward, backward, attention):
        module.matmul_in_chunks = matmul_in_chunks if now else _one_product


def _float32_softcap(cap: float) -> mods.ScoreMod:
    """mods.softcap before issue 45: the tile's own dtype throughout."""

    def fn(score, b, h, q_idx, kv_idx):
        c = score.dtype.type(cap)
        out = np.tanh(score / c)
        out *= c
        return out

    return mods.ScoreMod(fn, mods.softcap(cap).grad, name="float32 softcap")


def _cases(threads: int) -> dict:
    rng = np.random.default_rng(0)

    def arrays(Hq, Hkv, L, S, E):
        def draw(*shape):
            return rng.standard_normal(shape).astype(np.float32)
        return draw(Hq, L, E), draw(Hkv, S, E), draw(Hkv, S, E), draw(Hq, L, E)

    def forward_backward(q, k, v, d_out, **kw):
        state = attnkit.flash_attention(q, k, v, return_lse=True, num_threads=threads,
                                        enable_gqa=q.shape[0] != k.shape[0], **kw)
        attnkit.flash_attention_backward(d_out, q, k, v, state.output, state)

    full = arrays(8, 8, 1024, 1024, 64)
    state = attnkit.flash_attention(*full[:3], return_lse=True, num_threads=threads)
    few = arrays(8, 8, 4, 8192, 128)
    decode = arrays(32, 8, 1, 32768, 128)
    dense = arrays(8, 8, 8, 4096, 64)
    capped = arrays(4, 4, 512, 512, 64)
    caps = {False: _float32_softcap(50.0), True: mods.softcap(50.0)}

    def dense_pair(now):
        q, k, v, d_out = dense
        attnkit.scaled_dot_product_attention(q, k, v)
        attnkit.scaled_dot_product_attention_backward(d_out, q, k, v)

    return {
        "flash backward, L = S = 1024, H = 8, E = 64 (unchanged code)":
            lambda now: attnkit.flash_attention_backward(full[3], *full[:3], state.output, state),
        "flash fwd+bwd, L = 4, S = 8192, H = 8, E = 128, causal":
            lambda now: forward_backward(*few, is_causal=True, causal_align="bottom_right"),
        "flash forward, L = 1, S = 32768, Hq = 32, Hkv = 8, E = 128":
            lambda now: attnkit.flash_attention(*decode[:3], num_threads=threads, enable_gqa=True),
        "dense fwd+bwd, L = 8, S = 4096, H = 8, E = 64": dense_pair,
        "flash fwd+bwd, softcap 50, L = S = 512, H = 4, E = 64":
            lambda now: forward_backward(*capped, score_mod=caps[now]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("cases", nargs="*", help="run only the cases whose name holds one of these")
    args = parser.parse_args()
    for name, run in _cases(args.threads).items():
        if args.cases and not any(part in name for part in args.cases):
            continue
        times = {False: [], True: []}
        for now in (False, True):  # warm up both
            _use(now)
            run(now)
        for i in range(args.rounds):
            for now in ((False, True) if i % 2 == 0 else (True, False)):
                _use(now)
                start = time.perf_counter()
                run(now)
                times[now].append(time.perf_counter() - start)
        before, after = statistics.median(times[False]), statistics.median(times[True])
        print(f"{name}: before {before * 1e3:.1f} ms, now {after * 1e3:.1f} ms, now / before {after / before:.3f}"
              f" (minima {min(times[True]) / min(times[False]):.3f})", flush=True)
    _use(True)


if __name__ == "__main__":
    main()
