"""The scheduler behind `attnkit serve`'s completions: continuous batching on a paged KV cache.

One `Engine` per decoder runs one thread. Requests (`Engine.submit`) wait in a bounded
queue, join the running batch at the next step and leave it when done; each step is one
`BatchStep.run` over rows of many sequences (`attnkit.models.llama.batch`):

    step = [every running decode row (one token each, oldest sequence first)]
         + [prefill chunks of sequences still reading their prompt, oldest first,
            up to `step_tokens` rows in all]

so a long prompt that arrives is read `step_tokens` tokens at a time between the
decode steps of the streams already running, which keep their pace.

A sequence is the tokens it knows (its prompt, then every token chosen) and how many of
them its cache holds; a step feeds it what is missing. Prefix sharing: on arrival
`PagedKVCache.match_prefix` attaches the cached blocks of the longest cached prefix (a
system prompt every request repeats is read once), and `usage.prompt_tokens_details.
cached_tokens` says how many tokens came from it. `n` > 1: the prompt is read once and
the sequence forked (`PagedKVCache.fork`) when its logits are out; each choice then samples
on its own.

Sampling: each choice has its own `numpy.random.Generator` (choice 0: `default_rng(seed)`,
as `CausalLM.stream` draws; choice i > 0: `default_rng([seed, i])`), which draws once per
token, so what a request gets does not depend on who else is running. Log-probabilities
are the float64 log-softmax of the step's float32 logits.

Limits:
- `max_batch` choices run at once; more wait in a queue of `max_queue` requests; a request
  that finds the queue full is refused (`EngineBusy`: the server's 429 with Retry-After).
- `kv_tokens`: the cache's size. A request whose prompt plus max_tokens can never fit is
  refused on arrival (`RequestTooLarge`, naming the numbers). When the cache fills in the
  middle of a generation (`CacheFull` on reserve), the youngest running choice is
  preempted: its blocks are freed and it goes back to the front of the queue with every
  token it has (nothing it streamed is taken back); it is recomputed when it runs again
  (much of it usually from the prefix cache), and its generator keeps its state, so the
  answer is the one it would have been.
- Cancellation (`Handle.cancel`, or a client that went away): the choice's blocks are freed
  at the next step.
"""

from __future__ import annotations

import collections
import math
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from attnkit.models.sampling import sample_next_token

__all__ = ["DEFAULT_KV_TOKENS", "DEFAULT_MAX_BATCH", "DEFAULT_MAX_QUEUE", "DEFAULT_STEP_TOKENS", "Engine",
           "EngineBusy", "EngineStopped", "Handle", "MAX_TOP_LOGPROBS", "RequestTooLarge", "Sampling", "TokenEvent",
           "log_softmax", "top_logprobs"]

DEFAULT_MAX_BATCH = 8
"""Choices decoded together by default (`attnkit serve --max-batch`)."""
DEFAULT_STEP_TOKENS = 16
"""The most rows of one step by default (`--step-tokens`): decode rows, then prefill chunks.
Smaller keeps running streams steadier while a long prompt arrives, larger reads that
prompt sooner: SmolLM2 on a loaded 2-core Xeon, 7 streams and a 1,000-token prompt
arriving, p99 gap / the prompt's first token: 0.26 s / 20 s at 16, 0.48 / 14 at 32,
0.96 / 12 at 64."""
DEFAULT_KV_TOKENS = 16384
"""Tokens the KV cache holds by default (`--kv-tokens`): 8 sequences of 2,048."""
DEFAULT_MAX_QUEUE = 64
"""Requests that may wait for a place in the batch; more are refused (429)."""
MAX_TOP_LOGPROBS = 20
"""The most alternatives per token (OpenAI's limit for top_logprobs)."""


