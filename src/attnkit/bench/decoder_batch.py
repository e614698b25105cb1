"""Batched decoding speed (`attnkit bench decoder --batch 1,4,8,16`): many sequences at once.

A server decodes many requests together: each step holds one new token of every running
sequence. This measures the aggregate tokens/s of B sequences decoded together, for each B
asked and at 1 and 2 threads (or `--threads`), on SmolLM2-135M-Instruct's Q4_1 GGUF:

- attnkit: `attnkit.models.llama.batch.BatchStep` over a `PagedKVCache` (the compiled
  batched step; the modules where the kernels are off), B rows a step;
- llama.cpp (when `llama_cpp`, llama-cpp-python, imports; never installed by attnkit):
  its batch API on the same file, `llama_batch_init` / `llama_decode` with one token of
  each sequence a step and `n_seq_max` = B, as its server runs parallel slots.

Each sequence first gets the same ~50-token prompt (prefill, not timed), then `steps`
greedy decode steps are timed (the argmax of each row's logits included, on both sides).
Contenders run interleaved, round by round, so that both see the same machine load; the
best round counts. Ratios: attnkit / llama.cpp at each (threads, B), and each engine's B
against its own B = 1.

Goals (issue 43): at B = 4, 8 and 16, attnkit >= 1.2x llama.cpp at 1 and 2 threads (done
at >= 1.0x); at one thread, attnkit's B = 8 >= 2.5x its B = 1.
"""

from __future__ import annotations

import ctypes
import time
from typing import Any

import numpy as np

GOAL_VS_LLAMA_CPP = 1.2
DONE_VS_LLAMA_CPP = 1.0
GOAL_B8_VS_B1 = 2.5
_QUIET: Any = None  # llama.cpp's log callback (kept alive while it is set)


def _attnkit_runner(model, B: int, prompt: list[int], steps: int, threads: int):
    """A function decoding `steps` greedy steps of B sequences (after a prefill of `prompt`
    each, not timed) through a fresh `BatchStep`; returns (seconds of the steps, this
    thread's CPU seconds of them, tokens (B, steps))."""
    from attnkit.models.llama.batch import BatchStep, StepRow, new_cache

    def run() -> tuple[float, np.ndarray]:
        cache = new_cache(model, tokens=B * (len(prompt) + steps + 16))
        step = BatchStep(model, cache, threads=threads)
        seqs = [cache.add_sequence() for _ in range(B)]
        last = []
        for seq in seqs:
            cache.reserve(seq, len(prompt))
            last.append(step.run([StepRow(seq, t, i == len(prompt) - 1) for i, t in enumerate(prompt)])[0])
        tokens = np.argmax(np.array(last), axis=1)
        out = np.empty((B, steps), np.int64)
        start, cpu = time.perf_counter(), time.thread_time()
        for k in range(steps):
            for seq in seqs:
                cache.reserve(seq, 1)
            logits = step.run([StepRow(seq, int(t), True) for seq, t in zip(seqs, tokens)])
            tokens = np.argmax(logits, axis=1)
            out[:, k] = tokens
        return time.perf_counter() - start, time.thread_time() - cpu, out

    run.compiled = BatchStep(model, new_cache(model, tokens=16), threads=threads).compiled
    return run


