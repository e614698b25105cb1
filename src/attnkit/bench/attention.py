"""The attention suite: attnkit flash against NumPy naive, torch naive and torch SDPA.

Side by side in one run, same inputs (float32, B=1, H=8, E=64, L=S), same thread
count for everyone: NumPy naive is attnkit's plain `scaled_dot_product_attention`
(it materializes the (L, S) scores; its backward is the plain backward), torch
naive is softmax(q k^T * scale) v written out in torch, torch SDPA is
`F.scaled_dot_product_attention` (its fwd+bwd goes through autograd).

GFLOP/s use FlashAttention's convention: forward 4 B H L S E, halved when
causal; forward + backward 3.5x that (the backward counts 2.5x the forward).
"vs SDPA" is torch SDPA's time divided by the row's time (> 1 = faster).
Peak memory is the extra memory held during one call: tracemalloc for NumPy,
sampled resident size for torch.

Then thread scaling (1 vs all threads), in the full run a single-head causal
forward at L = S = 131072, and the goals (`GOALS`) as PASS/FAIL
lines: flash forward >= 1.2x torch SDPA and fwd+bwd >= 1.0x torch SDPA autograd
at L >= 2048; >= 1.3x NumPy naive and causal/full forward time <= 0.6 from
L = 1024; all threads never slower than one. The first note names the CPU and
the BLAS kernel (threadpoolctl) the numbers belong to.
"""

from __future__ import annotations

import math
import time

import numpy as np

from attnkit.bench.report import BenchReport, Progress
from attnkit.bench.measure import (
    available_memory_bytes,
    best_time,
    best_times_interleaved,
    blas_summary,
    peak_numpy_bytes,
    peak_rss_bytes,
    system_info,
)
from attnkit.deprecation import keyword_only
from attnkit.runtime import cpu_count

H, E = 8, 64
FULL_LENGTHS = (512, 1024, 2048, 4096, 8192)
QUICK_LENGTHS = (512, 1024)
LONG_L = 131072
IMPLS = ("numpy naive", "attnkit flash", "torch naive", "torch SDPA")
COLUMNS = ["L=S", "causal", "pass", "impl", "ms", "GFLOP/s", "MiB", "vs SDPA"]  # MiB: peak extra memory


def _flops(L: int, S: int, causal: bool, passes: str, heads: int | None = None) -> float:
    fwd = 4.0 * (H if heads is None else heads) * L * S * E / (2 if causal else 1)
    return fwd if passes == "fwd" else 3.5 * fwd


def _naive_bytes(L: int, S: int, passes: str) -> int:
    """About what the NumPy naive path allocates: scores (and their gradients)."""
    scores = 4 * H * L * S
    return scores * (2 if passes == "fwd" else 5)


def _numpy_contenders(q, k, v, d_out, causal, threads):
    import attnkit
    from threadpoolctl import threadpool_limits

    def naive_fwd():
        with threadpool_limits(threads, user_api="blas"):
            return attnkit.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def naive_fwd_bwd():
        with threadpool_limits(threads, user_api="blas"):
            out = attnkit.scaled_dot_product_attention(q, k, v, is_causal=causal)
            return out, attnkit.scaled_dot_product_attention_backward(d_out, q, k, v, is_causal=causal)

    def flash_fwd():
        return attnkit.flash_attention(q, k, v, is_causal=causal, num_threads=threads)

    def flash_fwd_bwd():
        res = attnkit.flash_attention(q, k, v, is_causal=causal, num_threads=threads, return_lse=True)
        return attnkit.flash_attention_backward(d_out, q, k, v, res.output, res)

    return {
        ("numpy naive", "fwd"): naive_fwd,
        ("numpy naive", "fwd+bwd"): naive_fwd_bwd,
        ("attnkit flash", "fwd"): flash_fwd,
        ("attnkit flash", "fwd+bwd"): flash_fwd_bwd,
    }


def _torch_contenders(q, k, v, d_out, causal):
    import torch
    import torch.nn.functional as F

    tq, tk, tv, tdo = (torch.from_numpy(x) for x in (q, k, v, d_out))
    L, S = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1])
    blocked = torch.ones(L, S, dtype=torch.bool).triu(1) if causal else None

    def naive(a, b, c):
        s = (a @ b.transpose(-1, -2)) * scale
        if blocked is not None:
            s = s.masked_fill(blocked, float("-inf"))
        return torch.softmax(s, dim=-1) @ c

    def sdpa(a, b, c):
        return F.scaled_dot_product_attention(a, b, c, is_causal=causal)

    def fwd(f):
        def run():
            with torch.no_grad():
                return f(tq, tk, tv)
        return run

    def fwd_bwd(f):
        def run():
            a, b, c = (x.detach().requires_grad_() for x in (tq, tk, tv))
            f(a, b, c).backward(tdo)
            return a.grad, b.grad, c.grad
        return run

    return {
        ("torch naive", "fwd"): fwd(naive),
        ("torch naive", "fwd+bwd"): fwd_bwd(naive),
        ("torch SDPA", "fwd"): fwd(sdpa),
        ("torch SDPA", "fwd+bwd"): fwd_bwd(sdpa),
    }


