"""The "attnkit_flash" route with a sliding window: the band in the kernel against query slicing.

transformers' FlashAttention route calls `attnkit.hf.flash_api.flash_attn_func` with
`window_size=(left, right)`. That function used to cut the queries into blocks
of 128 rows and ran `attnkit.torch.flash_attention` on each with a dense (128, span)
boolean mask, because the kernel took no window; now the window goes to the kernel,
which skips the tiles outside the band forward and backward. This script times both
in one run, forward + backward, on the same inputs and thread count, and prints
their ratio. The old path is kept here (`sliced`), as it was, for the comparison.

    python benchmarks/hf_flash_window.py --length 4096 --heads 8 --dim 64 --window 256 1024
"""

from __future__ import annotations

import argparse
import time

import torch

from attnkit.hf.flash_api import flash_attn_func
from attnkit.torch.flash import flash_attention

BLOCK_Q = 128  # the old path's query block


def sliced(q, k, v, window: tuple[int, int]) -> torch.Tensor:
    """The old flash_attn_func body for a causal sliding window (bottom-right aligned):
    q (B, L, H, E), k, v (B, S, H, E) -> (B, L, H, E)."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # (B, H, L, E)
    L, S = q.shape[-2], k.shape[-2]
    left, right = window
    right = 0 if right < 0 else min(right, 0)  # causal
    offset = S - L
    outputs = []
    for i0 in range(0, L, BLOCK_Q):
        i1 = min(i0 + BLOCK_Q, L)
        lo = 0 if left < 0 else min(S, max(0, i0 + offset - left))
        hi = max(lo, min(S, i1 - 1 + offset + right + 1))
        position = torch.arange(i0, i1)[:, None] + offset  # (bq, 1)
        j = torch.arange(lo, hi)[None, :]  # (1, span)
        allowed = (j >= position - left) & (j <= position + right)
        outputs.append(flash_attention(q[..., i0:i1, :], k[..., lo:hi, :], v[..., lo:hi, :], attn_mask=allowed))
    return torch.cat(outputs, dim=-2).transpose(1, 2)


def banded(q, k, v, window: tuple[int, int]) -> torch.Tensor:
    """Today's route: the window passed straight to the kernel."""
    return flash_attn_func(q, k, v, causal=True, window_size=window)


def fwd_bwd(fn, q, k, v, window, d_out) -> float:
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    start = time.perf_counter()
    out = fn(q, k, v, window)
    out.backward(d_out)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--window", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    B, L, H, E = 1, args.length, args.heads, args.dim
    q, k, v, d_out = (torch.randn(B, L, H, E, generator=g) for _ in range(4))
    print(f"torch {torch.__version__}, {args.threads} thread(s), float32, B={B} L={L} H={H} E={E}, causal, "
          f"forward + backward, best of {args.repeat} (interleaved)")
    for w in args.window:
        window = (w - 1, 0)  # Mistral's sliding_window=w, as transformers passes it
        diff = (sliced(q, k, v, window) - banded(q, k, v, window)).abs().max().item()
        times = {"sliced": [], "banded": []}
        for _ in range(args.repeat):
            for name, fn in (("sliced", sliced), ("banded", banded)):
                times[name].append(fwd_bwd(fn, q, k, v, window, d_out))
        old, new = min(times["sliced"]), min(times["banded"])
        print(f"window_size={window}: sliced queries + dense masks {old:.3f} s, window in the kernel {new:.3f} s, "
              f"speed-up {old / new:.2f}x (outputs differ by {diff:.1e})")


if __name__ == "__main__":
    main()