class _LlamaCpp:
    """llama.cpp's batch API through llama-cpp-python's bindings: one model, a context per
    (B, threads) with n_seq_max = B."""

    def __init__(self, path) -> None:
        import llama_cpp

        global _QUIET
        self.lib = llama_cpp
        if _QUIET is None:
            _QUIET = llama_cpp.llama_log_callback(lambda level, text, data: None)
            llama_cpp.llama_log_set(_QUIET, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))

    def runner(self, B: int, prompt: list[int], steps: int, threads: int):
        lib = self.lib
        params = lib.llama_context_default_params()
        params.n_ctx = B * (len(prompt) + steps + 16)
        params.n_batch = max(len(prompt), B)
        params.n_ubatch = params.n_batch
        params.n_seq_max = B
        params.n_threads = params.n_threads_batch = threads
        context = lib.llama_init_from_model(self.model, params)
        if not context:
            raise RuntimeError("llama.cpp could not make a context")
        batch = lib.llama_batch_init(max(len(prompt), B), 0, B)
        vocab = self.vocab

        def decode(rows: list[tuple[int, int, int, bool]]) -> None:  # (token, position, sequence, logits)
            batch.n_tokens = len(rows)
            for i, (token, position, seq, wanted) in enumerate(rows):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, position, 1
                batch.seq_id[i][0], batch.logits[i] = seq, wanted
            if lib.llama_decode(context, batch) != 0:
                raise RuntimeError("llama_decode failed")

        def row_logits(i: int) -> np.ndarray:
            return np.ctypeslib.as_array(lib.llama_get_logits_ith(context, i), shape=(vocab,))

        def run() -> tuple[float, np.ndarray]:
            lib.llama_memory_clear(lib.llama_get_memory(context), True)
            tokens = []
            for seq in range(B):
                decode([(t, i, seq, i == len(prompt) - 1) for i, t in enumerate(prompt)])
                tokens.append(int(np.argmax(row_logits(len(prompt) - 1))))
            out = np.empty((B, steps), np.int64)
            start, cpu = time.perf_counter(), time.thread_time()
            for k in range(steps):
                decode([(tokens[seq], len(prompt) + k, seq, True) for seq in range(B)])
                tokens = [int(np.argmax(row_logits(seq))) for seq in range(B)]
                out[:, k] = tokens
            return time.perf_counter() - start, time.thread_time() - cpu, out

        run.free = lambda: (lib.llama_batch_free(batch), lib.llama_free(context))
        return run


def run_batch_benchmark(batches: tuple[int, ...] = (1, 4, 8, 16), steps: int = 32, rounds: int = 3,
                        threads: int | None = None, progress: Any = None) -> dict[str, Any]:
    """Measure; returns a JSON-serializable dict (see the module docstring)."""
    from attnkit.bench.decoder import PROMPT, _thread_counts
    from attnkit.bench.measure import system_info
    from attnkit.bench.report import NullProgress
    from attnkit.models.auto import AutoCausalLM
    from attnkit.models.embedded import smollm2_gguf_path

    progress = progress or NullProgress()
    counts = _thread_counts(threads)
    progress.total(2 + len(counts) * len(batches) * (1 + rounds))
    progress.step("loading SmolLM2 in attnkit")
    path = smollm2_gguf_path()
    model = AutoCausalLM.from_pretrained(path)
    prompt = [int(i) for i in model.tokenizer.encode(PROMPT)]
    progress.step("loading SmolLM2 in llama.cpp (if installed)")
    try:
        lcpp = _LlamaCpp(path)
    except ImportError:
        lcpp = None
    results = []
    for count in counts:
        for B in batches:
            progress.step(f"{count} thread(s), B = {B}: warming up")
            ours = _attnkit_runner(model, B, prompt, steps, count)
            theirs = None if lcpp is None else lcpp.runner(B, prompt, steps, count)
            contenders = {"attnkit": ours, **({} if theirs is None else {"llama.cpp": theirs})}
            outputs = {name: fn()[2] for name, fn in contenders.items()}  # warm: kernels built, pages in
            times: dict[str, list[float]] = {name: [] for name in contenders}
            cpu: dict[str, list[float]] = {name: [] for name in contenders}
            for _ in range(rounds):  # interleaved: both see the same load
                progress.step(f"{count} thread(s), B = {B}: {steps} steps")
                for name, fn in contenders.items():
                    seconds, cpu_seconds, outputs[name] = fn()
                    times[name].append(seconds)
                    cpu[name].append(cpu_seconds)
            if theirs is not None:
                theirs.free()
            rate = {name: B * steps / min(ts) for name, ts in times.items()}
            results.append({"threads": count, "batch": B, "tokens_per_second": rate, "times_s": times,
                            "cpu_tokens_per_second": {name: B * steps / min(ts) for name, ts in cpu.items()},
                            "compiled": ours.compiled,
                            "same_tokens": (bool(np.array_equal(outputs["attnkit"], outputs["llama.cpp"]))
                                            if "llama.cpp" in outputs else None)})
    info = system_info()
    return {"batches": list(batches), "threads": counts, "steps": steps, "prompt_tokens": len(prompt),
            "rounds": rounds, "results": results, "llama_cpp": lcpp is not None,
            "cpu_model": info.get("cpu_model") or info.get("processor") or info.get("machine")}


COLUMNS = ["threads", "B", "attnkit tok/s", "vs its B=1", "llama.cpp tok/s", "vs its B=1", "attnkit / llama.cpp"]