@keyword_only("quick", "progress", "threads")
def run(*, quick: bool, progress: Progress, threads: int | None = None) -> BenchReport:
    """Measure every contender on every configuration; see the module docstring."""
    threads = threads or cpu_count()
    try:
        import torch
    except ImportError:  # the suite still runs, without the torch columns
        torch = None
    lengths = QUICK_LENGTHS if quick else FULL_LENGTHS
    budget = 0.5 if quick else 2.0
    impls = IMPLS if torch is not None else IMPLS[:2]
    configs = [(L, causal, passes) for L in lengths for causal in (False, True) for passes in ("fwd", "fwd+bwd")]
    scaling_L = 1024 if quick else 2048
    causal_Ls = [L for L in lengths if L >= 1024] or [max(lengths)]
    progress.total(len(configs) * (len(impls) + 1) + 2 + len(causal_Ls) + (0 if quick else 1))

    old_torch_threads = None
    if torch is not None:
        old_torch_threads = torch.get_num_threads()
        torch.set_num_threads(threads)
    from attnkit.kernels import flash as compiled

    compiled.load()  # the compiled tile loops start before the clock does (a long process would start them anyway)
    measurements, rows, notes = [], [], []
    started_wall, started_cpu = time.perf_counter(), time.process_time()
    try:
        rng = np.random.default_rng(0)
        for L in lengths:
            q, k, v, d_out = (rng.standard_normal((1, H, L, E), dtype=np.float32) for _ in range(4))
            for causal in (False, True):
                contenders = _numpy_contenders(q, k, v, d_out, causal, threads)
                if torch is not None:
                    contenders.update(_torch_contenders(q, k, v, d_out, causal))
                for passes in ("fwd", "fwd+bwd"):
                    tag = f"{passes} L={L}{' causal' if causal else ''}"
                    chosen = {}
                    for impl in impls:
                        avail = available_memory_bytes()
                        if impl.endswith("naive") and avail is not None and _naive_bytes(L, L, passes) > 0.4 * avail:
                            notes.append(f"skipped {impl} {tag}: needs about "
                                         f"{_naive_bytes(L, L, passes) / 2**30:.1f} GiB, "
                                         f"{avail / 2**30:.1f} GiB available")
                            progress.step(f"skip {impl} {tag}")
                            continue
                        chosen[impl] = contenders[(impl, passes)]
                    progress.step(f"timing {', '.join(chosen)} {tag}")
                    # settle in both modes for longer than OpenBLAS's workers spin after NumPy
                    # naive's multithreaded BLAS call: with a shorter pause flash was timed slow
                    # (docs/benchmarks.md, "Measurements behind design choices")
                    timed = best_times_interleaved(chosen, budget_s=budget, max_rounds=3 if quick else 8,
                                                   min_rounds=1 if quick else 3, settle_s=0.15)
                    results = {}
                    for impl, fn in chosen.items():
                        progress.step(f"memory of {impl} {tag}")
                        seconds, times = timed[impl]
                        if impl.startswith("torch"):
                            peak, method = peak_rss_bytes(fn), "rss"
                        else:
                            peak, method = peak_numpy_bytes(fn), "tracemalloc"
                        results[impl] = seconds
                        measurements.append(dict(
                            impl=impl, L=L, S=L, H=H, E=E, causal=causal, passes=passes, threads=threads,
                            seconds=seconds, times=times, gflops=_flops(L, L, causal, passes) / seconds / 1e9,
                            peak_bytes=peak, memory_method=method,
                        ))
                    ref = results.get("torch SDPA")
                    for m in measurements[len(measurements) - len(results):]:
                        m["vs_sdpa"] = None if ref is None else ref / m["seconds"]
                        rows.append([L, "yes" if causal else "no", passes, m["impl"], round(m["seconds"] * 1e3, 3),
                                     round(m["gflops"], 1),
                                     None if m["peak_bytes"] is None else round(m["peak_bytes"] / 2**20, 1),
                                     None if m["vs_sdpa"] is None else f"{m['vs_sdpa']:.2f}x"])

        extras = _scaling(scaling_L, threads, budget, progress, quick)
        extras["causal_over_full"] = _causal_over_full(causal_Ls, threads, budget, progress, quick)
        if not quick:
            extras.update(_long_causal(progress))
    finally:
        if torch is not None and old_torch_threads is not None:
            torch.set_num_threads(old_torch_threads)

    cpus_used = (time.process_time() - started_cpu) / (time.perf_counter() - started_wall)
    extras["cpus_used_overall"] = cpus_used
    goals = _goals(measurements, extras, threads)
    system = system_info()
    notes = [f"CPU: {system.get('cpu_model') or system['machine']}, {cpu_count()} CPUs for this process",
             f"BLAS: {blas_summary()}; threads: {threads}; this process got {cpus_used:.2f} of "
             f"{cpu_count()} CPUs on average (a shared machine gives less)", *notes, *[g["line"] for g in goals]]
    return BenchReport(
        title=f"Attention kernels: float32, B=1, H={H}, E={E}, L=S, {threads} thread(s)",
        columns=COLUMNS, rows=rows, notes=notes,
        raw=dict(measurements=measurements, extras=extras, goals=goals, quick=quick, system=system),
    )


