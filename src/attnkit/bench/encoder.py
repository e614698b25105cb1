"""Sentence-embedding throughput: attnkit's SentenceEncoder against sentence-transformers
and ONNX Runtime.

All encode the same sentences, on the same CPU, with the same number of
threads, alternating run by run so that all see the same machine load.
Reported: sentences per second for each, the ratios (attnkit / the other; > 1
means attnkit is faster), the largest difference between the sets of
embeddings, and with more than one thread attnkit's gain over its own
one-thread run (timed alongside). The goal row is 256 varied sentences in
batches of 32.

ONNX Runtime runs the sentence-transformers model exported with torch.onnx at
run time into a temporary folder, with length-sorted batches as
sentence-transformers makes them, `intra_op_num_threads` = the thread count,
and sentence-transformers' own Pooling / Normalize modules on its output. It is
optional: without `onnxruntime` (pip install onnxruntime onnx onnxscript) the
suite says so and measures the other two.

Needs torch and sentence-transformers (test dependencies); imported only when
the benchmark runs.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from attnkit.deprecation import keyword_only

_SUBJECTS = (
    "The old lighthouse keeper", "A small team of engineers", "My neighbour's cat",
    "The city council", "Every student in the class", "The new transformer model",
    "Our train to Zürich", "The chef at the corner café", "A curious child",
    "The committee", "Scientists in Antarctica", "The orchestra",
)
_VERBS = (
    "carefully repaired", "quietly watched", "finally approved", "completely ignored",
    "happily explained", "measured", "painted", "translated", "rebuilt", "questioned",
)
_OBJECTS = (
    "the broken clock", "a proposal for 3 new bike lanes", "the attention weights of every head",
    "the long and winding road to the harbour", "an email from 1998", "the results",
    "a recipe with 250 g of flour and two eggs", "the stars above the frozen lake",
    "the budget", "a poem about autumn leaves",
)
_TAILS = (
    "", " before sunrise", " while it was raining heavily outside",
    " because nobody else knew how, and everyone was grateful afterwards",
    " in less than an hour", " during the long meeting on Tuesday afternoon, despite the noise",
    ", which surprised everyone who had been waiting patiently since the early morning",
)


def benchmark_sentences(count: int = 64, seed: int = 0) -> list[str]:
    """`count` deterministic English sentences of varied length (about 6 to 45 tokens)."""
    rng = np.random.default_rng(seed)
    sentences = []
    for _ in range(count):
        parts = [
            _SUBJECTS[rng.integers(len(_SUBJECTS))],
            _VERBS[rng.integers(len(_VERBS))],
            _OBJECTS[rng.integers(len(_OBJECTS))],
        ]
        text = " ".join(parts) + _TAILS[rng.integers(len(_TAILS))]
        if rng.random() < 0.3:
            text += " and " + _OBJECTS[rng.integers(len(_OBJECTS))] + _TAILS[rng.integers(len(_TAILS))]
        sentences.append(text + ".")
    return sentences


def uniform_sentences(count: int = 64) -> list[str]:
    """`count` sentences of one length (25 tokens each): no padding for anyone to save."""
    return [
        f"Report {i}: the committee measured the budget of project {i + 100} "
        "and approved it before the long meeting on Tuesday afternoon ended."
        for i in range(count)
    ]


@dataclass(frozen=True)
class EncoderBenchResult:
    """One side-by-side measurement (times are medians over the repeats)."""

    workload: str
    sentences: int
    tokens: int  # real tokens in the batch, special tokens included
    batch_size: int
    threads: int
    repeats: int
    attnkit_seconds: float
    reference_seconds: float
    attnkit_per_second: float  # sentences per second
    reference_per_second: float
    ratio: float  # attnkit throughput / sentence-transformers throughput
    max_abs_diff: float  # largest |attnkit - sentence-transformers| embedding entry
    ort_seconds: float | None = None  # ONNX Runtime, when installed
    ort_per_second: float | None = None
    ort_ratio: float | None = None  # attnkit throughput / ONNX Runtime throughput
    ort_max_abs_diff: float | None = None  # largest |ONNX Runtime - sentence-transformers| entry
    one_thread_seconds: float | None = None  # attnkit on one thread, timed alongside (threads > 1)
    thread_gain: float | None = None  # attnkit throughput at `threads` / at one thread

    def as_dict(self) -> dict:
        return asdict(self)


class OnnxRuntimeEncoder:
    """A sentence-transformers model run by ONNX Runtime: the transformer exported with
    torch.onnx (dynamic batch and length), sentence-transformers' tokenizer and its
    modules after the transformer (Pooling, Normalize, ...) on the output."""

    def __init__(self, reference: Any, threads: int) -> None:
        import contextlib
        import io
        import logging
        import tempfile
        import warnings

        import onnxruntime
        import torch

        self.reference = reference
        transformer = reference[0]
        self.tokenizer = transformer.tokenizer
        self.max_length = reference.max_seq_length
        self._folder = tempfile.TemporaryDirectory(prefix="attnkit-onnx-")
        path = f"{self._folder.name}/model.onnx"
        sample = self.tokenizer(["a first sentence", "and a second, longer one"], padding=True, return_tensors="pt")
        self.input_names = ("input_ids", "attention_mask", "token_type_ids")

        class LastHiddenState(torch.nn.Module):
            def __init__(self, model: Any) -> None:
                super().__init__()
                self.model = model

            def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> Any:
                return self.model(
                    input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
                ).last_hidden_state

        batch, length = torch.export.Dim("batch"), torch.export.Dim("length")
        args = tuple(sample.get(name, torch.zeros_like(sample["input_ids"])) for name in self.input_names)
        quiet = logging.getLogger("torch")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings(), torch.no_grad():
                warnings.simplefilter("ignore")
                torch.onnx.export(
                    LastHiddenState(transformer.auto_model.eval()),
                    args,
                    path,
                    input_names=list(self.input_names),
                    output_names=["last_hidden_state"],
                    dynamic_shapes={name: {0: batch, 1: length} for name in self.input_names},
                    dynamo=True,
                )
        finally:
            quiet.setLevel(level)
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.session = onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        self.threads = threads

    def encode(self, texts: list[str], batch_size: int) -> np.ndarray:
        """Embeddings (n, dim) float32 in input order, batches sorted by length (longest first)
        as sentence-transformers sorts them."""
        import torch

        order = np.argsort([-len(text) for text in texts], kind="stable")
        out = None
        for start in range(0, len(texts), batch_size):
            batch = order[start : start + batch_size]
            tokens = self.tokenizer(
                [texts[i] for i in batch], padding=True, truncation="longest_first",
                max_length=self.max_length, return_tensors="np",
            )
            ids = tokens["input_ids"].astype(np.int64, copy=False)
            inputs = {
                name: tokens[name].astype(np.int64, copy=False) if name in tokens else np.zeros_like(ids)
                for name in self.input_names
            }
            (hidden,) = self.session.run(None, inputs)
            features = {
                "token_embeddings": torch.from_numpy(hidden),
                "attention_mask": torch.from_numpy(inputs["attention_mask"]),
            }
            with torch.inference_mode():
                for module in list(self.reference)[1:]:
                    features = module(features)
            embeddings = features["sentence_embedding"].numpy()
            if out is None:
                out = np.empty((len(texts), embeddings.shape[1]), np.float32)
            out[batch] = embeddings
        return out


def onnxruntime_available() -> bool:
    """Whether ONNX Runtime and the torch.onnx exporter's packages are installed."""
    import importlib.util

    return all(importlib.util.find_spec(name) is not None for name in ("onnxruntime", "onnx", "onnxscript"))


