"""The cache suite: one decoder attention step through `attnkit.nn.KVCache.attend`,
backend "naive" against "flash".

This is the decoders' own path (`CausalSelfAttention` -> `KVCache.attend` ->
the backend), which hands the backend `is_causal=True,
causal_align="bottom_right"` (and the cache's key padding) instead of a dense
mask, so flash skips the tiles above the diagonal: its band fast path.

SmolLM2-135M-like heads: Hq=9 query heads over Hkv=3 key/value heads (GQA),
E=64, float32, batch 1. Per size: a cache already holding S - L positions
takes L new ones and attends over all S: L=1 is a decode step, L=64 a chunk of
a prefill. Contenders are timed round-robin (the machine may be shared); a row
is the best of the rounds. "naive / flash" is naive's time over flash's
(>= 1: flash is at least as fast). The project's goal (a `goals` line, shown by
`attnkit bench cache --goals`): decoding with flash through the KV cache at
least as fast as naive at context 1024, met when naive / flash >= 0.95 for the
decode step (L=1): flash runs a decode step with the plain kernel (see
`flash_backend`), so the two are equal there and only the timing noise of a
shared machine, a few percent, separates them. The prefill chunk (L=64) is
reported beside it, not part of the goal: there flash runs its tiles, and the
band saves little while L << S.
"""

from __future__ import annotations

from attnkit.bench.report import BenchReport, Progress
from attnkit.bench.measure import best_times_interleaved, blas_summary
from attnkit.deprecation import keyword_only
from attnkit.runtime import cpu_count

Q_HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
FULL_SIZES = tuple((S, L) for S in (256, 1024, 4096) for L in (1, 64))
QUICK_SIZES = ((256, 1), (1024, 1), (1024, 64))
GOAL_CONTEXT = 1024
GOAL_RATIO = 0.95  # naive / flash: "at least as fast", less the timing noise
COLUMNS = ["S", "L", "naive ms", "flash ms", "naive / flash", "max |diff|"]
BACKENDS = ("naive", "flash")


def _step(S: int, L: int, backend: str, rng):
    """A function that runs one step of L new positions over a cache of S, and its inputs' output."""
    import numpy as np

    from attnkit.nn import KVCache

    cache = KVCache(1, 1, KV_HEADS, HEAD_DIM, S)
    past = S - L
    if past:
        cache.update(0, *(rng.standard_normal((2, 1, KV_HEADS, past, HEAD_DIM), dtype=np.float32)))
    q = rng.standard_normal((1, Q_HEADS, L, HEAD_DIM), dtype=np.float32)  # (B, Hq, L, E)
    k, v = rng.standard_normal((2, 1, KV_HEADS, L, HEAD_DIM), dtype=np.float32)  # (B, Hkv, L, E)

    def step():
        cache.crop(past)  # forget the previous step's L positions (no copy)
        return cache.attend(0, q, k, v, backend=backend)  # (B, Hq, L, E)

    return step


@keyword_only("quick", "progress", "threads")
def run(*, quick: bool, progress: Progress, threads: int | None = None) -> BenchReport:
    import numpy as np
    from threadpoolctl import threadpool_limits

    threads = threads or cpu_count()
    sizes = QUICK_SIZES if quick else FULL_SIZES
    progress.total(len(sizes))
    rows, raw = [], {"threads": threads, "sizes": [], "blas": blas_summary()}
    for S, L in sizes:
        progress.step(f"S={S}, L={L}")
        fns = {name: _step(S, L, name, np.random.default_rng(S + L)) for name in BACKENDS}
        with threadpool_limits(threads, user_api="blas"):
            times = best_times_interleaved(fns, budget_s=0.5 if quick else 3.0, max_rounds=15 if quick else 60,
                                           min_rounds=5 if quick else 20)
            outputs = {name: fn() for name, fn in fns.items()}
        naive_s, flash_s = times["naive"][0], times["flash"][0]
        diff = float(np.abs(outputs["naive"] - outputs["flash"]).max())
        rows.append([S, L, round(naive_s * 1e3, 3), round(flash_s * 1e3, 3), round(naive_s / flash_s, 2),
                     f"{diff:.1e}"])
        raw["sizes"].append({"S": S, "L": L, "naive_s": times["naive"][1], "flash_s": times["flash"][1],
                             "max_abs_diff": diff})
    at_context = [row for row in rows if row[0] == GOAL_CONTEXT]
    decode = [row for row in at_context if row[1] == 1]
    met = bool(decode) and all(row[4] >= GOAL_RATIO for row in decode)
    ratios = ", ".join(f"L={row[1]}: {row[4]}x" for row in at_context)
    raw["goal"] = {"context": GOAL_CONTEXT, "met": met, "ratios": {row[1]: row[4] for row in at_context}}
    goals = [f"{'PASS' if met else 'FAIL'} decoding (L=1) with flash at context {GOAL_CONTEXT}: "
             f"naive / flash {ratios} (goal >= {GOAL_RATIO} at L=1)"]
    notes = [
        "through KVCache.attend: is_causal=True, causal_align='bottom_right' (flash's band), no dense mask; "
        "flash runs a decode step (L=1) with the plain kernel",
        f"float32, B=1, Hq={Q_HEADS}, Hkv={KV_HEADS}, E={HEAD_DIM}; BLAS threads {threads}, "
        f"flash's pool {cpu_count()}; BLAS: {raw['blas']}",
    ]
    return BenchReport(title="Decoder attention through the KV cache: naive vs flash", columns=COLUMNS, rows=rows,
                       notes=notes, raw=raw, goals=goals)