def _scaling(L: int, threads: int, budget: float, progress: Progress, quick: bool) -> dict:
    """Flash at 1 thread against `threads` threads (B x H = 8)."""
    import attnkit

    rng = np.random.default_rng(1)
    q, k, v, d_out = (rng.standard_normal((1, H, L, E), dtype=np.float32) for _ in range(4))
    out = {}
    for passes in ("fwd", "fwd+bwd"):
        progress.step(f"thread scaling {passes} L={L}")
        if quick and passes == "fwd+bwd":
            continue

        def call(n, passes=passes):
            res = attnkit.flash_attention(q, k, v, num_threads=n, return_lse=True)
            if passes == "fwd+bwd":
                attnkit.flash_attention_backward(d_out, q, k, v, res.output, res)

        # More rounds than elsewhere: on a shared machine the best 2-thread run
        # needs a moment when both cores are free.
        timed = best_times_interleaved({"one": lambda: call(1), "many": lambda: call(threads)},
                                       budget_s=2 * budget if quick else 4 * budget, max_rounds=3 if quick else 8,
                                       settle_s=0.05)
        one, many = timed["one"][0], timed["many"][0]
        # How many CPUs did the machine actually give us? On a shared machine
        # (Linux autogroups share CPU time per session) it can be fewer than the
        # threads, and then no speedup is possible whatever the code does.
        wall, cpu = time.perf_counter(), time.process_time()
        call(threads)
        cpus = (time.process_time() - cpu) / (time.perf_counter() - wall)
        out[f"scaling_{passes}"] = dict(L=L, one_thread_s=one, threads=threads, many_threads_s=many,
                                        speedup=one / many, cpus_used=cpus)
    return out


def _causal_over_full(lengths, threads: int, budget: float, progress: Progress, quick: bool) -> dict:
    """Flash's causal forward time over its full forward time at each length,
    the two interleaved round by round: a ratio of two rows of the table would
    compare calls timed seconds apart, under another load on a shared machine."""
    import attnkit

    rng = np.random.default_rng(3)
    out = {}
    for L in lengths:
        progress.step(f"causal / full flash forward L={L}")
        q, k, v = (rng.standard_normal((1, H, L, E), dtype=np.float32) for _ in range(3))
        timed = best_times_interleaved(
            {"full": lambda: attnkit.flash_attention(q, k, v, num_threads=threads),
             "causal": lambda: attnkit.flash_attention(q, k, v, is_causal=True, num_threads=threads)},
            budget_s=2 * budget if quick else 4 * budget, max_rounds=8, min_rounds=3, settle_s=0.05)
        out[L] = dict(full_s=timed["full"][0], causal_s=timed["causal"][0],
                      ratio=timed["causal"][0] / timed["full"][0])
    return out


def _long_causal(progress: Progress) -> dict:
    """One head, causal, L = S = 131072: naive would need 64 GiB for the scores."""
    import attnkit

    progress.step(f"single-head causal forward L=S={LONG_L}")
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, 1, LONG_L, E), dtype=np.float32) for _ in range(3))
    # One timed run (a second would double a long step); peak memory is measured at L=8192 instead.
    seconds, _ = best_time(lambda: attnkit.flash_attention(q, k, v, is_causal=True), budget_s=0, max_runs=1,
                           warmup=False)
    return {"long_causal": dict(L=LONG_L, H=1, E=E, seconds=seconds,
                                gflops=_flops(LONG_L, LONG_L, True, "fwd", heads=1) / seconds / 1e9,
                                naive_scores_gib=4 * LONG_L * LONG_L / 2**30)}