def _load_contenders(path: str | None, threads: int | None):
    from sentence_transformers import SentenceTransformer

    from attnkit.models.sentence import SentenceEncoder
    from attnkit.models.embedded import minilm_path

    folder = str(path or minilm_path())
    ours = SentenceEncoder.from_pretrained(folder, num_threads=threads)
    return ours, SentenceTransformer(folder, device="cpu")


def measure(
    ours, reference, texts: list[str], *, workload: str, batch_size: int, repeats: int,
    ort: OnnxRuntimeEncoder | None = None, ours_one_thread: Any = None,
) -> EncoderBenchResult:
    """Time `ours.encode`, `reference.encode` (and `ort.encode`, and `ours_one_thread.encode`
    when given) on `texts`, alternating, after a warm-up.

    The caller sets torch's thread count; `ours` uses its own `num_threads`.
    """
    import torch

    def run_reference() -> np.ndarray:
        with torch.inference_mode():
            return reference.encode(texts, batch_size=batch_size, convert_to_numpy=True)

    contenders = {
        "ours": lambda: ours.encode(texts, batch_size=batch_size),
        "reference": run_reference,
    }
    if ort is not None:
        contenders["ort"] = lambda: ort.encode(texts, batch_size)
    if ours_one_thread is not None:
        contenders["one_thread"] = lambda: ours_one_thread.encode(texts, batch_size=batch_size)
    results = {name: run() for name, run in contenders.items()}  # warm-up, and the fidelity check
    expected = results["reference"]
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(repeats):
        for name, run in contenders.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    seconds = {name: statistics.median(values) for name, values in times.items()}
    ours_seconds, reference_seconds = seconds["ours"], seconds["reference"]
    extra: dict[str, float] = {}
    if ort is not None:
        extra.update(
            ort_seconds=seconds["ort"],
            ort_per_second=len(texts) / seconds["ort"],
            ort_ratio=seconds["ort"] / ours_seconds,
            ort_max_abs_diff=float(np.abs(results["ort"] - expected).max()),
        )
    if ours_one_thread is not None:
        extra.update(one_thread_seconds=seconds["one_thread"], thread_gain=seconds["one_thread"] / ours_seconds)
    return EncoderBenchResult(
        workload=workload,
        sentences=len(texts),
        tokens=sum(len(e.ids) for e in ours.tokenizer.encode(texts)),
        batch_size=batch_size,
        threads=ours.num_threads,
        repeats=repeats,
        attnkit_seconds=ours_seconds,
        reference_seconds=reference_seconds,
        attnkit_per_second=len(texts) / ours_seconds,
        reference_per_second=len(texts) / reference_seconds,
        ratio=reference_seconds / ours_seconds,
        max_abs_diff=float(np.abs(expected - results["ours"]).max()),
        **extra,
    )