def report_from_raw(raw: dict[str, Any]):
    """The `BenchReport` of a `run_batch_benchmark` result."""
    from attnkit.bench.report import BenchReport

    rows, goals = [], []
    ones = {(r["threads"], name): r["tokens_per_second"][name] for r in raw["results"] if r["batch"] == 1
            for name in r["tokens_per_second"]}
    cpu_ones = {name: r["cpu_tokens_per_second"][name] for r in raw["results"]
                if r["batch"] == 1 and r["threads"] == 1 and "cpu_tokens_per_second" in r
                for name in r["cpu_tokens_per_second"]}
    for r in raw["results"]:
        t, B, rate = r["threads"], r["batch"], r["tokens_per_second"]
        ours, theirs = rate["attnkit"], rate.get("llama.cpp")
        mine, their_one = ones.get((t, "attnkit")), ones.get((t, "llama.cpp"))
        ratio = None if theirs is None else ours / theirs
        rows.append([t, B, round(ours, 1), None if mine is None else f"{ours / mine:.2f}x",
                     None if theirs is None else round(theirs, 1),
                     None if theirs is None or their_one is None else f"{theirs / their_one:.2f}x",
                     None if ratio is None else f"{ratio:.2f}x"])
        # at one thread the goals read the calling thread's CPU time when measured (both engines
        # compute on it; a loaded machine's waits are not in it); at two, wall clock
        by_cpu = t == 1 and "cpu_tokens_per_second" in r
        judged = r["cpu_tokens_per_second"] if by_cpu else rate
        clock = "CPU time" if by_cpu else "wall clock"
        if B >= 4:
            ratio = judged["attnkit"] / judged["llama.cpp"] if "llama.cpp" in judged else None
            goals.append(f"{t} thread(s), B = {B}: goal attnkit >= {GOAL_VS_LLAMA_CPP}x llama.cpp's batch API (done at "
                         f"{DONE_VS_LLAMA_CPP}x): " + ("not measured (llama-cpp-python not installed)" if ratio is None
                         else f"{'PASS' if ratio >= GOAL_VS_LLAMA_CPP else 'FAIL'} ({ratio:.2f}x by {clock}; "
                         f"{'done' if ratio >= DONE_VS_LLAMA_CPP else 'not done'})"))
        one = cpu_ones.get("attnkit") if by_cpu else mine
        if t == 1 and B == 8 and one:
            gain = judged["attnkit"] / one
            goals.append(f"1 thread: goal attnkit B = 8 >= {GOAL_B8_VS_B1}x its B = 1: "
                         f"{'PASS' if gain >= GOAL_B8_VS_B1 else 'FAIL'} ({gain:.2f}x by {clock})")
    compiled = all(r["compiled"] for r in raw["results"])
    cpu = [r for r in raw["results"] if r["threads"] == 1 and "cpu_tokens_per_second" in r]
    cpu_note = None
    if cpu:
        parts = []
        for r in cpu:
            rate = r["cpu_tokens_per_second"]
            theirs = rate.get("llama.cpp")
            parts.append(f"B = {r['batch']}: attnkit {rate['attnkit']:.1f}"
                         + ("" if theirs is None else f", llama.cpp {theirs:.1f} ({rate['attnkit'] / theirs:.2f}x)"))
        cpu_note = ("1 thread, by this thread's CPU time (what a loaded machine does not inflate; both engines "
                    "compute on the calling thread at one thread), tokens/s: " + "; ".join(parts))
    notes = [f"CPU: {raw['cpu_model']}",
             f"SmolLM2-135M-Instruct Q4_1 GGUF; each of B sequences: a {raw['prompt_tokens']}-token prompt (not "
             f"timed), then {raw['steps']} greedy steps of one token each; aggregate tokens/s = B x steps / seconds, "
             f"best of {raw['rounds']} interleaved rounds",
             "attnkit: BatchStep over a PagedKVCache (" + ("the compiled batched step" if compiled else
                                                           "the module fallback: the compiled kernels are off") + ")",
             "llama.cpp: llama_batch_init / llama_decode, one token of each sequence a step, n_seq_max = B"
             if raw["llama_cpp"] else "llama.cpp: not installed (pip install llama-cpp-python to add it)"]
    if cpu_note:
        notes.append(cpu_note)
    return BenchReport(title="Decoder: B sequences decoded together, aggregate tokens/s (same GGUF)",
                       columns=COLUMNS, rows=rows, notes=notes, raw=raw, goals=goals)
