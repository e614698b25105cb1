"""Floors: how close each speed goal's path runs to the work it cannot skip, on this machine.

A path's floor is the work no implementation of it can avoid: its matrix products at
BLAS speed, plus the element-wise passes that cannot be fused into them, run by
attnkit's compiled kernels (`attnkit.kernels`; the NumPy reference's passes when the
kernels are off: the first note says which). This script times each floor alone,
round-robin with attnkit and its peers in one process, and prints per goal:

    ratio now = peer's time / attnkit's time        (the goal's ratio)
    ceiling   = peer's time / floor's time          (the best ratio a free rest would give)
    x floor   = attnkit's time / floor's time       (the path's distance to its floor)

A goal whose ceiling is below it cannot pass on this machine with this NumPy and BLAS,
whatever attnkit's code does; one whose ceiling is above it is a question of the rest
(the "budget" column: what the work beside the floor may cost at most). Every path
should run within 1.2x its floor (the encoder within 1.15x).

- encoder: all-MiniLM-L6-v2's linear products over the tokens of `attnkit bench
  encoder`'s goal row (256 varied sentences, batches of 32 sorted by length and
  packed without padding, as `SentenceEncoder.encode` runs them; the faster of the
  two weight layouts per shape), against sentence-transformers and ONNX Runtime
  (when installed). Goals: 1.3x and 1.2x; within 1.15x of its floor: those products
  at BLAS speed plus what cannot be fused into them (the attention products, the
  GELU, the two LayerNorms and the softmax passes, by the compiled kernels). A
  second row per peer, marked info, puts the linear products alone beside it: no
  implementation runs the encoder in that time (on the AMD EPYC VM the floor with
  the unfusable passes is 1.13x it at one thread, 1.20-1.22x at two).
- flash: `flash_attention`'s forward floor (per tile of its grid: q kᵀ, the exp, P V)
  and backward floor (per tile: q kᵀ, the exp, dO Vᵀ, Pᵀ dO, dS = P (dP - D), dS K,
  dSᵀ q: the five products and the two element-wise passes any tiled backward makes),
  B=1, H=8, E=64, float32, against torch SDPA (no_grad forward; forward + backward
  through autograd); the products 64 wide and, with a ones column, 65 wide (the NumPy
  reference's width), the faster counted. The passes that cannot be fused into a
  product are the compiled kernels' when the kernels run. Each width counts what it
  leaves to them: the forward's row sums of the weights (any softmax needs them) come
  out of a 65-wide P [V, 1], so at 64 the exp pass sums the rows too; the backward's
  - D comes out of a 65-wide [dO, -D] [V, 1], so at 64 the dS pass subtracts it.
  (Earlier floors counted neither the row sums at 64 nor the dS pass at all: below
  the work of any implementation.) Goals: forward 1.2x, forward + backward 1.0x.
- decoder: SmolLM2's weight products of a decode step, back to back in decode
  order on the model's own arrays, against the bandwidth probe of `attnkit bench
  decoder`, and attnkit's decode step from `generate`. Goal: decode at 60% of the
  probe's float32 weight-bandwidth bound.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/floors.py \\
        [--part encoder flash decoder] [--threads 1] [--rounds 5] [--json out.json]

Threads: one by default, the per-core question. With more, every contender gets that
many, and each floor splits its work the way attnkit can: flash's tiles by heads over
worker threads with one BLAS thread each (as flash does); the encoder's products on
BLAS threads or, rows split, on worker threads, whichever is faster; a decode step's
products on BLAS threads (as decode steps run them when that is faster than one).

The table fits the terminal by wrapping its text columns at spaces and, if still too
wide, leaving out whole columns (named below it); written to a file or a pipe it is
printed at its full width.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from rich.console import Console

from attnkit.bench.measure import blas_summary, system_info
from attnkit.bench.torch_modules import time_round_robin
from attnkit.runtime import blas_threads


def _best(timed: dict, name: str) -> float:
    return timed[name]["best_s"]


# ----------------------------------------------------------------------------- encoder


def encoder(threads: int, rounds: int) -> list[dict]:
    import torch

    from attnkit.bench.encoder import (
        GOAL_VS_ORT, GOAL_VS_REFERENCE, GOAL_WORKLOAD, OnnxRuntimeEncoder, _load_contenders, benchmark_sentences,
        onnxruntime_available,
    )

    _, sentences, batch_size = GOAL_WORKLOAD
    ours, reference = _load_contenders(None, threads)
    texts = benchmark_sentences(sentences)
    lengths = sorted(len(e.ids) for e in ours.tokenizer.encode(texts))
    batches = [sum(lengths[i : i + batch_size]) for i in range(0, len(lengths), batch_size)]
    c = ours.model.config
    d, ff = c.hidden_size, c.intermediate_size
    shapes = [(d, 3 * d), (d, d), (d, ff), (ff, d)]  # fused q/k/v, attention output, FFN in, FFN out
    rng = np.random.default_rng(0)
    weights = [(rng.standard_normal(s, dtype=np.float32), rng.standard_normal(s[::-1], dtype=np.float32).T)
               for s in shapes]  # each shape in both layouts: (in, out) row-major, and its transpose
    inputs = {(n, s[0]): rng.standard_normal((n, s[0]), dtype=np.float32) for n in set(batches) for s in shapes}
    with blas_threads(threads):
        layout = []  # the faster layout for each shape, on the largest batch
        for pair, shape in zip(weights, shapes):
            x = inputs[(max(batches), shape[0])]
            timed = time_round_robin({i: (lambda w=w: x @ w) for i, w in enumerate(pair)}, rounds=7)
            layout.append(pair[min(timed, key=lambda i: timed[i]["best_s"])])

    def products(share: int = 0, parts: int = 1) -> None:  # every batch's rows, or one share of them
        for n in batches:
            rows = slice(n * share // parts, n * (share + 1) // parts)
            for _ in range(c.num_hidden_layers):
                for w, shape in zip(layout, shapes):
                    inputs[(n, shape[0])][rows] @ w

    # The kernels' floor: the products above, plus attention's own products (q k^T and P V per
    # sequence and head, one batched product per run of equal lengths, as any NumPy
    # implementation must run them) and the element-wise passes no product can absorb, on
    # attnkit's compiled kernels: GELU(x + b) over the FFN rows, two bias + residual + LayerNorm
    # passes, the softmax of the scores. Nothing else: no bias of q/k/v, no copies, no Python.
    from attnkit.kernels import elementwise as kernels

    H, E = c.num_attention_heads, c.head_dim
    batch_lengths = [lengths[i : i + batch_size] for i in range(0, len(lengths), batch_size)]
    runs = []  # per batch: [(count, L)] runs of equal lengths
    for group in batch_lengths:
        values, counts = np.unique(group, return_counts=True)
        runs.append(list(zip(counts.tolist(), values.tolist())))
    heads = {(m, L): (rng.standard_normal((m, H, L, E), dtype=np.float32),
                      rng.standard_normal((m, H, E, L), dtype=np.float32)) for batch in runs for m, L in batch}
    ffn_bias = rng.standard_normal(ff, dtype=np.float32)
    norm_w, norm_b, add_b = (rng.standard_normal(d, dtype=np.float32) for _ in range(3))
    residuals = {n: rng.standard_normal((n, d), dtype=np.float32) for n in set(batches)}
    # the same layouts scaled by 1 / sqrt(fan-in): activations of a trained model's size (about 1),
    # so the element-wise passes see the values they see in the encoder (not exp's underflow tails)
    scaled = [np.multiply(w, np.float32(1 / math.sqrt(w.shape[0])), order="K") for w in layout]

    def kernels_floor(share: int = 0, parts: int = 1) -> None:
        for n, batch in zip(batches, runs):
            rows = slice(n * share // parts, n * (share + 1) // parts)
            mine = batch[share::parts]  # this share's runs of sequences
            for _ in range(c.num_hidden_layers):
                qkv = inputs[(n, d)][rows] @ scaled[0]
                for m, L in mine:
                    q, kt = heads[(m, L)]  # q k^T: scores of size about sqrt(E), as MiniLM's
                    scores = q @ kt  # (m, H, L, L)
                    kernels.attention_softmax(scores, 1.0 / math.sqrt(E))
                    scores @ q  # P V
                y = inputs[(n, d)][rows] @ scaled[1]
                kernels.add_layer_norm(y, add_b, residuals[n][rows], norm_w, norm_b, 1e-12)
                h = y @ scaled[2]
                kernels.gelu_bias(h, ffn_bias)
                y = h @ scaled[3]
                kernels.add_layer_norm(y, add_b, residuals[n][rows], norm_w, norm_b, 1e-12)
        del qkv

    def kernels_floor_on_workers() -> None:
        with blas_threads(1), ThreadPoolExecutor(threads) as pool:
            list(pool.map(kernels_floor, range(threads), [threads] * threads))

    def products_on_workers() -> None:  # as the encoder's "worker threads" schedule splits a batch
        with blas_threads(1), ThreadPoolExecutor(threads) as pool:
            list(pool.map(products, range(threads), [threads] * threads))

    def run_reference() -> None:
        with torch.inference_mode():
            reference.encode(texts, batch_size=batch_size, convert_to_numpy=True)

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fns = {"products": lambda: _with_blas(threads, products),
               "attnkit": lambda: ours.encode(texts, batch_size=batch_size),
               "sentence-transformers": run_reference}
        fns["kernels floor"] = lambda: _with_blas(threads, kernels_floor)
        if threads > 1:  # the floor is the faster way to split them: BLAS threads, or worker threads
            fns["products on workers"] = products_on_workers
            fns["kernels floor on workers"] = kernels_floor_on_workers
        goals = {"sentence-transformers": GOAL_VS_REFERENCE}
        if onnxruntime_available():
            ort = OnnxRuntimeEncoder(reference, threads)
            fns["ONNX Runtime"] = lambda: ort.encode(texts, batch_size)
            goals["ONNX Runtime"] = GOAL_VS_ORT
        timed = time_round_robin(fns, rounds)
    finally:
        torch.set_num_threads(previous)
    floor = min(t["best_s"] for name, t in timed.items() if name.startswith("products"))
    kfloor = min(t["best_s"] for name, t in timed.items() if name.startswith("kernels floor"))
    flops = 2 * sum(batches) * c.num_hidden_layers * sum(a * b for a, b in shapes)
    rows = []
    for peer, goal in goals.items():
        rows.append(dict(part="encoder", goal=f"attnkit >= {goal}x {peer} (256 varied, batch 32)",
                         floor_s=kfloor, floor_note="products + attention products + GELU, 2 LN, softmax passes",
                         attnkit_s=_best(timed, "attnkit"), peer=peer, peer_s=_best(timed, peer), goal_ratio=goal))
        rows.append(dict(part="encoder", goal=f"[linear products alone] attnkit >= {goal}x {peer}", info=True,
                         floor_s=floor, floor_note=f"{flops / floor / 1e9:.1f} GFLOP/s, {sum(batches)} tokens",
                         attnkit_s=_best(timed, "attnkit"), peer=peer, peer_s=_best(timed, peer), goal_ratio=goal))
    return rows


def _with_blas(threads: int, fn) -> None:
    with blas_threads(threads):
        fn()


# ----------------------------------------------------------------------------- flash


def flash(threads: int, rounds: int, lengths: list[int]) -> list[dict]:
    import attnkit
    from attnkit.bench.attention import GOALS, _torch_contenders
    from attnkit.functional.flash import choose_blocks

    import torch

    H, E = 8, 64
    rows = []
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for L in lengths:
            rng = np.random.default_rng(L)
            q, k, v, d_out = (rng.standard_normal((1, H, L, E), dtype=np.float32) for _ in range(4))
            block_q, block_k = choose_blocks(L, L, 4, banded=False)
            tiles = [(q0, k0) for q0 in range(0, L, block_q) for k0 in range(0, L, block_k)]  # per head
            torch_fns = _torch_contenders(q, k, v, d_out, False)
            fns = {
                "flash forward": lambda: attnkit.flash_attention(q, k, v, num_threads=threads),
                "torch SDPA forward": torch_fns[("torch SDPA", "fwd")],
                "flash fwd+bwd": lambda: _flash_fwd_bwd(q, k, v, d_out, threads),
                "torch SDPA fwd+bwd": torch_fns[("torch SDPA", "fwd+bwd")],
            }
            # The floor's products at the head width and one wider (a ones column): OpenBLAS's
            # sgemm can run a 64-wide side ~18% slower than a 65-wide one (Zen 1, Haswell kernel),
            # and 10-12% faster (Zen 4, SkylakeX kernel); the NumPy reference's [q, -c] . [k, 1] and
            # P [V, 1] are 65 wide, the fused tiles' 64. The floor takes the faster.
            for width in (E, E + 1):
                forward_floor, backward_floor = _flash_floors(q, k, v, d_out, width, block_q, block_k, tiles)
                fns[f"forward floor {width}"] = lambda f=forward_floor: _by_heads(threads, H, f)
                fns[f"fwd+bwd floor {width}"] = lambda f=forward_floor, b=backward_floor: (
                    _by_heads(threads, H, f), _by_heads(threads, H, b))
            timed = time_round_robin(fns, rounds)
            for passes, goal in (("forward", GOALS["fwd_vs_sdpa"]), ("fwd+bwd", GOALS["fwd_bwd_vs_sdpa"])):
                width = min((E, E + 1), key=lambda w: _best(timed, f"{passes} floor {w}"))
                rows.append(dict(part="flash", goal=f"flash {passes} >= {goal}x torch SDPA, L=S={L}",
                                 floor_s=_best(timed, f"{passes} floor {width}"),
                                 floor_note=f"{H * len(tiles)} tiles of {block_q} x {block_k}, {width} wide",
                                 attnkit_s=_best(timed, f"flash {passes}"), peer="torch SDPA",
                                 peer_s=_best(timed, f"torch SDPA {passes}"), goal_ratio=goal))
    finally:
        torch.set_num_threads(previous)
    return rows


def _flash_floors(q, k, v, d_out, width: int, block_q: int, block_k: int, tiles):
    """(forward_floor, backward_floor), each work(range of heads): per tile the products and
    the element-wise passes of flash's forward (q kᵀ, exp, P V) and backward (q kᵀ, exp,
    dO Vᵀ, Pᵀ dO, dS = P (dP - D), dS K, dSᵀ q), on copies of the (1, H, L, E) inputs widened
    with zero columns to `width` (a product costs the same whatever the column holds). At the
    head's own width the row sums of the forward's weights and the backward's - D are
    passes' work (`_exp`'s sums, `_grad_scores`, whose kernel also sums each row's dS);
    one column wider, products' (module docstring)."""
    H, L, E = q.shape[1:]
    in_products = width > E  # the row sums and - D ride on a ones column

    def widened(x: np.ndarray) -> np.ndarray:
        out = np.zeros((H, x.shape[2], width), np.float32)
        out[..., :E] = x[0]
        return out

    qs, kw, vw, dow = widened(q * np.float32(1 / math.sqrt(E))), widened(k), widened(v), widened(d_out)
    kt, vt = np.ascontiguousarray(kw.swapaxes(-1, -2)), np.ascontiguousarray(vw.swapaxes(-1, -2))  # (H, width, S)
    dq, dk, dv = np.zeros_like(qs), np.zeros_like(kw), np.zeros_like(vw)

    def forward_floor(heads: range) -> None:
        scores = np.empty((block_q, block_k), np.float32)  # a tile's buffers, reused as flash does
        pv = np.empty((block_q, width), np.float32)
        rows = _RowVectors(block_q)  # the passes' per-row vectors (each thread its own)
        for h in heads:
            for q0, k0 in tiles:
                s = np.matmul(qs[h, q0 : q0 + block_q], kt[h, :, k0 : k0 + block_k], out=scores)
                _exp(s, None if in_products else rows)
                np.matmul(s, vw[h, k0 : k0 + block_k], out=pv)

    def backward_floor(heads: range) -> None:
        p, d_p = np.empty((block_q, block_k), np.float32), np.empty((block_q, block_k), np.float32)
        rows_w, cols_w = np.empty((block_q, width), np.float32), np.empty((block_k, width), np.float32)
        rows = _RowVectors(block_q)
        for h in heads:
            for q0, k0 in tiles:
                r, c = slice(q0, q0 + block_q), slice(k0, k0 + block_k)
                np.matmul(qs[h, r], kt[h, :, c], out=p)
                _exp(p)
                np.matmul(dow[h, r], vt[h, :, c], out=d_p)  # dP (- D, 65 wide)
                _grad_scores(d_p, p, None if in_products else rows)  # dS = P (dP - D), in d_p
                dv[h, c] += np.matmul(p.T, dow[h, r], out=cols_w)
                dq[h, r] += np.matmul(d_p, kw[h, c], out=rows_w)
                dk[h, c] += np.matmul(d_p.T, qs[h, r], out=cols_w)

    return forward_floor, backward_floor


