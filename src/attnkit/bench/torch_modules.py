"""The torch modules suite: attnkit.torch.MultiHeadAttention against calling
F.scaled_dot_product_attention directly.

"direct SDPA" is the production recipe written inline with no module around it:
one fused QKV `F.linear`, split, reshape to (B, H, L, E),
`F.scaled_dot_product_attention`, merge heads, output `F.linear`, on the same
weights. attnkit.torch.MultiHeadAttention does the same work behind its checks,
mask handling and state-dict-compatible parameters, so "vs direct" (direct
time / module time) near 1 means the module adds no measurable overhead; the
project's goal (`goals`, shown by `attnkit bench torch_modules --goals`) is
>= 0.95 at L = 1024. torch.nn.MultiheadAttention (need_weights=False)
and attnkit.nn's NumPy module are timed alongside for reference, and
attnkit.torch.flash_attention (the tiled autograd Function, attention only)
against SDPA's attention alone.

float32, B = 1, d_model = 512, 8 heads of 64, L = S, self-attention;
forward under no_grad, and forward + backward (gradients of input and weights).
Contenders are timed round-robin (`time_round_robin`, order reversed every other
round), best of the rounds; "paired" is the median of the per-round ratios.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from attnkit.bench.report import BenchReport, Progress
from attnkit.bench.measure import blas_summary
from attnkit.deprecation import keyword_only
from attnkit.runtime import cpu_count

D_MODEL, HEADS = 512, 8
FULL_LENGTHS = (256, 1024, 2048)
QUICK_LENGTHS = (1024,)
GOAL_L, GOAL_RATIO = 1024, 0.95
COLUMNS = ["L=S", "causal", "pass", "impl", "ms", "vs direct", "paired"]


def _timed_call(fn, params, x, d_out, grad: bool) -> Callable[[], object]:
    """A no-argument call of fn(x) to time: under no_grad for the forward, or
    forward then backward of d_out with the gradients of params and x reset."""
    import torch

    if not grad:
        def call():
            with torch.no_grad():
                return fn(x)
        return call

    def call():
        for p in (*params, x):
            p.grad = None
        out = fn(x)
        out.backward(d_out)
        return out
    return call


def _contenders(L: int, causal: bool, passes: str, with_numpy: bool):
    import numpy as np
    import torch
    import torch.nn.functional as F

    import attnkit.torch as at

    torch.manual_seed(0)
    mha = at.MultiHeadAttention(D_MODEL, HEADS, seed=0).eval()
    H, E = HEADS, D_MODEL // HEADS
    grad = passes == "fwd+bwd"
    with torch.no_grad():
        w_qkv = torch.cat([mha.q_proj.weight, mha.k_proj.weight, mha.v_proj.weight]).clone()
        b_qkv = torch.cat([mha.q_proj.bias, mha.k_proj.bias, mha.v_proj.bias]).clone()
        w_out, b_out = mha.out_proj.weight.clone(), mha.out_proj.bias.clone()
    direct_params = [w_qkv, b_qkv, w_out, b_out]
    for p in direct_params:
        p.requires_grad_(grad)
    for p in mha.parameters():
        p.requires_grad_(grad)
    ref = torch.nn.MultiheadAttention(D_MODEL, HEADS, batch_first=True).eval()
    with torch.no_grad():
        ref.in_proj_weight.copy_(w_qkv)
        ref.in_proj_bias.copy_(b_qkv)
        ref.out_proj.weight.copy_(w_out)
        ref.out_proj.bias.copy_(b_out)
    for p in ref.parameters():
        p.requires_grad_(grad)
    x = torch.randn(1, L, D_MODEL).requires_grad_(grad)
    d_out = torch.randn(1, L, D_MODEL)
    causal_bool = torch.ones(L, L, dtype=torch.bool).triu(1)  # torch.nn's polarity: True = masked

    def direct(x):
        B, T, _ = x.shape
        q, k, v = F.linear(x, w_qkv, b_qkv).split(D_MODEL, dim=-1)  # (B, T, d_model) each
        q, k, v = (t.unflatten(-1, (H, E)).transpose(1, 2) for t in (q, k, v))  # (B, H, T, E)
        heads = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return F.linear(heads.transpose(1, 2).flatten(2), w_out, b_out)

    def module(x):
        return mha(x, is_causal=causal).output

    def torch_nn(x):
        if causal:
            return ref(x, x, x, attn_mask=causal_bool, is_causal=True, need_weights=False)[0]
        return ref(x, x, x, need_weights=False)[0]

    def wrap(fn, params):
        return _timed_call(fn, params, x, d_out, grad)

    fns = {
        "direct SDPA": wrap(direct, direct_params),
        "attnkit.torch MHA": wrap(module, list(mha.parameters())),
        "torch.nn.MultiheadAttention": wrap(torch_nn, list(ref.parameters())),
    }
    if with_numpy and not grad:
        np_mha = at.to_numpy(mha)
        x_np = x.detach().numpy().astype(np.float32)
        fns["attnkit.nn MHA (NumPy)"] = lambda: np_mha(x_np, is_causal=causal)
    return fns


def _block_contenders(L: int, causal: bool, passes: str):
    """attnkit.torch.TransformerBlock (pre-LN, GELU, d_ff = 4 d_model) against the same
    block written inline with F.layer_norm, the direct SDPA recipe and F.linear/F.gelu."""
    import torch
    import torch.nn.functional as F

    import attnkit.torch as at

    block = at.TransformerBlock(D_MODEL, HEADS, 4 * D_MODEL, activation="gelu", norm_first=True, seed=0).eval()
    H, E = HEADS, D_MODEL // HEADS
    grad = passes == "fwd+bwd"
    sd = {k: v.detach().clone().requires_grad_(grad) for k, v in block.state_dict().items()}
    w_qkv = torch.cat([sd["attn.q_proj.weight"], sd["attn.k_proj.weight"], sd["attn.v_proj.weight"]]).detach()
    b_qkv = torch.cat([sd["attn.q_proj.bias"], sd["attn.k_proj.bias"], sd["attn.v_proj.bias"]]).detach()
    w_qkv.requires_grad_(grad)
    b_qkv.requires_grad_(grad)
    for p in block.parameters():
        p.requires_grad_(grad)
    x = torch.randn(1, L, D_MODEL).requires_grad_(grad)
    d_out = torch.randn(1, L, D_MODEL)

    def inline(x):
        h = F.layer_norm(x, (D_MODEL,), sd["norm1.weight"], sd["norm1.bias"])
        q, k, v = F.linear(h, w_qkv, b_qkv).split(D_MODEL, dim=-1)
        q, k, v = (t.unflatten(-1, (H, E)).transpose(1, 2) for t in (q, k, v))  # (B, H, L, E)
        heads = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        x = x + F.linear(heads.transpose(1, 2).flatten(2), sd["attn.out_proj.weight"], sd["attn.out_proj.bias"])
        h = F.layer_norm(x, (D_MODEL,), sd["norm2.weight"], sd["norm2.bias"])
        h = F.gelu(F.linear(h, sd["ffn.fc1.weight"], sd["ffn.fc1.bias"]))
        return x + F.linear(h, sd["ffn.fc2.weight"], sd["ffn.fc2.bias"])

    inline_params = [w_qkv, b_qkv, *sd.values()]

    def wrap(fn, params):
        return _timed_call(fn, params, x, d_out, grad)

    return {
        "inline block": wrap(inline, inline_params),
        "attnkit.torch TransformerBlock": wrap(lambda x: block(x, is_causal=causal), list(block.parameters())),
    }


def _attention_only(L: int, causal: bool, passes: str):
    """attnkit.torch.flash_attention against SDPA, on (1, 8, L, 64) q, k, v."""
    import torch
    import torch.nn.functional as F

    import attnkit.torch as at

    grad = passes == "fwd+bwd"
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, L, D_MODEL // HEADS, generator=g).requires_grad_(grad) for _ in range(3))
    d_out = torch.randn(1, HEADS, L, D_MODEL // HEADS, generator=g)

    def wrap(fn):
        def call():
            if not grad:
                with torch.no_grad():
                    return fn()
            for t in (q, k, v):
                t.grad = None
            out = fn()
            out.backward(d_out)
            return out
        return call

    return {
        "SDPA (attention only)": wrap(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)),
        "attnkit.torch flash_attention": wrap(lambda: at.flash_attention(q, k, v, is_causal=causal)),
    }


def time_round_robin(fns: dict[str, Callable[[], object]], rounds: int, budget_s: float | None = None,
                     clock: str = "wall") -> dict:
    """Time every contender once per round, in forward order on even rounds and
    reverse order on odd ones, after one untimed warmup round.

    clock="wall" is elapsed time; clock="cpu" is the calling thread's CPU time
    (`time.thread_time`), which other processes' load inflates much less; it is
    only the whole cost when torch runs on one thread.

    Returns {name: {"best_s", "runs_s"}} plus, for each name, "paired" ratios
    against the first contender: first's time / name's time within each round
    (the same machine load on both sides of each ratio).
    """
    if clock not in ("wall", "cpu"):
        raise ValueError(f"expected clock 'wall' or 'cpu', got {clock!r}")
    now = time.perf_counter if clock == "wall" else time.thread_time
    names = list(fns)
    for name in names:
        fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    start = time.perf_counter()
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            t0 = now()
            fns[name]()
            times[name].append(now() - t0)
        if budget_s is not None and time.perf_counter() - start > budget_s and r >= 2:
            break
    base = times[names[0]]
    return {
        name: {
            "best_s": min(ts),
            "runs_s": ts,
            "paired_median": statistics.median(b / t for b, t in zip(base, ts)),
        }
        for name, ts in times.items()
    }


@keyword_only("quick", "progress", "threads")
def run(*, quick: bool, progress: Progress, threads: int | None = None) -> BenchReport:
    import torch

    threads = threads or cpu_count()
    lengths = QUICK_LENGTHS if quick else FULL_LENGTHS
    budget, rounds = (4.0, 6) if quick else (20.0, 25)
    configs = [(L, causal, passes) for L in lengths for causal in (False, True) for passes in ("fwd", "fwd+bwd")]
    # the tiled Function issues many small operations: at several threads each one
    # synchronizes the pool, so it is also timed on one thread
    flash_threads = sorted({threads, 1}, reverse=True)
    flash_configs = [(GOAL_L, True, passes, n) for n in flash_threads for passes in ("fwd", "fwd+bwd")]
    progress.total(len(configs) + len(flash_configs))
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    rows, measurements = [], []
    try:
        for L, causal, passes in configs:
            progress.step(f"MHA L={L} {'causal ' if causal else ''}{passes}")
            fns = _contenders(L, causal, passes, with_numpy=not quick and L <= 1024)
            timed = time_round_robin(fns, rounds, budget)
            base = timed["direct SDPA"]["best_s"]
            for impl, t in timed.items():
                rows.append([L, causal, passes, impl, t["best_s"] * 1e3, base / t["best_s"], t["paired_median"]])
                measurements.append(dict(kind="mha", L=L, causal=causal, passes=passes, impl=impl,
                                         best_s=t["best_s"], runs_s=t["runs_s"], vs_direct=base / t["best_s"],
                                         paired_median=t["paired_median"], threads=threads))
        for L, causal, passes, n in flash_configs:
            progress.step(f"flash_attention L={L} {passes} {n} thread(s)")
            torch.set_num_threads(n)
            timed = time_round_robin(_attention_only(L, causal, passes), 5, budget)
            base = timed["SDPA (attention only)"]["best_s"]
            for impl, t in timed.items():
                label = impl if n == threads else f"{impl}, {n} thread"
                rows.append([L, causal, passes, label, t["best_s"] * 1e3, base / t["best_s"], t["paired_median"]])
                measurements.append(dict(kind="attention", L=L, causal=causal, passes=passes, impl=impl,
                                         best_s=t["best_s"], runs_s=t["runs_s"], vs_direct=base / t["best_s"],
                                         paired_median=t["paired_median"], threads=n))
    finally:
        torch.set_num_threads(old_threads)

    goal = [m for m in measurements if m["kind"] == "mha" and m["L"] == GOAL_L and m["impl"] == "attnkit.torch MHA"]
    worst = min(m["vs_direct"] for m in goal)
    worst_paired = min(m["paired_median"] for m in goal)
    verdict = "PASS" if worst >= GOAL_RATIO else "MISS"
    verdict_paired = "PASS" if worst_paired >= GOAL_RATIO else "MISS"
    notes = [
        f"torch {torch.__version__}, {threads} thread(s); NumPy BLAS: {blas_summary()}",
        "vs direct: direct SDPA's best time / this row's best (1.00 = same speed; flash rows: vs SDPA attention "
        "only); paired: median over rounds of the same ratio within one round",
    ]
    goals = [
        f"{verdict} attnkit.torch MHA vs direct SDPA at L={GOAL_L}: worst best-time ratio {worst:.3f} "
        f"over {len(goal)} cases (goal >= {GOAL_RATIO})",
        f"{verdict_paired} the same, worst paired median ratio {worst_paired:.3f} (steadier on a loaded machine; "
        f"goal >= {GOAL_RATIO})",
    ]
    return BenchReport(
        title=f"attnkit.torch modules: float32, B=1, d_model={D_MODEL}, {HEADS} heads, self-attention, "
              f"{threads} thread(s)",
        columns=COLUMNS,
        rows=rows,
        notes=notes,
        goals=goals,
        raw={"measurements": measurements, "goal": {"L": GOAL_L, "ratio": GOAL_RATIO, "worst": worst,
                                                     "worst_paired_median": worst_paired,
                                                     "met": worst >= GOAL_RATIO,
                                                     "met_paired": worst_paired >= GOAL_RATIO}},
    )