GOALS = dict(  # on whatever machine runs the suite
    fwd_vs_sdpa=1.2,  # flash forward / torch SDPA, at L >= 2048
    fwd_bwd_vs_sdpa=1.0,  # flash fwd+bwd / torch SDPA autograd, at L >= 2048
    fwd_vs_naive=1.3,  # flash forward / NumPy naive, from L = 1024
    causal_over_full=0.6,  # causal / full flash forward time, from L = 1024
    threads_speedup=1.0,  # all threads / one thread: threads never hurt
    peak_memory=1 / 20,  # flash / naive extra memory, at the largest L
)


def _goals(measurements: list[dict], extras: dict, threads: int) -> list[dict]:
    """The goals, checked against this run's numbers: a line each, PASS or FAIL.
    A goal stated for lengths this run did not measure (a quick run has no L >=
    2048) is shown as "info" at the run's largest length instead."""
    def find(impl, L, causal, passes):
        for m in measurements:
            if (m["impl"], m["L"], m["causal"], m["passes"]) == (impl, L, causal, passes):
                return m
        return None

    def ratio(num, den):
        return num["seconds"] / den["seconds"] if num and den else None

    goals = []

    def goal(name, value, target, fmt="{:.2f}x", higher=True, stated=True, where=""):
        if value is None:
            return
        ok = value >= target if higher else value <= target
        verdict = ("PASS" if ok else "FAIL") if stated else "info"
        goals.append(dict(name=name, value=value, target=target, met=ok if stated else None,
                          line=f"{verdict} {name}: {fmt.format(value)} "
                               f"(goal {'>=' if higher else '<='} {fmt.format(target)}{where})"))

    Ls = sorted({m["L"] for m in measurements})
    big = max(Ls)
    long = [L for L in Ls if L >= 2048]
    for L in long or [big]:
        where = "" if long else " at L >= 2048, not measured in this run"
        goal(f"forward vs torch SDPA at L={L}", ratio(find("torch SDPA", L, False, "fwd"),
                                                       find("attnkit flash", L, False, "fwd")),
             GOALS["fwd_vs_sdpa"], stated=bool(long), where=where)
        goal(f"fwd+bwd vs torch SDPA autograd at L={L}", ratio(find("torch SDPA", L, False, "fwd+bwd"),
                                                                 find("attnkit flash", L, False, "fwd+bwd")),
             GOALS["fwd_bwd_vs_sdpa"], stated=bool(long), where=where)
    from_1024 = [L for L in Ls if L >= 1024]
    for L in from_1024 or [big]:
        where = "" if from_1024 else " from L = 1024, not measured in this run"
        goal(f"forward vs NumPy naive at L={L}", ratio(find("numpy naive", L, False, "fwd"),
                                                        find("attnkit flash", L, False, "fwd")),
             GOALS["fwd_vs_naive"], stated=bool(from_1024), where=where)
        paired = extras.get("causal_over_full", {}).get(L)
        goal(f"causal / full forward time at L={L}",
             paired["ratio"] if paired else ratio(find("attnkit flash", L, True, "fwd"),
                                                  find("attnkit flash", L, False, "fwd")),
             GOALS["causal_over_full"], higher=False, stated=bool(from_1024), where=where)
    f, n = find("attnkit flash", big, False, "fwd"), find("numpy naive", big, False, "fwd")
    if f and n and f["peak_bytes"] and n["peak_bytes"]:
        goal(f"peak memory flash / naive at L={big}", f["peak_bytes"] / n["peak_bytes"], GOALS["peak_memory"],
             fmt="{:.4f}", higher=False, stated=big >= 2048, where="" if big >= 2048 else " at L >= 2048")
    for passes in ("fwd", "fwd+bwd"):
        sc = extras.get(f"scaling_{passes}")
        if not sc or threads < 2:
            continue
        name = f"{passes} {threads} threads vs 1 at L={sc['L']}"
        if sc["cpus_used"] < 0.8 * threads and sc["speedup"] >= GOALS["threads_speedup"]:
            goal(name, sc["speedup"], GOALS["threads_speedup"])
        elif sc["cpus_used"] < 0.8 * threads:
            goals.append(dict(name=name, value=sc["speedup"], target=GOALS["threads_speedup"], met=None,
                              line=f"N/A  {name}: {sc['speedup']:.2f}x, not measurable now: the machine gave this "
                                   f"process {sc['cpus_used']:.2f} CPUs during the {threads}-thread run"))
        else:
            goal(name, sc["speedup"], GOALS["threads_speedup"])
    lc = extras.get("long_causal")
    if lc:
        goals.append(dict(name="single-head causal forward at L=S=131072", value=lc["seconds"], target=None,
                          met=True, line=f"DONE single-head causal forward at L=S={lc['L']}: "
                                         f"{lc['seconds']:.1f} s ({lc['gflops']:.0f} GFLOP/s); naive would need "
                                         f"{lc['naive_scores_gib']:.0f} GiB for the scores"))
    return goals
