"""Decoding speed: attnkit's SmolLM2 against transformers on the same GGUF file.

Both load SmolLM2-135M-Instruct (Q4_1 GGUF, float32 compute), get the same
prompt of about 50 tokens and generate 128 new tokens greedily (no early
stop), with the same number of threads, alternating run by run so that both
see the same machine load. Reported: tokens per second for each (time of the
whole `generate` call, prefill included), the ratio, and whether the two
produced the same tokens.

The second part shows what the KV cache buys: the time of one new token at
growing context lengths, with the cache (one query over the cached keys: flat,
O(T) attention on top of the fixed matrix-vector cost) and without it
(recomputing the whole context for every token: grows with T).

Needs torch and transformers (test dependencies); imported only when the
benchmark runs.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

PROMPT = (
    "The attention mechanism lets every token look at every other token in a single step. "
    "Explain, in plain words and with a small example, why this made transformers faster to train "
    "than recurrent networks, and what the key-value cache changes at inference time:"
)


def run_decoder_benchmark(
    new_tokens: int = 128, rounds: int = 3, contexts: tuple[int, ...] = (32, 128, 512, 1024),
    threads: int | None = None, progress: Any = None,
) -> dict[str, Any]:
    """Measure; returns a JSON-serializable dict (see the module docstring)."""
    import torch
    import transformers
    from threadpoolctl import threadpool_limits

    from attnkit.bench.report import NullProgress
    from attnkit.runtime import cpu_count
    from attnkit.models.embedded import smollm2_gguf_path
    from attnkit.models.auto import AutoCausalLM

    progress = progress or NullProgress()
    threads = threads or cpu_count()
    progress.total(3 + 2 * rounds + len(contexts))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        with threadpool_limits(threads):
            progress.step("loading SmolLM2 in attnkit")
            path = smollm2_gguf_path()
            t0 = time.perf_counter()
            ours = AutoCausalLM.from_pretrained(path)
            load_ours = time.perf_counter() - t0
            progress.step("loading SmolLM2 in transformers")
            t0 = time.perf_counter()
            hf = transformers.AutoModelForCausalLM.from_pretrained(
                str(path.parent), gguf_file=path.name, dtype=torch.float32
            ).eval()
            load_hf = time.perf_counter() - t0

            ids = np.array(ours.tokenizer.encode(PROMPT), dtype=np.int64)
            prompt_tensor = torch.from_numpy(ids[None])
            outputs: dict[str, np.ndarray] = {}

            def run_ours() -> None:
                outputs["attnkit"] = ours.generate(ids, new_tokens, stop=())[len(ids):]

            def run_hf() -> None:
                with torch.inference_mode():
                    out = hf.generate(
                        prompt_tensor, attention_mask=torch.ones_like(prompt_tensor), max_new_tokens=new_tokens,
                        min_new_tokens=new_tokens, do_sample=False, pad_token_id=2,
                    )
                outputs["transformers"] = out[0, len(ids):].numpy()

            progress.step("warming up")
            run_ours()
            run_hf()
            times: dict[str, list[float]] = {"attnkit": [], "transformers": []}
            for _ in range(rounds):  # interleaved, so both see the same load
                for name, fn in (("attnkit", run_ours), ("transformers", run_hf)):
                    progress.step(f"{name}: {new_tokens} tokens")
                    start = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - start)
            rate = {name: new_tokens / min(ts) for name, ts in times.items()}
            same = bool(np.array_equal(outputs["attnkit"], outputs["transformers"]))

            per_token: list[dict[str, float]] = []
            steps, repeats = 8, 3
            rng = np.random.default_rng(0)
            for context in contexts:
                progress.step(f"per-token time at context {context}")
                context_ids = rng.integers(100, 40000, size=context)
                cache = ours.new_cache(1, context + steps * repeats + 1)
                ours(context_ids[None], cache=cache, last_only=True)
                next_id = np.array([[context_ids[-1]]])
                blocks = []
                for _ in range(repeats):  # best of a few blocks of decode steps
                    start = time.perf_counter()
                    for _ in range(steps):
                        ours(next_id, cache=cache)
                    blocks.append((time.perf_counter() - start) / steps)
                start = time.perf_counter()
                ours(context_ids[None], last_only=True)  # no cache: the whole context again
                without_cache = time.perf_counter() - start
                per_token.append(
                    {"context": int(context), "with_cache_ms": 1e3 * min(blocks), "without_cache_ms": 1e3 * without_cache}
                )
    finally:
        torch.set_num_threads(previous)
    return {
        "prompt_tokens": int(len(ids)),
        "new_tokens": int(new_tokens),
        "threads": int(threads),
        "tokens_per_second": rate,
        "ratio": rate["attnkit"] / rate["transformers"],
        "times_s": times,
        "same_tokens": same,
        "load_s": {"attnkit": load_ours, "transformers": load_hf},
        "per_token": per_token,
    }


def run(quick: bool, progress: Any, threads: int | None = None):
    from attnkit.bench.report import BenchReport

    if quick:
        raw = run_decoder_benchmark(new_tokens=16, rounds=1, contexts=(32, 256), threads=threads, progress=progress)
    else:
        raw = run_decoder_benchmark(threads=threads, progress=progress)
    rate = raw["tokens_per_second"]
    rows: list[list[Any]] = [
        [f"greedy tokens/s, {raw['new_tokens']} new", raw["prompt_tokens"], round(rate["attnkit"], 1),
         round(rate["transformers"], 1), round(raw["ratio"], 2)],
    ]
    for entry in raw["per_token"]:
        rows.append(["ms per token, KV cache", entry["context"], round(entry["with_cache_ms"], 1), None, None])
    for entry in raw["per_token"]:
        rows.append(["ms per token, no cache (recompute)", entry["context"], round(entry["without_cache_ms"], 1),
                     None, None])
    notes = [
        f"SmolLM2-135M-Instruct Q4_1 GGUF, float32, {raw['threads']} threads for both; "
        f"prompt {raw['prompt_tokens']} tokens; best of {len(raw['times_s']['attnkit'])} interleaved runs",
        "same greedy tokens as transformers: " + ("yes" if raw["same_tokens"] else "NO"),
        f"goal attnkit >= 1.5x transformers: {'met' if raw['ratio'] >= 1.5 else 'NOT met'} ({raw['ratio']:.2f}x)",
        f"load time: attnkit {raw['load_s']['attnkit']:.1f} s, transformers {raw['load_s']['transformers']:.1f} s",
    ]
    return BenchReport(
        title="Decoder: SmolLM2 greedy decoding, attnkit vs transformers (same GGUF)",
        columns=["measurement", "context tokens", "attnkit", "transformers", "attnkit / transformers"],
        rows=rows,
        notes=notes,
        raw=raw,
    )