class _RowVectors:
    """Per-row vectors of a tile for the floor's passes: zeros and ones (the forward's
    shift and factor, and the weight sums that make the backward look for no dominant
    key), D (its values do not change the work), and outputs."""

    def __init__(self, rows: int):
        self.zeros, self.ones = np.zeros(rows, np.float32), np.ones(rows, np.float32)
        self.d = np.ones(rows, np.float32)
        self.sums, self.top = np.empty(rows, np.float32), np.empty(rows, np.int64)


def _exp(s: np.ndarray, rows: _RowVectors | None = None) -> None:
    """s <- exp(s), and with `rows` its rows' sums too (into rows.sums): the compiled
    kernels' pass when the kernels run (as flash's tiles take them), else NumPy's."""
    from attnkit.kernels import flash as compiled

    if rows is None:
        if compiled.usable(s):
            compiled.exp_tile(s)
        else:
            np.exp(s, out=s)
    elif compiled.usable(s):
        compiled.band_exp_tile(s, rows.zeros, rows.zeros, rows.ones, rows.sums, -compiled.NO_BAND, compiled.NO_BAND)
    else:
        np.exp(s, out=s)
        np.sum(s, axis=1, out=rows.sums)


def _grad_scores(ds: np.ndarray, p: np.ndarray, rows: _RowVectors | None) -> None:
    """ds <- p (ds - D) per row (ds holds dP; or dP - D already when rows is None): one
    pass, the compiled kernel's when the kernels run (weight sums 0: no dominant key to
    look for; it also sums each row's dS, as flash's pass does), else NumPy's."""
    from attnkit.kernels import flash as compiled

    if rows is None:
        np.multiply(ds, p, out=ds)
    elif compiled.usable(ds, p):
        compiled.grad_scores_tile(ds, p, rows.d, rows.zeros, np.inf, rows.top, rows.sums)
    else:
        ds -= rows.d[:, None]
        np.multiply(ds, p, out=ds)


