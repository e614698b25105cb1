"""Does attnkit.torch.MultiHeadAttention cost anything over calling
F.scaled_dot_product_attention directly?

Times, side by side and round-robin in one process, the inline production recipe
("direct SDPA": fused QKV F.linear, split, reshape, SDPA, merge, out F.linear on
the same weights) and attnkit.torch.MultiHeadAttention, plus
torch.nn.MultiheadAttention for reference, at one length (default L = 1024),
causal and not, forward (no_grad) and forward + backward. Then
attnkit.torch.TransformerBlock (pre-LN, GELU, d_ff 2048) against the same block
written inline with F.layer_norm, the direct SDPA recipe, F.linear and F.gelu
("vs" = inline time / module time).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/torch_overhead.py \
        [--L 1024] [--rounds 30] [--threads N] [--clock wall|cpu] [--json out.json]

The goal is direct time / module time >= 0.95. Two statistics are reported:
the ratio of the best times, and the median over rounds of the ratio within a
round (both contenders run back to back, so they see about the same load). On a
loaded machine the best times come from lucky idle moments that need not hit
both contenders alike; the paired median is then the steadier number, and
`--threads 1 --clock cpu` (the thread's CPU time) steadier still. The suite
`attnkit bench torch_modules` runs the same measurement over several lengths.
"""

from __future__ import annotations

import argparse
import json

import torch
from rich.console import Console

from attnkit.bench.measure import cpu_count, system_info
from attnkit.bench.torch_modules import GOAL_RATIO, _block_contenders, _contenders, time_round_robin
from attnkit.viz.tables import fitted_table

COLUMNS = ["causal", "pass", "impl", "best ms", "median ms", "best ratio", "paired median ratio"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--L", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=cpu_count())
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: the main thread's CPU time, robust to other load; needs --threads 1")
    parser.add_argument("--no-block", action="store_true", help="skip TransformerBlock against an inline block")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        parser.error("--clock cpu measures one thread: pass --threads 1")
    torch.set_num_threads(args.threads)
    console = Console()
    title = (f"attnkit.torch MHA vs direct SDPA, L=S={args.L}, d_model=512, 8 heads, float32, "
             f"{args.threads} thread(s), {args.rounds} rounds, {args.clock} clock")
    rows, results = [], []
    worst = worst_paired = float("inf")
    for causal in (False, True):
        for passes in ("fwd", "fwd+bwd"):
            fns = _contenders(args.L, causal, passes, with_numpy=False)
            timed = time_round_robin(fns, args.rounds, clock=args.clock)
            base = timed["direct SDPA"]["best_s"]
            for impl, t in timed.items():
                ratio = base / t["best_s"]
                runs = sorted(t["runs_s"])
                rows.append([str(causal), passes, impl, f"{t['best_s'] * 1e3:.1f}",
                             f"{runs[len(runs) // 2] * 1e3:.1f}", f"{ratio:.3f}", f"{t['paired_median']:.3f}"])
                results.append(dict(causal=causal, passes=passes, impl=impl, ratio=ratio, **t))
                if impl == "attnkit.torch MHA":
                    worst = min(worst, ratio)
                    worst_paired = min(worst_paired, t["paired_median"])
    if not args.no_block:
        for causal in (False, True):
            for passes in ("fwd", "fwd+bwd"):
                timed = time_round_robin(_block_contenders(args.L, causal, passes), args.rounds, clock=args.clock)
                base = timed["inline block"]["best_s"]
                for impl, t in timed.items():
                    ratio = base / t["best_s"]
                    runs = sorted(t["runs_s"])
                    rows.append([str(causal), passes, impl, f"{t['best_s'] * 1e3:.1f}",
                                 f"{runs[len(runs) // 2] * 1e3:.1f}", f"{ratio:.3f}", f"{t['paired_median']:.3f}"])
                    results.append(dict(causal=causal, passes=passes, impl=impl, ratio=ratio, **t))
    # columns that do not fit the width (a pipe: 80) go on in blocks, every cell whole
    console.print(fitted_table(COLUMNS, rows, title=title, keys=3,
                               justify=["right" if "ms" in c or "ratio" in c else "left" for c in COLUMNS]))
    for name, value in (("best-time ratio", worst), ("paired median ratio", worst_paired)):
        verdict = "PASS" if value >= GOAL_RATIO else "MISS"
        console.print(f"{verdict}: worst {name} of attnkit.torch MHA over direct SDPA: {value:.3f} "
                      f"(goal >= {GOAL_RATIO})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"L": args.L, "threads": args.threads, "rounds": args.rounds, "clock": args.clock,
                       "worst_best_ratio": worst, "worst_paired_median": worst_paired, "results": results,
                       "system": system_info()}, f, indent=2, default=str)


if __name__ == "__main__":
    main()
