"""The `CausalLM` base class of attnkit's decoders: forward, generation, streaming, attention maps.

Every decoder (Llama/SmolLM2, GPT-2) subclasses `CausalLM` and supplies
`new_cache`, the residual stream piece by piece (`embed_inputs`, `run_layers` from
any layer to any layer, `final_norm`: `_hidden_states` composes them, and
`attnkit.interpret` reads and patches between them) and `_logits` (the output
head). Everything else is written once here:

- `model(input_ids)` -> logits (B, T, vocab), through a KV cache (a fresh one if
  none is given), so the same code path serves prompts and decode steps.
- Left-padded batches: `attention_mask` (B, T) marks real tokens; positions
  count real tokens only, and padded keys are never attended to, so each row of
  a batch generates exactly what it would alone.
- `generate` / `stream`: prefill the prompt (in chunks if asked), then one token
  at a time; greedy when `temperature == 0`, otherwise temperature, top-k and
  top-p (nucleus) sampling in the order transformers applies them, from a
  seeded NumPy Generator (the helpers are in `attnkit.models.sampling`).
- `attention(text)`: the attention weights of every layer and head for a prompt,
  recorded with `attnkit.record_attention` (which works on any model).

The attention backend is an attribute of each layer's attention module:
`model.set_attention_backend("flash")` (from `Module`) switches them all.

Loading is not here: `attnkit.models.auto.AutoCausalLM.from_pretrained(path)`
picks the subclass for a checkpoint (this base class never imports its subclasses).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from attnkit.models.sampling import _check_sampling, apply_repetition_penalty, prepare_prompts, sample_next_token
from attnkit.nn.cache import KVCache
from attnkit.nn.interface import record_attention
from attnkit.nn.module import Module
from attnkit.runtime import FastestSchedule, blas_thread_count, blas_threads, worker_threads

__all__ = ["AttentionMap", "CausalLM"]


class AttentionMap(NamedTuple):
    """Attention of a decoder over one prompt.

    tokens:  the T tokens as text pieces.
    weights: (layers, heads, T, T) float32; row i is how query i spreads over keys 0..i.

    Unpacks like the encoder's: `tokens, weights = model.attention(text)`.
    """

    tokens: list[str]
    weights: np.ndarray


# ----------------------------------------------------------------------------- the base class


class CausalLM(Module):
    """A decoder-only language model: token ids -> next-token logits.

    Subclasses set `config` (with `num_layers`, `vocab_size`, `max_position_embeddings`,
    `eos_token_id`), optionally `tokenizer` (an `attnkit.models.chat.DecoderTokenizer`), and
    implement `new_cache`, `_hidden_states` and `_logits`.

    Threads. A decode step (one new token per sequence) is a chain of memory-bound
    matrix-vector products: a second OpenBLAS thread reads the weights faster on an idle
    CPU, but costs a lot on a busy one (its threads spin while they wait for each other;
    on a shared 2-core machine two threads made decoding several times slower, see
    docs/benchmarks.md, "Measurements behind design choices"). So with more than
    one BLAS thread allowed (`attnkit.runtime.blas_thread_count()`), decode steps time one
    BLAS thread against all of them as they go (`attnkit.runtime.FastestSchedule`: each on
    the first steps, then the faster one, re-timing the other every
    `DECODE_RETIME_EVERY` steps) and run the faster: more threads never make decoding
    slower for long. `single_thread_decode` (default None: choose by timing) fixes the
    choice: True, one thread; False, every thread. A short prompt, a forward pass over at
    most `single_thread_rows` (default 64) token rows in all (B * T), runs on one thread
    unless `single_thread_decode` is False: its products are too small to split (under
    load two threads took many times one thread's time, and on an idle machine they saved
    little); a model on
    quantized blocks still spreads such a pass's products over the threads allowed, each
    thread claiming dequantized tiles as it comes free with its own one-thread BLAS call
    (`attnkit.runtime.run_claimed`: a thread held up elsewhere leaves its tiles to the others,
    so a busy CPU costs at most one tile). Longer prompts keep every BLAS thread. After such
    a pass OpenBLAS's threads spin for a while before they sleep, taking a CPU from the
    decode steps that follow (a first two-thread step after a threaded prefill was timed
    many times too slow): steps that
    start within `BLAS_SPIN_SECONDS` of it run on the current choice but are not timed.
    """

    config: Any
    tokenizer: Any = None
    single_thread_decode: bool | None = None
    single_thread_rows: int = 64
    DECODE_SCHEDULES = ("one thread", "BLAS threads")
    DECODE_RETIME_EVERY = 32  # decode steps between re-timings of the schedule not in use
    BLAS_SPIN_SECONDS = 0.15  # after a pass on BLAS threads, decode steps this soon are not timed

    # -- what subclasses implement ---------------------------------------------------------
    def new_cache(self, batch_size: int, max_length: int) -> KVCache:
        raise NotImplementedError

    def _hidden_states(self, ids: np.ndarray, positions: np.ndarray, cache: KVCache) -> np.ndarray:
        """ids (B, T), positions (B, T) -> final hidden states (B, T, d): embed_inputs, every
        layer (run_layers), final_norm. A subclass implements those three, or this."""
        return self.final_norm(self.run_layers(self.embed_inputs(ids, positions), positions, cache))

    def _logits(self, hidden: np.ndarray) -> np.ndarray:
        """(B, T, d) -> (B, T, vocab) float32."""
        raise NotImplementedError

    # -- the residual stream, piece by piece (what attnkit.interpret reads and patches) ------
    def embed_inputs(self, ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """The residual stream before the first layer.

        Arguments:
            ids, positions: (B, T) integer token ids and their positions.

        Returns:
            (B, T, d) in the dtype the model carries its residual stream in (Llama: float64).
        """
        raise NotImplementedError

    def run_layers(
        self, x: np.ndarray, positions: np.ndarray, cache: KVCache, start: int = 0, stop: int | None = None
    ) -> np.ndarray:
        """Layers `start` .. `stop - 1` (default: to the last) on the residual stream.

        Arguments:
            x: (B, T, d) the residual stream entering layer `start` (never written to).
            positions: (B, T) the tokens' positions.
            cache: the KV cache those layers append to (layers below `start` are not touched).

        Returns:
            (B, T, d) the residual stream leaving layer `stop - 1`.
        """
        raise NotImplementedError

    def final_norm(self, x: np.ndarray) -> np.ndarray:
        """The final norm: residual stream (B, T, d) -> hidden states in the parameters' dtype."""
        raise NotImplementedError

    def unembed(self, hidden: np.ndarray) -> np.ndarray:
        """Hidden states (B, T, d) (after `final_norm`) -> logits (B, T, vocab)."""
        return self._logits(hidden)

    # -- forward ---------------------------------------------------------------------------
    @property
    def context_length(self) -> int:
        return int(self.config.max_position_embeddings)

    def forward(
        self,
        input_ids: Any,
        *,
        attention_mask: Any = None,
        cache: KVCache | None = None,
        last_only: bool = False,
    ) -> np.ndarray:
        """Logits for every position of `input_ids`.

        Arguments:
            input_ids: (T,) or (B, T) integer ids (a list of different-length prompts is
                left-padded).
            attention_mask: (B, T), 1/True for real tokens, 0/False for left padding.
            cache: a `KVCache` holding earlier positions; the new ones are appended. Without
                one, a temporary cache is used and the whole sequence is attended causally.
            last_only: compute logits for the last position only (B, 1, vocab).

        Returns:
            logits (B, T, vocab) float32 ((T, vocab) for 1-D input). For the attention
            weights, run it inside `attnkit.record_attention(model)`.
        """
        ids, mask, was_1d = prepare_prompts(input_ids, attention_mask, self._pad_id())
        B, T = ids.shape
        if cache is None:
            cache = self.new_cache(B, T)
        elif cache.batch_size != B:
            raise ValueError(f"expected input_ids with batch size {cache.batch_size} like the cache, got {B}")
        self.check_tokens(ids, cache.length)
        logits = self._forward(ids, mask, cache, last_only)
        if was_1d:
            logits = logits[0]
        return logits

    def check_tokens(self, ids: np.ndarray, cached: int = 0) -> None:
        """ValueError unless (B, T) integer `ids` are a valid input after `cached` positions:
        every id in [0, vocab), and cached + T within the context (what `forward` refuses;
        `attnkit.interpret` checks its inputs with it too)."""
        if ids.size and (ids.max() >= self.config.vocab_size or ids.min() < 0):
            raise ValueError(f"expected token ids in [0, {self.config.vocab_size}), got {ids.min()}..{ids.max()}")
        T = ids.shape[-1]
        if cached + T > self.context_length:
            raise ValueError(
                f"{cached} cached + {T} new tokens go beyond this model's context of {self.context_length} tokens"
            )

    def _forward(self, ids: np.ndarray, mask: np.ndarray, cache: KVCache, last_only: bool) -> np.ndarray:
        """`forward` on checked (B, T) ids and mask: positions, then `_run` on the threads
        chosen for this much work (a decode step's choice timed, see the class docstring)."""
        B, T = ids.shape
        positions = self._positions(cache, mask)
        threads = blas_thread_count()
        if threads > 1 and T == 1 and self.single_thread_decode is None:  # a decode step: time the choice
            choice = self._decode_choice(B, threads)
            schedule = choice.choose()
            start = time.perf_counter()
            logits = self._run_on(1 if schedule == "one thread" else threads, ids, positions, cache, last_only)
            if start - self.__dict__.get("_threaded_until", 0.0) > self.BLAS_SPIN_SECONDS:
                choice.timed(schedule, time.perf_counter() - start)
        elif self.single_thread_decode is not False and (T == 1 or B * T <= self.single_thread_rows):
            # too little work per product for BLAS to split (see the class docstring); a
            # quantized model's tiles are claimed by up to `threads` threads instead
            with worker_threads(threads):
                logits = self._run_on(1, ids, positions, cache, last_only)
        else:
            logits = self._compiled_step(ids, positions, cache, threads) if T == 1 else None
            if logits is None:
                logits = self._run(ids, positions, cache, last_only)
                if threads > 1:  # BLAS's threads spin a while now, taking a CPU from the next steps
                    self.__dict__["_threaded_until"] = time.perf_counter()
        return logits

    def _run_on(self, threads: int, ids: np.ndarray, positions: np.ndarray, cache: KVCache,
                last_only: bool) -> np.ndarray:
        """`_run` on `threads` threads: a one-token step by the compiled step when the model has
        one for it (its own threads: no BLAS limit to set), else the modules under that BLAS
        thread limit."""
        logits = self._compiled_step(ids, positions, cache, threads) if ids.shape[1] == 1 else None
        if logits is None:
            with blas_threads(threads):
                logits = self._run(ids, positions, cache, last_only)
        return logits

    def _compiled_step(self, ids: np.ndarray, positions: np.ndarray, cache: KVCache, threads: int) -> np.ndarray | None:
        """Logits (B, 1, V) of a one-token step run by compiled code on `threads` threads, or
        None: the modules run it (`_run`). A model with such a step implements this (Llama:
        `attnkit.models.llama.fused`)."""
        return None

    def _run(self, ids: np.ndarray, positions: np.ndarray, cache: KVCache, last_only: bool) -> np.ndarray:
        hidden = self._hidden_states(ids, positions, cache)  # (B, T, d)
        return self._logits(hidden[:, -1:] if last_only else hidden)  # (B, T, V)

    def _decode_choice(self, batch_size: int, threads: int) -> FastestSchedule:
        """The thread choice for decode steps of `batch_size` sequences with `threads` BLAS
        threads allowed (each pair timed on its own: their step times differ)."""
        choices = self.__dict__.setdefault("_decode_choices", {})
        key = (batch_size, threads)
        if key not in choices:
            choices[key] = FastestSchedule(self.DECODE_SCHEDULES, self.DECODE_RETIME_EVERY)
        return choices[key]

    def _pad_id(self) -> int:
        if self.tokenizer is not None and self.tokenizer.pad_token_id is not None:
            return int(self.tokenizer.pad_token_id)
        eos = self._eos_ids()
        return eos[0] if eos else 0

    def _eos_ids(self) -> tuple[int, ...]:
        """Every end-of-sequence id: the config's (an id or a list, as Llama 3's), else the tokenizer's."""
        eos = getattr(self.config, "eos_token_id", None)
        if isinstance(eos, (int, np.integer)):
            eos = (int(eos),)
        if not eos and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos = (int(self.tokenizer.eos_token_id),)
        return tuple(eos or ())

    @staticmethod
    def _positions(cache: KVCache, mask: np.ndarray) -> np.ndarray:
        """Position of each new token: how many real tokens precede it (padding does not count)."""
        past = cache.length
        B, T = mask.shape
        if mask.all() and not cache.has_padding:
            return np.broadcast_to(np.arange(past, past + T), (B, T))
        cache.add_padding(mask)
        before = cache.key_padding[:, :past].sum(axis=1)  # (B,)
        positions = before[:, None] + np.cumsum(mask, axis=1) - 1  # (B, T)
        return np.maximum(positions, 0)

    # -- generation ------------------------------------------------------------------------
    def _stop_ids(self, stop: Any) -> tuple[set[int], list[str]]:
        """The token ids and strings that end a sequence: the model's end-of-sequence ids plus
        `stop` (as transformers adds `stop_strings` to `eos_token_id`); `()` alone: none."""
        if stop is None:
            return set(self._eos_ids()), []
        items = [stop] if isinstance(stop, (int, np.integer, str)) else list(stop)
        if not items:
            return set(), []
        for item in items:
            if isinstance(item, bool) or not isinstance(item, (int, np.integer, str)):
                raise TypeError(f"expected stop to hold token ids (int) and strings, got {item!r}")
            if isinstance(item, str) and not item:
                raise ValueError("expected non-empty stop strings, got ''")
        ids = set(self._eos_ids()) | {int(item) for item in items if isinstance(item, (int, np.integer))}
        texts = [item for item in items if isinstance(item, str)]
        if texts and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none, pass token ids instead")
        return ids, texts

    def _ends_with_stop(self, history: list[int], texts: list[str]) -> bool:
        """Whether a stop string ends inside the last token of `history` (transformers'
        `StopStringCriteria`: the string may start in earlier tokens, prompt included, and may
        end before the last token's text does: `"\n"` stops on the token `"\n   "`)."""
        before = self.tokenizer.decode(history[:-1])
        text = self.tokenizer.decode(history)
        boundary = 0  # where the last token's text starts (a split character may re-decode)
        for a, b in zip(before, text):
            if a != b:
                break
            boundary += 1
        return any(text.find(s, max(0, boundary - len(s) + 1)) >= 0 for s in texts)

    def stream(
        self,
        input_ids: Any,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | np.random.Generator | None = None,
        stop: Any = None,
        *,
        attention_mask: Any = None,
        cache: KVCache | None = None,
        prefill_chunk: int | None = None,
        repetition_penalty: float = 1.0,
        penalty_context: Sequence[int] = (),
    ) -> Iterator[np.ndarray]:
        """Generate token by token: yields (B,) int64 arrays of new ids as they are chosen
        (a row that has stopped repeats the pad id). See `generate` for the arguments.

        `cache`: continue from an existing cache (multi-turn chat): it must already hold every
        earlier token, and `input_ids` are only the new ones. `penalty_context`: the ids of those
        earlier tokens, so that the repetition penalty counts them as a fresh generation on the
        whole sequence would.

        Arguments are checked when `stream` is called, before the first token is asked for.
        """
        _check_sampling(max_new_tokens, temperature, top_k, top_p)
        ids, mask, _ = prepare_prompts(input_ids, attention_mask, self._pad_id())
        B, T = ids.shape
        past = 0 if cache is None else cache.length
        if past + T > self.context_length:
            raise ValueError(
                f"prompt of {T} tokens (after {past} cached) is longer than this model's context of "
                f"{self.context_length} tokens; shorten it"
            )
        if past + T + max_new_tokens > self.context_length:
            allowed = self.context_length - past - T
            warnings.warn(
                f"max_new_tokens={max_new_tokens} would pass the context of {self.context_length} tokens; "
                f"generating at most {allowed}",
                stacklevel=2,
            )
            max_new_tokens = allowed
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"expected prefill_chunk >= 1, got {prefill_chunk}")
        if cache is not None and cache.max_length < past + T + max_new_tokens:
            raise ValueError(
                f"cache of {cache.max_length} positions cannot hold {past} + {T} + {max_new_tokens} tokens"
            )
        if not (np.isfinite(repetition_penalty) and repetition_penalty > 0):
            raise ValueError(f"expected a finite repetition_penalty > 0, got {repetition_penalty}")
        stops = self._stop_ids(stop)
        return self._steps(ids, mask, max_new_tokens, temperature, top_k, top_p, seed, stops, cache, prefill_chunk,
                           float(repetition_penalty), np.asarray(penalty_context, dtype=np.int64))

    def _steps(self, ids, mask, max_new_tokens, temperature, top_k, top_p, seed, stops, cache, prefill_chunk,
               repetition_penalty=1.0, penalty_context=()):
        """The generator behind `stream`, on checked arguments."""
        B, T = ids.shape
        if max_new_tokens == 0:
            return
        if cache is None:
            cache = self.new_cache(B, T + max_new_tokens)
        rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
        stop_ids, stop_texts = stops
        pad = self._pad_id()

        # Prefill: the whole prompt (or chunks of it), logits of the last position only.
        chunk = T if not prefill_chunk else int(prefill_chunk)
        for start in range(0, T, chunk):
            logits = self.forward(
                ids[:, start : start + chunk], attention_mask=mask[:, start : start + chunk], cache=cache,
                last_only=True,
            )  # (B, 1, V)

        finished = np.zeros(B, dtype=bool)
        # Stop strings look back over the prompt too (a string may start there); enough tokens
        # that the text before the last one is as long as the longest stop string.
        window = max((len(s) for s in stop_texts), default=0) + 2
        history = [list(ids[row][mask[row]][-window:]) for row in range(B)]
        step_mask = np.ones((B, 1), dtype=bool)
        # The repetition penalty's context: the tokens before a given cache (penalty_context),
        # the prompt's real tokens, then every token chosen.
        seen = np.zeros(logits.shape[::2], dtype=bool)  # (B, V)
        seen[:, penalty_context] = True
        for row in range(B):
            seen[row, ids[row][mask[row]]] = True
        penalize = repetition_penalty != 1.0
        for step in range(max_new_tokens):
            scores = apply_repetition_penalty(logits[:, -1], seen, repetition_penalty)  # (B, V)
            next_ids = sample_next_token(scores, temperature, top_k, top_p, rng)  # (B,)
            if B > 1:  # (one row that finished has ended the loop)
                next_ids = np.where(finished, pad, next_ids)
            if penalize:
                seen[np.arange(B), next_ids] = True
            yield next_ids
            for row in (0,) if B == 1 else np.flatnonzero(~finished):
                token = int(next_ids[row])
                if token in stop_ids:
                    finished[row] = True
                elif stop_texts:
                    history[row] = [*history[row][-window:], token]
                    finished[row] = self._ends_with_stop(history[row], stop_texts)
            if finished.all() or step == max_new_tokens - 1:
                return
            logits = self._forward(next_ids[:, None], step_mask, cache, False)  # (B, 1, V); ids < V

    def generate(
        self,
        input_ids: Any,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | np.random.Generator | None = None,
        stop: Any = None,
        *,
        attention_mask: Any = None,
        on_token: Callable[[np.ndarray], Any] | None = None,
        cache: KVCache | None = None,
        prefill_chunk: int | None = None,
        repetition_penalty: float = 1.0,
    ) -> np.ndarray:
        """Continue prompts by up to `max_new_tokens` tokens.

        Arguments:
            input_ids: (T,) or (B, T) ids, or a list of prompts of different lengths (left-padded).
            max_new_tokens: how many tokens to add at most (>= 0).
            temperature: 0 for greedy decoding; > 0 divides the logits before sampling.
            top_k: sample among the k most likely tokens only.
            top_p: sample among the most likely tokens whose probability reaches top_p.
            seed: int or numpy Generator for sampling (reproducible).
            stop: token id(s) and/or string(s) that end a sequence, in addition to the model's
                end-of-sequence token(s) (the stopping token is kept). A string stops the
                sequence as soon as it ends inside the last token, as with transformers'
                `StopStringCriteria` (`"\\n"` stops on a token `"\\n   "`). None: the model's
                end-of-sequence token(s) only, any of them (a list such as Llama 3's
                `eos_token_id: [128001, 128008, 128009]`). `()`: never stop early.
            attention_mask: (B, T), False where input_ids is left padding.
            on_token: called with each step's (B,) new ids, for streaming.
            cache: continue from this cache (see `stream`).
            prefill_chunk: prefill the prompt this many tokens at a time.
            repetition_penalty: transformers' `repetition_penalty` (see `apply_repetition_penalty`)
                over the prompt's real tokens (with a `cache`, the ones passed here) and every new
                token; 1.0 (the default) is off.

        Returns:
            (B, T + n) int64: the (padded) prompts followed by n <= max_new_tokens new tokens;
            rows that stopped early are filled with the pad id. (T + n,) for 1-D input.
        """
        ids, mask, was_1d = prepare_prompts(input_ids, attention_mask, self._pad_id())
        new: list[np.ndarray] = []
        for next_ids in self.stream(
            ids, max_new_tokens, temperature, top_k, top_p, seed, stop,
            attention_mask=mask, cache=cache, prefill_chunk=prefill_chunk, repetition_penalty=repetition_penalty,
        ):
            new.append(next_ids)
            if on_token is not None:
                on_token(next_ids[0] if was_1d else next_ids)
        out = np.concatenate([ids, np.stack(new, axis=1)], axis=1) if new else ids
        return out[0] if was_1d else out

    def generate_text(
        self,
        prompt: str,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | np.random.Generator | None = None,
        stop: Any = None,
    ) -> str:
        """Continue `prompt` (text, tokenized as the tokenizer says, BOS included when it adds
        one) and return the new text only.

        Stopping is `generate`'s. The returned text ends just before the first stop string,
        which may end inside a token (that token's text is cut there) or start in the prompt
        (then nothing is returned); a stop token id (EOS) that ended the text is left out.
        """
        if self.tokenizer is None:
            raise ValueError("generate_text needs a tokenizer; this model has none, use generate with token ids")
        if not isinstance(prompt, str):
            raise TypeError(f"expected prompt as str, got {type(prompt).__name__}")
        prompt_ids = self.tokenizer.encode(prompt)
        if not prompt_ids:
            raise ValueError("expected a prompt with at least one token, got an empty prompt")
        stop_ids, stop_texts = self._stop_ids(stop)
        out = self.generate(np.asarray(prompt_ids, dtype=np.int64), max_new_tokens, temperature, top_k, top_p,
                            seed, stop)
        new_ids = [int(i) for i in out[len(prompt_ids):]]
        if new_ids and new_ids[-1] in stop_ids:
            new_ids = new_ids[:-1]
        if not stop_texts:
            return self.tokenizer.decode(new_ids)
        # the text of the prompt's tail and the new tokens, in which the stop string may start early
        tail = prompt_ids[-(max(len(s) for s in stop_texts) + 2):]
        head = len(self.tokenizer.decode(tail))
        text = self.tokenizer.decode(tail + new_ids)
        starts = [i for i in (text.find(s, max(0, head - len(s) + 1)) for s in stop_texts) if i >= 0]
        return text[head : max(min(starts), head)] if starts else text[head:]

    # -- looking inside ----------------------------------------------------------------------
    def attention(self, text_or_ids: str | Sequence[int] | np.ndarray) -> AttentionMap:
        """Attention weights of every layer and head for one prompt.

        Arguments:
            text_or_ids: text (tokenized with the model's tokenizer) or a 1-D sequence of ids.

        Returns:
            AttentionMap(tokens, weights (layers, heads, T, T)).
        """
        if isinstance(text_or_ids, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass token ids instead of text")
            ids = np.asarray(self.tokenizer.encode(text_or_ids), dtype=np.int64)
        else:
            ids = np.asarray(text_or_ids, dtype=np.int64)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"expected a non-empty 1-D sequence of token ids, got shape {ids.shape}")
        with record_attention(self) as recording:
            self.forward(ids)
        stacked = np.stack([w[0] for w in recording.maps]).astype(np.float32, copy=False)  # (layers, H, T, T)
        tokens = self.tokenizer.tokens(ids) if self.tokenizer is not None else [str(int(i)) for i in ids]
        return AttentionMap(tokens=tokens, weights=stacked)