def run_encoder_benchmark(
    sentences: int = 64,
    *,
    repeats: int = 5,
    threads: int | None = None,
    batch_size: int | None = None,
    path: str | None = None,
    uniform: bool = False,
    onnxruntime: bool = False,
) -> EncoderBenchResult:
    """Time attnkit's SentenceEncoder and sentence-transformers side by side.

    Arguments:
        sentences: how many sentences (`benchmark_sentences`, or `uniform_sentences`).
        repeats: timed runs of each (after one warm-up run each), alternating.
        threads: threads for both (torch.set_num_threads and attnkit's num_threads);
            default the CPUs this process may use.
        batch_size: encode() batch size for both; default all sentences in one batch.
        path: model folder; default the embedded all-MiniLM-L6-v2.
        uniform: sentences of one length instead of varied lengths.
        onnxruntime: also time ONNX Runtime (needs onnxruntime, onnx and onnxscript).

    Returns:
        EncoderBenchResult with medians, the throughput ratios and the max difference.
    """
    import torch

    if repeats < 1 or sentences < 1:
        raise ValueError(f"expected repeats >= 1 and sentences >= 1, got {repeats} and {sentences}")
    ours, reference = _load_contenders(path, threads)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(ours.num_threads)
    try:
        ort = OnnxRuntimeEncoder(reference, ours.num_threads) if onnxruntime else None
        texts = uniform_sentences(sentences) if uniform else benchmark_sentences(sentences)
        return measure(
            ours, reference, texts, workload="uniform" if uniform else "varied",
            batch_size=batch_size or sentences, repeats=repeats, ort=ort,
        )
    finally:
        torch.set_num_threads(previous_threads)


# (workload, sentences, batch size): the goal row is the last, 256 varied sentences in batches of 32
FULL_WORKLOADS = (("varied", 64, 64), ("uniform", 64, 64), ("varied", 256, 32))
QUICK_WORKLOADS = (("varied", 64, 64),)
GOAL_WORKLOAD = ("varied", 256, 32)
GOAL_VS_REFERENCE = 1.3  # attnkit / sentence-transformers, at every thread count
GOAL_VS_ORT = 1.2  # attnkit / ONNX Runtime


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def goal_lines(results: list[EncoderBenchResult]) -> list[str]:
    """The goal lines, PASS / FAIL, for each thread count measured on the goal workload."""
    workload, count, batch = GOAL_WORKLOAD
    lines = []
    for r in results:
        if (r.workload, r.sentences, r.batch_size) != GOAL_WORKLOAD:
            continue
        what = f"{count} {workload} sentences, batch {batch}, {r.threads} thread{'s' if r.threads > 1 else ''}"
        lines.append(
            f"goal: attnkit >= {GOAL_VS_REFERENCE}x sentence-transformers ({what}): {r.ratio:.2f}x "
            f"{_verdict(r.ratio >= GOAL_VS_REFERENCE)}"
        )
        if r.ort_ratio is None:
            lines.append(f"goal: attnkit >= {GOAL_VS_ORT}x ONNX Runtime ({what}): not measured (install "
                         "onnxruntime onnx onnxscript; the quick run skips it)")
        else:
            lines.append(
                f"goal: attnkit >= {GOAL_VS_ORT}x ONNX Runtime ({what}): {r.ort_ratio:.2f}x "
                f"{_verdict(r.ort_ratio >= GOAL_VS_ORT)}"
            )
        if r.thread_gain is not None:
            lines.append(
                f"goal: attnkit at {r.threads} threads >= at 1 thread ({count} {workload}, batch {batch}, "
                f"timed alongside): {r.thread_gain:.2f}x {_verdict(r.thread_gain >= 1.0)}"
            )
    return lines


