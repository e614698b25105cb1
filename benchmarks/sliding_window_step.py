"""A sliding window on the compiled decode step: SmolLM2 with a window against SmolLM2 without.

SmolLM2's GGUF (Q4_1 blocks) is loaded twice; on one copy every layer's attention becomes a
`QuantizedSlidingWindowSelfAttention` over the same blocks (as a Mistral's), the other keeps
full attention. Both prefill the same prompt, then the script times their compiled decode
steps in alternating rounds in one process (each round: the same positions, cropped back),
and prints the median step of each and their ratio (no window / window: >= 1 means the
windowed model is no slower). A window wider than the context measures what the window
costs by itself (the band never drops a key); a narrower one also skips the old keys.

    python benchmarks/sliding_window_step.py --context 600 --windows 4096 256 --threads 1 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from attnkit.models import smollm2_gguf_path
from attnkit.models.llama import LlamaForCausalLM, QuantizedSlidingWindowSelfAttention, compiled_step_reason
from attnkit.runtime import blas_threads


def windowed(model: LlamaForCausalLM, window: int) -> LlamaForCausalLM:
    """`model` with a sliding window of `window` on every layer (the same blocks)."""
    for block in model.layers:
        a = block.attn
        block.attn = QuantizedSlidingWindowSelfAttention(
            a.q_proj, a.k_proj, a.v_proj, a.out_proj, num_heads=a.num_heads, num_kv_heads=a.num_kv_heads,
            head_dim=a.head_dim, window=window)
    return model


def steps(model, cache, start: int, tokens: list[int]) -> list[float]:
    """Seconds of each decode step of `tokens` from cache length `start` (cropped back first)."""
    cache.crop(start)
    times = []
    for token in tokens:
        began = time.perf_counter()
        model(np.array([[token]]), cache=cache)
        times.append(time.perf_counter() - began)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=600, help="prompt tokens before the timed steps")
    parser.add_argument("--steps", type=int, default=32, help="decode steps a round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--windows", type=int, nargs="+", default=[4096, 256])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    path = smollm2_gguf_path()
    plain = LlamaForCausalLM.from_gguf(path, quantized=True)
    prompt = rng.integers(100, plain.config.vocab_size, args.context)
    tokens = [int(t) for t in rng.integers(100, plain.config.vocab_size, args.steps)]
    models = {"none": plain}
    for window in args.windows:
        models[str(window)] = windowed(LlamaForCausalLM.from_gguf(path, quantized=True), window)
    caches = {}
    for name, model in models.items():
        cache = caches[name] = model.new_cache(1, args.context + args.steps + 1)
        model(prompt[None], cache=cache)  # prefill (modules)
        assert compiled_step_reason(model, np.array([[tokens[0]]]), np.array([[args.context]]), cache) is None
    for threads in args.threads:
        with blas_threads(threads):
            for model in models.values():
                model.single_thread_decode = None if threads == 1 else False  # 2: the step on 2 parts
            best = {name: [] for name in models}
            for _ in range(args.rounds):
                for name, model in models.items():
                    best[name].append(statistics.median(steps(model, caches[name], args.context, tokens)))
            base = min(best["none"])
            line = [f"threads {threads}: no window {base * 1e3:.2f} ms"]
            for window in args.windows:
                ms = min(best[str(window)])
                line.append(f"window {window} {ms * 1e3:.2f} ms (ratio {base / ms:.3f})")
            print("; ".join(line))


if __name__ == "__main__":
    main()
