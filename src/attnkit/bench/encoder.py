"""Sentence-embedding throughput: attnkit's SentenceEncoder against sentence-transformers.

Both encode the same batch of sentences (64 by default, of varied lengths), on
the same CPU, with the same number of threads, alternating run by run so that
both see the same machine load. Reported: sentences per second for each, the
ratio (attnkit / sentence-transformers; > 1 means attnkit is faster), and the
largest difference between the two sets of embeddings.

Needs torch and sentence-transformers (test dependencies); imported only when
the benchmark runs.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

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

    def as_dict(self) -> dict:
        return asdict(self)


def _load_contenders(path: str | None, threads: int | None):
    from sentence_transformers import SentenceTransformer

    from attnkit.models.bert import SentenceEncoder
    from attnkit.models.embedded import minilm_path

    folder = str(path or minilm_path())
    ours = SentenceEncoder.from_pretrained(folder, num_threads=threads)
    return ours, SentenceTransformer(folder, device="cpu")


def measure(
    ours, reference, texts: list[str], *, workload: str, batch_size: int, repeats: int
) -> EncoderBenchResult:
    """Time `ours.encode` and `reference.encode` on `texts`, alternating, after a warm-up.

    The caller sets torch's thread count; `ours` uses its own `num_threads`.
    """
    import torch

    def run_reference() -> np.ndarray:
        with torch.inference_mode():
            return reference.encode(texts, batch_size=batch_size, convert_to_numpy=True)

    def run_ours() -> np.ndarray:
        return ours.encode(texts, batch_size=batch_size)

    expected, got = run_reference(), run_ours()  # warm-up, and the fidelity check
    ours_times, reference_times = [], []
    for _ in range(repeats):
        for run, times in ((run_ours, ours_times), (run_reference, reference_times)):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
    ours_seconds = statistics.median(ours_times)
    reference_seconds = statistics.median(reference_times)
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
        max_abs_diff=float(np.abs(expected - got).max()),
    )


def run_encoder_benchmark(
    sentences: int = 64,
    *,
    repeats: int = 5,
    threads: int | None = None,
    batch_size: int | None = None,
    path: str | None = None,
    uniform: bool = False,
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

    Returns:
        EncoderBenchResult with medians, the throughput ratio and the max difference.
    """
    import torch

    if repeats < 1 or sentences < 1:
        raise ValueError(f"expected repeats >= 1 and sentences >= 1, got {repeats} and {sentences}")
    ours, reference = _load_contenders(path, threads)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(ours.num_threads)
    try:
        texts = uniform_sentences(sentences) if uniform else benchmark_sentences(sentences)
        return measure(
            ours, reference, texts, workload="uniform" if uniform else "varied",
            batch_size=batch_size or sentences, repeats=repeats,
        )
    finally:
        torch.set_num_threads(previous_threads)


# (workload, sentences, batch size): the goal is the first row, 64 varied sentences
FULL_WORKLOADS = (("varied", 64, 64), ("uniform", 64, 64), ("varied", 256, 32))
QUICK_WORKLOADS = (("varied", 64, 64),)


def run(quick: bool, progress: Any, threads: int | None = None) -> Any:
    """The `attnkit bench encoder` suite (see attnkit.bench for the protocol)."""
    import torch

    from attnkit.bench.report import BenchReport

    workloads = QUICK_WORKLOADS if quick else FULL_WORKLOADS
    repeats = 3 if quick else 7
    progress.total(1 + len(workloads))
    progress.step("loading all-MiniLM-L6-v2 twice (attnkit, sentence-transformers)")
    ours, reference = _load_contenders(None, threads)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(ours.num_threads)
    results = []
    try:
        for workload, count, batch_size in workloads:
            progress.step(f"{count} {workload} sentences, batch {batch_size}")
            texts = uniform_sentences(count) if workload == "uniform" else benchmark_sentences(count)
            results.append(
                measure(ours, reference, texts, workload=workload, batch_size=batch_size, repeats=repeats)
            )
    finally:
        torch.set_num_threads(previous_threads)
    columns = ["sentences", "tokens", "batch", "threads", "attnkit/s", "s-t/s", "ratio", "max diff"]
    rows = [
        [
            f"{r.sentences} {r.workload}", r.tokens, r.batch_size, r.threads,
            round(r.attnkit_per_second, 1), round(r.reference_per_second, 1),
            round(r.ratio, 2), f"{r.max_abs_diff:.1e}",
        ]
        for r in results
    ]
    goal = results[0]
    notes = [
        f"goal: attnkit >= 1.0x sentence-transformers on 64 varied sentences: "
        f"{goal.ratio:.2f}x, {'met' if goal.ratio >= 1.0 else 'NOT met'}",
        f"embeddings agree within {max(r.max_abs_diff for r in results):.1e} (goal 1e-6)",
        "attnkit/s, s-t/s: sentences per second for attnkit and sentence-transformers; "
        f"ratio = attnkit/s / s-t/s, medians of {repeats} alternating runs, same thread count",
    ]
    return BenchReport(
        title="all-MiniLM-L6-v2 sentence embeddings: attnkit vs sentence-transformers",
        columns=columns,
        rows=rows,
        notes=notes,
        raw={"results": [r.as_dict() for r in results]},
    )


__all__ = [
    "EncoderBenchResult",
    "benchmark_sentences",
    "measure",
    "run",
    "run_encoder_benchmark",
    "uniform_sentences",
]