def _by_heads(threads: int, heads: int, work) -> None:
    """work(range of heads) over all heads: on `threads` worker threads, each with its own
    share of the heads and one BLAS thread, as flash splits its work."""
    with blas_threads(1):
        if threads == 1:
            work(range(heads))
            return
        shares = [range(heads * i // threads, heads * (i + 1) // threads) for i in range(threads)]
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(work, shares))


def _flash_fwd_bwd(q, k, v, d_out, threads):
    import attnkit

    res = attnkit.flash_attention(q, k, v, num_threads=threads, return_lse=True)
    return attnkit.flash_attention_backward(d_out, q, k, v, res.output, res)


# ----------------------------------------------------------------------------- decoder


def decoder(threads: int, rounds: int) -> list[dict]:
    from attnkit.bench.decoder import GOAL_BOUND_FRACTION, BandwidthProbe, weight_bytes
    from attnkit.models.embedded import smollm2_gguf_path
    from attnkit.models.llama import LlamaForCausalLM

    model = LlamaForCausalLM.from_gguf(smollm2_gguf_path())
    ids = np.arange(100, 150)
    model.generate(ids, 2, stop=())  # builds the fused arrays and the head's transpose
    matrices = []
    for block in model.layers:
        qkv_t, _, out_t, _ = block.attn._fused()
        gate_up_t, _, down_t = block.mlp._fused()
        matrices += [qkv_t, out_t, gate_up_t, down_t]
    matrices.append(model._head_t)
    x = {m.shape[0]: np.ones((1, 1, m.shape[0]), np.float32) for m in matrices}
    probe = BandwidthProbe()
    steps = 16
    nbytes = weight_bytes(model)

    def products() -> None:
        for _ in range(steps):
            for m in matrices:
                x[m.shape[0]] @ m

    stamps: list[float] = []

    def decode() -> None:
        stamps.clear()
        model.generate(ids, steps + 1, stop=(), on_token=lambda _: stamps.append(time.perf_counter()))

    step_times: list[float] = []

    def timed_decode() -> None:
        decode()
        step_times.append((stamps[-1] - stamps[0]) / steps)

    with blas_threads(threads):
        bandwidth: list[float] = []
        timed = time_round_robin({"products": products, "decode": timed_decode,
                                  "probe": lambda: bandwidth.append(probe.measure(steps * nbytes))}, rounds)
    floor = _best(timed, "products") / steps
    bound_step = nbytes / max(bandwidth)  # seconds a step at the probe's best bandwidth
    return [dict(part="decoder", goal=f"decode >= {GOAL_BOUND_FRACTION:.0%} of the float32 bound "
                                      f"({max(bandwidth) / 1e9:.1f} GB/s)",
                 floor_s=floor, floor_note=f"{nbytes / floor / 1e9:.1f} GB/s, {len(matrices)} products a step",
                 attnkit_s=min(step_times), peer="bound", peer_s=bound_step, goal_ratio=GOAL_BOUND_FRACTION)]


# ----------------------------------------------------------------------------- report

FLOOR_GOALS = {"encoder": 1.15, "flash": 1.2, "decoder": 1.2}  # attnkit's time / its floor's, at most


def assess(row: dict) -> dict:
    """Adds ratio (peer / attnkit), ceiling (peer / floor), budget_s (what the work beside the
    floor may cost for the goal to pass), a verdict, x_floor (attnkit / floor: the path's
    distance to its floor, goal FLOOR_GOALS[part] when the row names its part, else 1.2)
    and floor_verdict to a row of floor_s, attnkit_s, peer_s and goal_ratio; returns it.
    Ratios are peer time over attnkit time, so attnkit may take at most peer / goal. (The
    decoder's "peer" is the bound's step time: its ratio is the fraction of the bound.)"""
    floor, ours, peer, goal = row["floor_s"], row["attnkit_s"], row["peer_s"], row["goal_ratio"]
    row.update(ratio=peer / ours, ceiling=peer / floor, budget_s=peer / goal - floor)
    row["verdict"] = ("PASS now" if row["ratio"] >= goal else
                      "unreachable here" if row["ceiling"] < goal else "reachable: the rest must shrink")
    row["floor_goal"] = FLOOR_GOALS.get(row.get("part", ""), 1.2)
    row["x_floor"] = ours / floor
    row["floor_verdict"] = "PASS" if row["x_floor"] <= row["floor_goal"] else "FAIL"
    if row.get("info"):  # a floor shown beside the goal's own, below any real implementation: no verdict
        row["floor_verdict"] = "info"
    return row


# (header, justify, droppable order: lower goes first, None = always shown)
COLUMNS = (
    ("goal", "left", None), ("floor ms", "right", 6), ("floor", "left", 1), ("attnkit ms", "right", None),
    ("peer ms", "right", 3), ("ratio now", "right", None), ("ceiling", "right", 4), ("budget ms", "right", 2),
    ("verdict", "left", 7), ("x floor", "right", None), ("floor goal", "left", 5),
)
_WRAPPED = ("goal", "floor", "verdict")  # text columns: wrapped at spaces, never narrower than their longest word


def _cells(r: dict) -> list[str]:
    floor, ours, peer = r["floor_s"], r["attnkit_s"], r["peer_s"]
    return [r["goal"], f"{floor * 1e3:,.1f}", r["floor_note"], f"{ours * 1e3:,.1f}", f"{peer * 1e3:,.1f}",
            f"{r['ratio']:.2f}", f"{r['ceiling']:.2f}", f"{r['budget_s'] * 1e3:,.1f}", r["verdict"],
            f"{r['x_floor']:.2f}",
            "info" if r.get("info") else f"<= {r['floor_goal']}x {r['floor_verdict']}"]


def _table(cells: list[list[str]], title: str, widths: dict[int, int | None]):
    """The table of these columns (index -> width; None: the column's own, unwrapped)."""
    from rich.table import Table

    table = Table(title=title)
    for index, width in widths.items():
        name, justify, _ = COLUMNS[index]
        if width is None:
            table.add_column(name, justify=justify, no_wrap=True)
        else:  # wraps at spaces; never narrower than its longest word, so no word is cut
            table.add_column(name, justify=justify, width=width)
    for row in cells:
        table.add_row(*(row[i] for i in widths))
    return table


def render(rows: list[dict], title: str, console) -> list[str]:
    """Print the assessed rows as a table that fits `console`: a terminal's width, text
    columns wrapped at spaces and, when still too wide, whole columns left out (the least
    needed first); a file or pipe gets the table at its full width, nothing wrapped.
    Returns the names of the columns left out."""
    cells = [_cells(r) for r in rows]
    shown = list(range(len(COLUMNS)))
    if not console.is_terminal:  # no width to fit: every cell on one line
        console.width = max(console.width, sum(_widest(cells, i) + 3 for i in shown) + 1)
        console.print(_table(cells, title, dict.fromkeys(shown)))
        return []
    droppable = sorted((order, i) for i, (_, _, order) in enumerate(COLUMNS) if order is not None)
    while sum(_least(cells, i) + 3 for i in shown) + 1 > console.width and droppable:  # 3: a border, 2 spaces
        shown.remove(droppable.pop(0)[1])
    spare = console.width - (sum(_least(cells, i) + 3 for i in shown) + 1)
    widths: dict[int, int | None] = {}
    for i in shown:  # the text columns share what is left, up to their widest cell
        if COLUMNS[i][0] in _WRAPPED:
            extra = max(0, min(spare, _widest(cells, i) - _least(cells, i)))
            widths[i], spare = _least(cells, i) + extra, spare - extra
        else:
            widths[i] = None
    console.print(_table(cells, title, widths))
    dropped = [COLUMNS[i][0] for i in range(len(COLUMNS)) if i not in shown]
    if dropped:
        console.print(f"columns left out to fit {console.width} columns: {', '.join(dropped)} "
                      "(a wider terminal, a file, or --json shows them)")
    return dropped


def _widest(cells: list[list[str]], index: int) -> int:
    """A column's width with every cell on one line."""
    return max([len(COLUMNS[index][0])] + [len(row[index]) for row in cells])


def _least(cells: list[list[str]], index: int) -> int:
    """A column's narrowest width that cuts nothing: a text column's longest word, another's widest cell."""
    if COLUMNS[index][0] not in _WRAPPED:
        return _widest(cells, index)
    return max([len(COLUMNS[index][0])] + [len(word) for row in cells for word in row[index].split()])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", nargs="+", choices=("encoder", "flash", "decoder"),
                        default=["encoder", "flash", "decoder"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096], help="flash: L = S")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if any(L < 1 or L % 512 for L in args.lengths):
        parser.error(f"expected --lengths to be multiples of 512 (whole tiles), got {args.lengths}")
    from attnkit.kernels import _start

    _start.load()  # attnkit's compiled loops start before the clock does, as in `attnkit bench`
    rows: list[dict] = []
    if "encoder" in args.part:
        rows += encoder(args.threads, args.rounds)
    if "flash" in args.part:
        rows += flash(args.threads, args.rounds, args.lengths)
    if "decoder" in args.part:
        rows += decoder(args.threads, args.rounds)
    for r in rows:
        assess(r)
    console = Console(highlight=False, emoji=False)
    render(rows, f"How far each goal can go: floors and ceilings, {args.threads} thread(s), "
                 f"best of {args.rounds} round-robin rounds", console)
    from attnkit import kernels

    info = system_info()
    console.print(f"CPU: {info.get('cpu_model', info['processor'])}; BLAS: {blas_summary()}; NumPy {np.__version__}; "
                  + ("element-wise work: attnkit's compiled kernels (numba)" if kernels.enabled() else
                     f"element-wise work: the NumPy reference ({kernels.reason_disabled()})"))
    console.print("ratio now = peer / attnkit (decoder: bound's step / attnkit's step); ceiling = peer / floor; "
                  "budget = what everything beside the floor may cost for the goal to pass (negative: nothing can); "
                  "x floor = attnkit / floor, the path's distance to its floor")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "rounds": args.rounds, "rows": rows, "system": info,
                       "kernels": kernels.enabled()}, f, indent=2, default=str)


if __name__ == "__main__":
    main()
