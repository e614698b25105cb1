"""`attnkit bench serve`: `attnkit serve` under load, measured with the openai client.

One run starts the server in this process (`BackgroundServer`, SmolLM2, its engine with
`--max-batch` = the number of clients) and measures, with streamed chat requests that share
a system prompt (about 600 tokens; quick: 100, with 2 clients) and user messages of mixed lengths:

- throughput: aggregate completion tokens/s of N concurrent clients (total completion tokens
  over the wall time from the first request to the last answer) against one client sending
  the same N requests one after another (ratio; goal >= 2.5x at 8 clients);
- time to first token: a request with a system prompt the server has not seen against a
  repeat of that system prompt with another question (ratio; goal <= 0.3x: the repeat reads
  the prefix from the cache);
- inter-token latency: the gaps between streamed chunks of the concurrent clients, p50 and
  p99, and p99 of the gaps of N - 1 running streams while a 1,000-token prompt (quick: 300)
  arrives (quick: 150), against the median gap of one client alone (goal <= 2x);
- KV memory: the bytes of the blocks live sequences hold against the bytes their keys and
  values need (their tokens x bytes per token), after the step that held the most bytes
  (goal <= 1.1x; a shared prefix counts once in the first, once per sequence in the second).

A chunk holds one token or more (text held back while it could end in half a character
or a stop string goes out with the next), so chunk gaps are token gaps or sums of them.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from attnkit.bench.report import BenchReport, Progress

__all__ = ["run"]

GOAL_THROUGHPUT = 2.5
GOAL_TTFT = 0.3
GOAL_GAP = 2.0
GOAL_KV = 1.1
QUESTIONS = [
    "What is attention?",
    "Explain in two sentences why a transformer needs positional information, and what rotary embeddings do.",
    "Name three colours.",
    "Summarize the following notes: " + "the cache holds keys and values of every earlier token; " * 12,
    "Why is the sky blue?",
    "Write a haiku about matrices.",
    "List the planets of the solar system in order from the sun, with one fact about each of them. " * 2,
    "What does a tokenizer do?",
]


def _system_prompt(tokenizer: Any, tokens: int, salt: str) -> str:
    """A system prompt of about `tokens` tokens, made distinct by `salt`."""
    sentence = ("You are a careful assistant for a library that computes attention. Answer briefly, "
                "cite the relevant function, and prefer exact numbers to adjectives. ")
    text = f"{salt} "
    while len(tokenizer.encode(text)) < tokens:
        text += sentence
    return text


def _stream(client: Any, model: str, system: str, question: str, max_tokens: int) -> dict[str, Any]:
    """One streamed chat request: its start, chunk arrival times and usage."""
    start = time.perf_counter()
    times, usage = [], None
    for chunk in client.chat.completions.create(
            model=model, messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
            max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
    end = time.perf_counter()
    return {"start": start, "end": end, "times": times, "tokens": usage.completion_tokens,
            "cached": usage.prompt_tokens_details.cached_tokens, "prompt": usage.prompt_tokens,
            "ttft": (times[0] - start) if times else end - start}


def _gaps(results: list[dict[str, Any]], window: tuple[float, float] | None = None) -> list[float]:
    gaps = []
    for result in results:
        for a, b in zip(result["times"], result["times"][1:]):
            if window is None or (b > window[0] and a < window[1]):
                gaps.append(b - a)
    return gaps


def _percentile(values: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(values, q)) if values else float("nan")


def run(*, quick: bool, progress: Progress, threads: int | None = None, model: str = "smollm2") -> BenchReport:
    """The measurements above on decoder `model` (a name or path `attnkit serve` takes)."""
    import numpy as np
    from threadpoolctl import threadpool_limits

    from attnkit.runtime import cpu_count
    from attnkit.serve.server import BackgroundServer, create_app

    import openai

    threads = threads or cpu_count()
    clients = 2 if quick else 8
    max_tokens = 6 if quick else 48
    system_tokens, long_tokens = (100, 150) if quick else (600, 1000)
    progress.total(6)
    name = model
    progress.step(f"loading {name} and starting the server")
    app = create_app(models=[name], max_new_tokens=256, max_batch=clients, kv_tokens=32768)
    pool = app.state.models
    decoder = pool.get(name)
    engine = pool.engine(name)
    if engine is None:
        raise RuntimeError(f"{name} runs without the engine here: {pool.engine_reasons.get(name)}")
    tokenizer = decoder.tokenizer
    config = decoder.config
    token_bytes = 2 * config.num_layers * config.num_kv_heads * config.head_dim * engine.cache.keys.dtype.itemsize
    raw: dict[str, Any] = {"clients": clients, "max_tokens": max_tokens, "threads": threads,
                           "system_tokens": system_tokens, "long_prompt_tokens": long_tokens,
                           "batch_step_compiled": bool(engine.step.compiled), "batch_step_reason": engine.step.reason}
    with threadpool_limits(threads, user_api="blas"), BackgroundServer(app) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="bench", max_retries=0, timeout=3600)
        _stream(client, name, "Warm up.", "Hi", 2)

        progress.step("time to first token: a new system prompt, then a repeat")
        system = _system_prompt(tokenizer, system_tokens, "Session 7.")
        first = _stream(client, name, system, QUESTIONS[0], 1)
        repeat = _stream(client, name, system, QUESTIONS[2], 1)
        raw["ttft"] = {"first_s": first["ttft"], "repeat_s": repeat["ttft"], "repeat_cached_tokens": repeat["cached"],
                       "prompt_tokens": repeat["prompt"]}

        questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(clients)]
        progress.step("one client alone, the same requests one after another")
        alone = [_stream(client, name, system, question, max_tokens) for question in questions]
        alone_rate = sum(r["tokens"] for r in alone) / sum(r["end"] - r["start"] for r in alone)
        alone_gap = _percentile(_gaps(alone), 50)

        progress.step(f"{clients} concurrent clients")
        engine.reset_peak()
        with ThreadPoolExecutor(clients) as workers:
            together = list(workers.map(lambda q: _stream(client, name, system, q, max_tokens), questions))
        peak = {"bytes": engine.counters["peak_bytes"], "tokens": engine.counters["peak_tokens"]}
        wall = max(r["end"] for r in together) - min(r["start"] for r in together)
        rate = sum(r["tokens"] for r in together) / wall
        gaps = _gaps(together)

        progress.step(f"{clients - 1} streams while a {long_tokens}-token prompt arrives")
        long_question = _system_prompt(tokenizer, long_tokens, "Read this long note.")
        streams: list[dict[str, Any]] = []
        with ThreadPoolExecutor(clients) as workers:
            running = [workers.submit(_stream, client, name, system, QUESTIONS[i % len(QUESTIONS)],
                                      max_tokens * 2) for i in range(clients - 1)]
            deadline = time.perf_counter() + 600
            while engine.stats()["decode_rows"] == 0 or engine.stats()["waiting"] or \
                    engine.stats()["running"] < clients - 1:
                if time.perf_counter() > deadline or all(f.done() for f in running):
                    break
                time.sleep(0.01)
            arrival = time.perf_counter()
            long = _stream(client, name, "You read notes.", long_question, 1)
            streams = [f.result() for f in running]
        window = (arrival, long["start"] + long["ttft"])
        during = _gaps(streams, window)

    held = peak["bytes"] / (peak["tokens"] * token_bytes) if peak["tokens"] else float("nan")
    ttft_ratio = repeat["ttft"] / first["ttft"]
    during_ratio = _percentile(during, 99) / alone_gap
    raw.update(alone={"tokens_per_s": alone_rate, "median_gap_s": alone_gap, "tokens": sum(r["tokens"] for r in alone)},
               together={"tokens_per_s": rate, "wall_s": wall, "tokens": sum(r["tokens"] for r in together),
                         "gap_p50_s": _percentile(gaps, 50), "gap_p99_s": _percentile(gaps, 99)},
               long_prompt={"gap_p99_s": _percentile(during, 99), "gaps": len(during), "ttft_s": long["ttft"]},
               kv={"peak_bytes": peak["bytes"], "tokens_held": peak["tokens"], "bytes_per_token": token_bytes},
               engine=engine.stats())
    ms = 1e3
    rows = [
        ["completion tokens/s", round(rate, 1), f"1 client: {alone_rate:.1f}", round(rate / alone_rate, 2)],
        ["time to first token (ms)", round(repeat["ttft"] * ms, 1), f"new prompt: {first['ttft'] * ms:.1f}",
         round(ttft_ratio, 2)],
        ["chunk gap p50 (ms)", round(_percentile(gaps, 50) * ms, 1), f"1 client: {alone_gap * ms:.1f}",
         round(_percentile(gaps, 50) / alone_gap, 2)],
        ["chunk gap p99 (ms)", round(_percentile(gaps, 99) * ms, 1), f"1 client: {alone_gap * ms:.1f}",
         round(_percentile(gaps, 99) / alone_gap, 2)],
        [f"gap p99 as a {long_tokens}-token prompt arrives (ms)", round(_percentile(during, 99) * ms, 1),
         f"1 client: {alone_gap * ms:.1f}", round(during_ratio, 2)],
        ["KV bytes held (MiB)", round(peak["bytes"] / 2**20, 2),
         f"needed: {peak['tokens'] * token_bytes / 2**20:.2f}", round(held, 2)],
    ]
    notes = [
        f"{name} through `attnkit serve`'s engine (max_batch {clients}, step_tokens {engine.step_tokens}), "
        f"{clients} openai clients streaming chat at temperature 0, max_tokens {max_tokens}; "
        f"a {system_tokens}-token system prompt shared",
        f"batched step: {'compiled' if engine.step.compiled else 'modules (' + str(engine.step.reason) + ')'}",
        f"the repeat read {repeat['cached']} of its {repeat['prompt']} prompt tokens from the prefix cache",
        "gaps are between streamed chunks (a chunk is one token or more); ratios are against one client "
        "sending the same requests one after another",
        "KV: bytes of the blocks live sequences held at the peak, against their tokens x bytes per token "
        "(a shared prefix block counts once in the first)",
        f"while the long prompt arrived, the streams' p99 gap was "
        f"{during_ratio * alone_gap / _percentile(gaps, 99):.2f}x the p99 of {clients} streams with no prompt arriving",
    ]
    goals = [
        f"{'PASS' if rate / alone_rate >= GOAL_THROUGHPUT else 'FAIL'} {clients} clients' completion tokens/s: "
        f"{rate / alone_rate:.2f}x one client (goal >= {GOAL_THROUGHPUT}x at 8)",
        f"{'PASS' if ttft_ratio <= GOAL_TTFT else 'FAIL'} time to first token of a repeated system prompt: "
        f"{ttft_ratio:.2f}x the first (goal <= {GOAL_TTFT}x)",
        f"{'PASS' if during_ratio <= GOAL_GAP else 'FAIL'} gap p99 while a {long_tokens}-token prompt arrives: "
        f"{during_ratio:.2f}x one client's median (goal <= {GOAL_GAP}x)",
        f"{'PASS' if held <= GOAL_KV else 'FAIL'} KV bytes held: {held:.2f}x the keys and values needed "
        f"(goal <= {GOAL_KV}x)",
    ]
    return BenchReport(title=f"attnkit serve under load ({clients} clients, {threads} threads)",
                       columns=["measure", "value", "against", "ratio"], rows=rows, notes=notes, raw=raw,
                       goals=goals)