class EngineBusy(RuntimeError):
    """The queue is full: try again later (HTTP 429); `retry_after` seconds is a guess."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RequestTooLarge(ValueError):
    """A request that can never fit in the KV cache (HTTP 400), naming the numbers."""


class EngineStopped(RuntimeError):
    """The engine was closed, or its thread failed (HTTP 503)."""


@dataclass(frozen=True)
class Sampling:
    """How a request chooses its tokens.

    temperature: 0 is greedy (argmax); otherwise the logits are divided by it.
    top_p: nucleus sampling (None: all tokens).
    seed: the generator's seed (None: fresh entropy).
    stop_ids: token ids that end a choice (finish_reason "stop"; the token is counted).
    """

    temperature: float = 0.0
    top_p: float | None = None
    seed: int | None = None
    stop_ids: frozenset[int] = frozenset()


@dataclass(frozen=True)
class TokenEvent:
    """One token of one choice, as the engine chose it.

    choice: the choice's index in its request (0 .. n - 1).
    token: the token id.
    logprob: its float64 log-probability under the step's logits.
    top: the `logprobs` most likely tokens, ((id, logprob), ...), most likely first (ties:
        lower id first); empty when the request asked for none.
    finish: None while the choice goes on; "stop" (a stop id) or "length" (max_tokens)
        when this token is its last.
    extra: what a request run alone asked for besides (`attnkit.serve.solo`), or None.
    """

    choice: int
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    finish: str | None
    extra: dict | None = None


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-softmax of (..., V) logits (of any float dtype): x - max - log(sum(exp(x - max)))."""
    x = np.asarray(logits, dtype=np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def top_logprobs(logprobs: np.ndarray, k: int) -> tuple[tuple[int, float], ...]:
    """The k most likely entries of (V,) log-probabilities, most likely first (ties: lower id first)."""
    if k <= 0:
        return ()
    order = np.argsort(-logprobs, kind="stable")[:k]
    return tuple((int(i), float(logprobs[i])) for i in order)


class Handle:
    """A submitted request: iterate it for its `TokenEvent`s (every choice's, interleaved, in
    the order they were chosen); it ends when every choice has finished or was cancelled.

    Attributes:
        prompt_tokens: the prompt's length.
        cached_tokens: how many prompt tokens came from the prefix cache (known once the
            request has been admitted; 0 before).
        n: the number of choices.
    """

    def __init__(self, engine: "Engine", request: "_Request") -> None:
        self._engine, self._request = engine, request
        self.prompt_tokens, self.n = len(request.prompt), request.n

    @property
    def cached_tokens(self) -> int:
        return self._request.cached_tokens

    def cancel(self, choice: int | None = None) -> None:
        """Stop every choice (or one); their blocks are freed at the engine's next step."""
        self._engine._cancel(self._request, choice)

    def get(self, timeout: float | None = None) -> TokenEvent | None:
        """The next event, or None once the request has ended. Raises what ended it
        (`EngineStopped`, or the error of a failed step), or queue.Empty after `timeout` s."""
        item = self._request.out.get(timeout=timeout)
        if isinstance(item, BaseException):
            raise item
        return item

    def events(self, timeout: float | None = None) -> Iterator[TokenEvent]:
        """The events as they come (see `get`)."""
        while (item := self.get(timeout)) is not None:
            yield item

    def __iter__(self) -> Iterator[TokenEvent]:
        return self.events()


@dataclass(eq=False)
class _Request:
    prompt: list[int]
    max_tokens: int
    sampling: Sampling
    logprobs: int
    n: int
    out: queue.Queue = field(default_factory=queue.Queue)
    cached_tokens: int = 0
    admitted: bool = False
    open_choices: int = 0
    cancelled: bool = False  # every choice, those not forked yet too


@dataclass(eq=False)
class _Choice:
    """One choice of a request: a sequence of the cache while it runs."""

    request: _Request
    index: int
    rng: np.random.Generator
    tokens: list[int]  # the prompt, then every token chosen
    generated: int = 0
    sequence: int | None = None  # the cache's sequence id while running
    forks: int = 0  # choices still to fork from this one once the prompt's logits are out
    order: int = 0  # admission order: the youngest is preempted first
    cancelled: bool = False
    done: bool = False


class Engine:
    """The scheduler of one decoder (see the module docstring).

    Arguments:
        model: a `CausalLM` that `attnkit.models.llama.batch.BatchStep` runs.
        max_batch: the most choices decoded together (>= 1).
        kv_tokens: the tokens the paged KV cache holds in all (>= block_size).
        step_tokens: the most rows of one step (>= 1); every running decode row goes in
            each step even when they are more.
        max_queue: the most requests waiting for a place (>= 0); beyond: `EngineBusy`.
        block_size: tokens per cache block.
        threads: the step's threads (None: BatchStep's default).
        cache, step: a `PagedKVCache` and the `BatchStep` over it, made here when not given
            (`new_cache(model, tokens=kv_tokens, block_size=block_size)`, `BatchStep(model, cache)`).

    Attributes:
        cache: the `PagedKVCache`; step: the `BatchStep`.
        counters: steps, rows, decode_rows, prefill_rows, preempted, cancelled (choices ended
            by `Handle.cancel`: a client gone, a stop string), finished (by a stop id or
            max_tokens), cached_prompt_tokens, peak_bytes (the most bytes of blocks live
            sequences held after a step's reserve) and peak_tokens (the tokens they held then)
            (a dict of ints; `stats()` adds the cache's counts; `reset_peak()`).
    """

    def __init__(self, model: Any, *, max_batch: int = DEFAULT_MAX_BATCH, kv_tokens: int = DEFAULT_KV_TOKENS,
                 step_tokens: int = DEFAULT_STEP_TOKENS, max_queue: int = DEFAULT_MAX_QUEUE, block_size: int = 16,
                 threads: int | None = None, cache: Any = None, step: Any = None) -> None:
        for name, value, least in (("max_batch", max_batch, 1), ("kv_tokens", kv_tokens, block_size),
                                   ("step_tokens", step_tokens, 1), ("max_queue", max_queue, 0),
                                   ("block_size", block_size, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"expected {name} to be an int >= {least}, got {value!r}")
        self.model = model
        self.max_batch, self.step_tokens, self.max_queue = max_batch, step_tokens, max_queue
        if cache is None or step is None:
            from attnkit.models.llama.batch import BatchStep, new_cache

            cache = new_cache(model, tokens=kv_tokens, block_size=block_size)
            step = BatchStep(model, cache, threads=threads)
        self.cache, self.step = cache, step
        self.block_size = self.cache.block_size
        self.capacity_blocks = self.cache.free_blocks + self.cache.used_blocks
        self.counters = dict(steps=0, rows=0, decode_rows=0, prefill_rows=0, preempted=0, cancelled=0, finished=0,
                             cached_prompt_tokens=0, peak_bytes=0, peak_tokens=0)
        self._lock = threading.Condition()
        self._waiting: collections.deque[list[_Choice]] = collections.deque()  # each entry: one admission
        self._running: list[_Choice] = []
        self._admissions = 0
        self._stopped: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="attnkit-serve-engine", daemon=True)
        self._thread.start()

    # -- what the server calls -------------------------------------------------------------
    def submit(self, prompt_ids: Sequence[int], max_tokens: int, sampling: Sampling = Sampling(), *,
               logprobs: int = 0, n: int = 1) -> Handle:
        """Queue a request; returns its `Handle` at once.

        Arguments:
            prompt_ids: the prompt's token ids (at least one).
            max_tokens: the most tokens each choice generates (>= 1).
            sampling: temperature, top_p, seed and stop ids.
            logprobs: how many alternatives each event carries (0 .. MAX_TOP_LOGPROBS).
            n: choices (1 .. max_batch), sharing the prompt's blocks.

        Raises:
            ValueError: a bad argument. RequestTooLarge: it can never fit in the cache.
            EngineBusy: the queue is full. EngineStopped: the engine is closed.
        """
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("expected a prompt of at least one token, got none")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"expected max_tokens to be an int >= 1, got {max_tokens!r}")
        if not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"expected logprobs between 0 and {MAX_TOP_LOGPROBS}, got {logprobs}")
        if not 1 <= n <= self.max_batch:
            raise ValueError(f"expected n between 1 and {self.max_batch} (this engine's max_batch), got {n}")
        need = len(prompt) + max_tokens
        blocks = math.ceil(need / self.block_size)
        if blocks > self.capacity_blocks:
            raise RequestTooLarge(
                f"the prompt ({len(prompt)} tokens) and max_tokens ({max_tokens}) need {need} tokens of KV cache; "
                f"this server's cache holds {self.capacity_blocks * self.block_size} (attnkit serve --kv-tokens)")
        request = _Request(prompt, max_tokens, sampling, logprobs, n, open_choices=n)
        seed = sampling.seed
        first = _Choice(request, 0, np.random.default_rng(seed), list(prompt), forks=n - 1)
        with self._lock:
            if self._stopped is not None:
                raise EngineStopped(f"the engine has stopped: {self._stopped}")
            queued = sum(1 + c.forks for entry in self._waiting for c in entry)
            if len(self._waiting) >= self.max_queue and len(self._running) + queued + n > self.max_batch:
                raise EngineBusy(f"this server is busy: {len(self._running)} choices running (--max-batch "
                                 f"{self.max_batch}) and {len(self._waiting)} requests waiting (the most it queues); "
                                 "retry later", retry_after=1)
            self._waiting.append([first])
            self._lock.notify()
        return Handle(self, request)

    def stats(self) -> dict[str, int]:
        """The counters, with running, waiting, free_blocks, used_blocks, cached_blocks, bytes_used
        (of the blocks live sequences hold) and tokens_held (the tokens whose keys and values the
        running sequences read: shared prefix blocks count once per sequence here, once in bytes)."""
        with self._lock:
            held = sum(self.cache.length(c.sequence) for c in self._running if c.sequence is not None)
            return {**self.counters, "running": len(self._running), "waiting": sum(len(w) for w in self._waiting),
                    "free_blocks": self.cache.free_blocks, "used_blocks": self.cache.used_blocks,
                    "cached_blocks": self.cache.cached_blocks, "bytes_used": self.cache.bytes_used(),
                    "tokens_held": held}

    def reset_peak(self) -> None:
        """Start peak_bytes and peak_tokens again from 0 (to measure one stretch of work)."""
        with self._lock:
            self.counters.update(peak_bytes=0, peak_tokens=0)

    def idle(self) -> bool:
        """Whether nothing runs or waits."""
        with self._lock:
            return not self._running and not self._waiting

    def close(self) -> None:
        """Stop the thread; open requests end with EngineStopped."""
        with self._lock:
            if self._stopped is None:
                self._stopped = EngineStopped("the engine was closed")
            self._lock.notify()
        self._thread.join()

    # -- the thread ------------------------------------------------------------------------
    def _cancel(self, request: _Request, choice: int | None) -> None:
        with self._lock:
            for entry in [*self._running, *(c for w in self._waiting for c in w)]:
                if entry.request is request and (choice is None or entry.index == choice):
                    entry.cancelled = True
            if choice is None:
                request.cancelled = True
            self._lock.notify()

    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    while self._stopped is None and not self._running and not self._waiting:
                        self._lock.wait()
                    if self._stopped is not None:
                        break
                    self._drop_cancelled()
                    self._admit()
                    running = list(self._running)
                if running:
                    self._step(running)
        except BaseException as error:  # noqa: BLE001 - every open request learns why
            with self._lock:
                self._stopped = EngineStopped(f"the engine failed: {type(error).__name__}: {error}")
        with self._lock:
            for choice in [*self._running, *(c for w in self._waiting for c in w)]:
                self._end(choice, self._stopped)
            self._running.clear()
            self._waiting.clear()

    def _end(self, choice: _Choice, error: BaseException | None = None) -> None:
        """A choice leaves: its sequence is freed; the request's stream closes with its last choice."""
        if choice.sequence is not None:
            self.cache.free(choice.sequence)
            choice.sequence = None
        if choice.done:
            return
        choice.done = True
        request = choice.request
        if error is not None:
            request.out.put(error)
        request.open_choices -= 1 + choice.forks  # choices it was still to fork end with it
        choice.forks = 0
        if request.open_choices <= 0:
            request.out.put(None)

    def _drop_cancelled(self) -> None:
        for choice in [c for c in self._running if c.cancelled or c.request.cancelled]:
            self._running.remove(choice)
            self.counters["cancelled"] += 1
            self._end(choice)
        for entry in list(self._waiting):
            kept = [c for c in entry if not (c.cancelled or c.request.cancelled)]
            for choice in entry:
                if choice not in kept:
                    self.counters["cancelled"] += 1
                    self._end(choice)
            if not kept:
                self._waiting.remove(entry)

    def _admit(self) -> None:
        """Move waiting choices into the batch while there is room (oldest first)."""
        while self._waiting:
            entry = self._waiting[0]
            places = sum(1 + c.forks for c in entry)
            if len(self._running) + places > self.max_batch:
                return
            self._waiting.popleft()
            for choice in entry:
                choice.sequence = self.cache.add_sequence()
                cached = self.cache.match_prefix(choice.sequence, choice.tokens)
                if not choice.request.admitted:
                    choice.request.admitted = True
                    choice.request.cached_tokens = min(cached, len(choice.request.prompt))
                    self.counters["cached_prompt_tokens"] += choice.request.cached_tokens
                self._admissions += 1
                choice.order = self._admissions
                self._running.append(choice)

    def _plan(self, running: list[_Choice]) -> list[tuple[_Choice, int, bool]]:
        """(choice, rows, logits wanted) for this step: decode rows first, then prefill chunks."""
        plan, budget = [], self.step_tokens
        pending = [(c, len(c.tokens) - self.cache.length(c.sequence)) for c in running]
        for choice, missing in pending:
            if missing == 1:
                plan.append((choice, 1, True))
                budget -= 1
        for choice, missing in pending:
            if missing > 1 and budget > 0:
                rows = min(missing, budget)
                plan.append((choice, rows, rows == missing))
                budget -= rows
        return plan

    def _reserve(self, running: list[_Choice]) -> list[tuple[_Choice, int, bool]] | None:
        """The step's plan with room reserved for every row, preempting the youngest choices
        while the cache is full; None when nothing is left to run."""
        from attnkit.nn.paged import CacheFull

        while running:
            plan = self._plan(running)
            try:
                for choice, rows, _ in plan:
                    self.cache.reserve(choice.sequence, rows)
                return plan
            except CacheFull:
                youngest = max(running, key=lambda c: c.order)
                if len(running) == 1:
                    raise
                running.remove(youngest)
                with self._lock:
                    self._preempt(youngest)
        return None

    def _preempt(self, choice: _Choice) -> None:
        self._running.remove(choice)
        self.cache.free(choice.sequence)
        choice.sequence = None
        self.counters["preempted"] += 1
        self._waiting.appendleft([choice])

    def _step(self, running: list[_Choice]) -> None:
        from attnkit.models.llama.batch import StepRow
        from attnkit.nn.paged import CacheFull

        try:
            plan = self._reserve(running)
        except CacheFull as error:  # one choice alone does not fit: it cannot go on
            with self._lock:
                for choice in running:
                    self._running.remove(choice)
                    self._end(choice, EngineStopped(f"the KV cache is full: {error}"))
            return
        if not plan:
            return
        held = self.cache.bytes_used()
        if held > self.counters["peak_bytes"]:
            tokens = sum(self.cache.length(c.sequence) for c in running) + sum(count for _, count, _ in plan)
            self.counters.update(peak_bytes=held, peak_tokens=tokens)
        rows = []
        for choice, count, logits in plan:
            start = self.cache.length(choice.sequence)
            for offset in range(count):
                rows.append(StepRow(choice.sequence, choice.tokens[start + offset],
                                    logits and offset == count - 1))
        try:
            logits = self.step.run(rows)  # (rows with logits, V) float32
        except Exception as error:  # noqa: BLE001 - the requests of this step learn why; the engine goes on
            with self._lock:
                for choice, _, _ in plan:
                    if choice in self._running:
                        self._running.remove(choice)
                    self._end(choice, RuntimeError(f"the batched step failed: {type(error).__name__}: {error}"))
            return
        decode = sum(1 for _, count, _ in plan if count == 1)
        self.counters.update(steps=self.counters["steps"] + 1, rows=self.counters["rows"] + len(rows),
                             decode_rows=self.counters["decode_rows"] + decode,
                             prefill_rows=self.counters["prefill_rows"] + len(rows) - decode)
        with self._lock:
            index = 0
            for choice, _, wanted in plan:
                if not wanted:
                    continue
                row = logits[index]
                index += 1
                if choice.cancelled or choice.done:
                    continue
                for sibling in self._fork(choice):
                    self._choose(sibling, row)
                self._choose(choice, row)

    def _fork(self, choice: _Choice) -> list[_Choice]:
        """The other choices of an n > 1 request, forked from its first once the prompt's logits exist."""
        if not choice.forks:
            return []
        request, seed, out = choice.request, choice.request.sampling.seed, []
        for index in range(1, choice.forks + 1):
            rng = np.random.default_rng(None if seed is None else [seed, index])
            sibling = _Choice(request, index, rng, list(choice.tokens), sequence=self.cache.fork(choice.sequence))
            self._admissions += 1
            sibling.order = self._admissions
            self._running.append(sibling)
            out.append(sibling)
        choice.forks = 0
        return out

    def _choose(self, choice: _Choice, logits: np.ndarray) -> None:
        """Sample the choice's next token from its (V,) float32 logits and send its event."""
        request, sampling = choice.request, choice.request.sampling
        token = int(sample_next_token(logits[None], sampling.temperature, None, sampling.top_p, choice.rng)[0])
        logprobs = log_softmax(logits)
        choice.tokens.append(token)
        choice.generated += 1
        finish = ("stop" if token in sampling.stop_ids
                  else "length" if choice.generated >= request.max_tokens else None)
        request.out.put(TokenEvent(choice.index, token, float(logprobs[token]),
                                   top_logprobs(logprobs, request.logprobs), finish))
        if finish is not None:
            self._running.remove(choice)
            self.counters["finished"] += 1
            self._end(choice)