@keyword_only("quick", "progress", "threads")
def run(*, quick: bool, progress: Any, threads: int | None = None) -> Any:
    """The `attnkit bench encoder` suite (see attnkit.bench for the protocol).

    `threads`: the one thread count to measure; None measures 1 thread, then all
    the CPUs this process may use (when more than one).
    """
    import torch

    from attnkit.bench.measure import blas_summary, system_info
    from attnkit.bench.report import BenchReport
    from attnkit.models.sentence import SentenceEncoder
    from attnkit.runtime import cpu_count

    workloads = QUICK_WORKLOADS if quick else FULL_WORKLOADS
    repeats = 3 if quick else 7
    counts = [threads] if threads else sorted({1, cpu_count()})
    with_ort = not quick and onnxruntime_available()
    progress.total(1 + with_ort * len(counts) + len(workloads) * len(counts))
    progress.step("loading all-MiniLM-L6-v2 twice (attnkit, sentence-transformers)")
    ours, reference = _load_contenders(None, counts[0])
    from attnkit.kernels import elementwise

    elementwise.load()  # the compiled loops start before the clock does (a long process would start them anyway)
    previous_threads = torch.get_num_threads()
    results = []
    try:
        for n in counts:
            torch.set_num_threads(n)
            ours_n = SentenceEncoder(ours.model, ours.tokenizer, head=ours.head, num_threads=n)
            one_thread = SentenceEncoder(ours.model, ours.tokenizer, head=ours.head, num_threads=1) if n > 1 else None
            ort = None
            if with_ort:
                progress.step(f"exporting the model to ONNX for ONNX Runtime ({n} threads)")
                ort = OnnxRuntimeEncoder(reference, n)
            for workload, count, batch_size in workloads:
                progress.step(f"{count} {workload} sentences, batch {batch_size}, {n} threads")
                texts = uniform_sentences(count) if workload == "uniform" else benchmark_sentences(count)
                results.append(
                    measure(ours_n, reference, texts, workload=workload, batch_size=batch_size, repeats=repeats,
                            ort=ort, ours_one_thread=one_thread)
                )
    finally:
        torch.set_num_threads(previous_threads)
    columns = ["sentences", "tokens", "batch", "threads", "attnkit/s", "s-t/s", "ratio", "ORT/s", "ratio ORT",
               "vs 1 thread", "max diff"]
    rows = [
        [
            f"{r.sentences} {r.workload}", r.tokens, r.batch_size, r.threads,
            round(r.attnkit_per_second, 1), round(r.reference_per_second, 1), round(r.ratio, 2),
            None if r.ort_per_second is None else round(r.ort_per_second, 1),
            None if r.ort_ratio is None else round(r.ort_ratio, 2),
            None if r.thread_gain is None else round(r.thread_gain, 2),
            f"{max(r.max_abs_diff, r.ort_max_abs_diff or 0.0):.1e}",
        ]
        for r in results
    ]
    system = system_info()
    notes = goal_lines(results) or [
        f"goal lines need the full run ({GOAL_WORKLOAD[1]} {GOAL_WORKLOAD[0]} sentences, batch {GOAL_WORKLOAD[2]})"
    ]
    notes += [
        f"CPU: {system.get('cpu_model') or system['machine']}, {system['cpus']} CPUs; BLAS: {blas_summary()}",
        f"embeddings agree within {max(max(r.max_abs_diff, r.ort_max_abs_diff or 0.0) for r in results):.1e} "
        "of sentence-transformers' (goal 1e-6)",
        "attnkit/s, s-t/s, ORT/s: sentences per second for attnkit, sentence-transformers and ONNX Runtime; "
        f"ratio = attnkit/s over the other's, medians of {repeats} alternating runs, same thread count; "
        "vs 1 thread: attnkit's throughput over its own on one thread, timed alongside",
    ]
    if not quick and not with_ort:
        notes.append("ONNX Runtime not installed: pip install onnxruntime onnx onnxscript to add it")
    return BenchReport(
        title="all-MiniLM-L6-v2 sentence embeddings: attnkit vs sentence-transformers and ONNX Runtime",
        columns=columns,
        rows=rows,
        notes=notes,
        raw={"results": [r.as_dict() for r in results], "system": system},
    )


__all__ = [
    "EncoderBenchResult",
    "OnnxRuntimeEncoder",
    "benchmark_sentences",
    "goal_lines",
    "measure",
    "onnxruntime_available",
    "run",
    "run_encoder_benchmark",
    "uniform_sentences",
]
