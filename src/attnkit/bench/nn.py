"""The nn suite: attnkit.nn's NumPy TransformerBlock and MultiHeadAttention
against torch.nn.TransformerEncoderLayer and torch.nn.MultiheadAttention.

all-MiniLM-L6-v2's layer: d_model 384, 12 heads, d_ff 1536, exact GELU,
post-LN; float32; padded batches (half the sequences padded to half length,
passed as attnkit's key_mask and torch's src_key_padding_mask). torch runs
under inference_mode, where TransformerEncoderLayer takes its fused fast path
and MultiheadAttention (need_weights=False) its SDPA path. The torch modules
are built from the attnkit ones (`attnkit.torch.to_torch`), so both compute the same function
on the same weights; the suite checks that the outputs agree. Contenders are
timed round-robin; best of the rounds. "speed-up" is torch's time over
attnkit's (> 1: attnkit is faster).
"""

from __future__ import annotations

from attnkit.bench.report import BenchReport, Progress
from attnkit.bench.measure import best_times_interleaved, blas_summary
from attnkit.deprecation import keyword_only
from attnkit.runtime import cpu_count

D_MODEL, HEADS, D_FF = 384, 12, 1536
FULL_SHAPES = ((1, 16), (32, 32), (32, 128))
QUICK_SHAPES = ((8, 32),)
COLUMNS = ["B x L", "module", "attnkit ms", "torch ms", "speed-up", "max |diff|"]


@keyword_only("quick", "progress", "threads")
def run(*, quick: bool, progress: Progress, threads: int | None = None) -> BenchReport:
    import numpy as np
    import torch
    from threadpoolctl import threadpool_limits

    from attnkit import nn
    from attnkit.torch.interop import to_torch

    threads = threads or cpu_count()
    shapes = QUICK_SHAPES if quick else FULL_SHAPES
    progress.total(len(shapes))
    rows, raw = [], {"threads": threads, "shapes": [], "blas": blas_summary()}
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for B, L in shapes:
            progress.step(f"B={B}, L={L}")
            rng = np.random.default_rng(0)
            x = rng.standard_normal((B, L, D_MODEL), dtype=np.float32)
            key_mask = np.ones((B, L), bool)
            key_mask[B // 2 :, L // 2 :] = False
            block = nn.TransformerBlock(D_MODEL, HEADS, D_FF, activation="gelu", seed=0)
            layer = to_torch(block)
            x_t, padding_t = torch.from_numpy(x), torch.from_numpy(~key_mask)
            fns = {
                "block": lambda: block(x, key_mask=key_mask),
                "torch block": lambda: layer(x_t, src_key_padding_mask=padding_t),
                "mha": lambda: block.attn(x, key_mask=key_mask).output,
                "torch mha": lambda: layer.self_attn(x_t, x_t, x_t, key_padding_mask=padding_t, need_weights=False)[0],
            }
            with threadpool_limits(threads), torch.inference_mode():
                times = best_times_interleaved(fns, budget_s=1.0 if quick else 4.0, max_rounds=3 if quick else 9)
                outputs = {name: np.asarray(fn()) for name, fn in fns.items()}
            real = key_mask[..., None]  # torch's fast path may leave padded rows undefined
            for name, label in (("block", "TransformerBlock"), ("mha", "MultiHeadAttention")):
                ours, theirs = times[name][0], times[f"torch {name}"][0]
                diff = float(np.abs(np.where(real, outputs[name] - outputs[f"torch {name}"], 0)).max())
                rows.append([f"{B} x {L}", label, round(ours * 1e3, 3), round(theirs * 1e3, 3),
                             round(theirs / ours, 2), f"{diff:.1e}"])
                raw["shapes"].append({"B": B, "L": L, "module": label, "attnkit_s": times[name][1],
                                      "torch_s": times[f"torch {name}"][1], "max_abs_diff": diff})
    finally:
        torch.set_num_threads(previous_threads)
    notes = [f"float32, {threads} thread(s) each; d_model {D_MODEL}, {HEADS} heads, d_ff {D_FF}, exact GELU, post-LN",
             f"BLAS: {raw['blas']}"]
    return BenchReport(title="attnkit.nn vs torch.nn (MiniLM-sized layer)", columns=COLUMNS, rows=rows,
                       notes=notes, raw=raw)
