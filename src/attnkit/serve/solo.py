"""One request alone, on the model's modules: the path of a request that asks for attention
or the logit lens through the API (an `attnkit` object in the body), and of a decoder that
the batched engine does not run.

`solo_events` yields the engine's `TokenEvent`s (`attnkit.serve.engine`), each with its
`extra` filled when asked:

- `{"attention": {"layers": [l, ...], "heads": [h, ...]}}`: for each generated token, the
  attention row that produced it (the query at the position before the token, over every
  key up to it: the prompt and the tokens generated before) of each chosen layer and head,
  as `extra["attention"]`, a list over layers of lists over heads of (S,) rows: what
  `attnkit.record_attention(model)` records for `model(context)` at that query.
- `{"logit_lens": {"top": k}}`: for each generated token, the k tokens the residual stream
  entering each layer (and after the last) would predict at that position, through the
  final norm and the unembedding (`attnkit.interpret.logit_lens`): `extra["logit_lens"]`,
  a list over layers + 1 of [(id, logit), ...], largest first.

The model runs on a `KVCache`, one token a step after the prompt: its own `forward` (inside
`record_attention` when attention is asked), or layer by layer when the lens is asked
(`embed_inputs`, `run_layers`, `final_norm`, `unembed`: the seams `attnkit.interpret`
reads). Sampling draws from `default_rng(seed)` as `CausalLM.stream` does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from attnkit.models.sampling import sample_next_token
from attnkit.serve.engine import Sampling, TokenEvent, log_softmax, top_logprobs

__all__ = ["MAX_HEAD_ROWS", "MAX_LENS_TOP", "check_extension", "solo_events"]

MAX_HEAD_ROWS = 64
"""The most (layer, head) pairs one request's attention may ask for."""
MAX_LENS_TOP = 20
"""The most tokens the logit lens gives per layer."""


def _indices(value: Any, count: int, what: str) -> list[int]:
    if value is None:
        return list(range(count))
    if not isinstance(value, list) or not value or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise ValueError(f"expected attnkit.attention.{what} as a non-empty list of integers, got {value!r:.80}")
    for i in value:
        if not -count <= i < count:
            raise ValueError(f"expected attnkit.attention.{what} in [{-count}, {count}) (the model has {count}), "
                             f"got {i}")
    return [i % count for i in value]


def check_extension(options: Any, model: Any) -> dict[str, Any]:
    """The `attnkit` object of a request, checked against `model`: {"layers", "heads", "top"}
    (layers/heads None when no attention is asked, top 0 when no lens). Raises ValueError
    naming what was expected and what arrived."""
    if not isinstance(options, dict):
        raise ValueError(f"expected attnkit as an object, got {options!r:.80}")
    unknown = set(options) - {"attention", "logit_lens"}
    if unknown:
        raise ValueError(f"expected attnkit to hold 'attention' and/or 'logit_lens', got {sorted(unknown)}")
    if not options:
        raise ValueError("expected attnkit to ask for 'attention' and/or 'logit_lens', got an empty object")
    out: dict[str, Any] = {"layers": None, "heads": None, "top": 0}
    attention = options.get("attention")
    num_layers = int(model.config.num_layers)
    if attention is not None:
        if not isinstance(attention, dict) or set(attention) - {"layers", "heads"}:
            raise ValueError("expected attnkit.attention as {'layers': [...], 'heads': [...]}, got "
                             f"{attention!r:.80}")
        out["layers"] = _indices(attention.get("layers"), num_layers, "layers")
        out["heads"] = _indices(attention.get("heads"), int(model.config.num_heads), "heads")
        pairs = len(out["layers"]) * len(out["heads"])
        if pairs > MAX_HEAD_ROWS:
            raise ValueError(f"expected at most {MAX_HEAD_ROWS} (layer, head) pairs in attnkit.attention, got "
                             f"{len(out['layers'])} layers x {len(out['heads'])} heads = {pairs}")
    lens = options.get("logit_lens")
    if lens is not None:
        top = lens.get("top") if isinstance(lens, dict) and set(lens) <= {"top"} else None
        if isinstance(top, bool) or not isinstance(top, int) or not 1 <= top <= MAX_LENS_TOP:
            raise ValueError(f"expected attnkit.logit_lens as {{'top': k}} with k between 1 and {MAX_LENS_TOP}, "
                             f"got {lens!r:.80}")
        out["top"] = top
    return out


def solo_events(
    model: Any,
    prompt_ids: Sequence[int],
    max_tokens: int,
    sampling: Sampling = Sampling(),
    *,
    logprobs: int = 0,
    n: int = 1,
    extension: dict[str, Any] | None = None,
    cancelled: Callable[[int], bool] = lambda choice: False,
) -> Iterator[TokenEvent]:
    """The tokens of a request run alone: its choices one after another, each a `TokenEvent`
    (the extension's data in `extra`). Choice 0 draws from `default_rng(seed)`, choice i > 0
    from `default_rng([seed, i])`, as the engine does.

    Arguments:
        model: a `CausalLM` with `embed_inputs`, `run_layers`, `final_norm`, `unembed`.
        prompt_ids: the prompt (T,) token ids; max_tokens: the most tokens per choice.
        sampling, logprobs, n: as `Engine.submit` takes them.
        extension: `check_extension`'s result, or None.
        cancelled: cancelled(choice) is polled before each step; True ends that choice at
            once (no finish event).
    """
    from attnkit.nn.interface import record_attention

    extension = extension or {"layers": None, "heads": None, "top": 0}
    recorded = extension["layers"] is not None
    for index in range(n):
        seed = sampling.seed
        rng = np.random.default_rng(seed if index == 0 or seed is None else [seed, index])
        ids = np.asarray(prompt_ids, dtype=np.int64)[None]  # (1, T)
        cache = model.new_cache(1, ids.shape[1] + max_tokens)
        for made in range(1, max_tokens + 1):
            if cancelled(index):
                break
            if recorded:
                with record_attention(model) as recording:
                    logits, streams = _step(model, ids, cache, extension["top"] > 0)
                maps = recording.maps[-len(model.layers):]  # one (1, H, T, S) map per layer
            else:
                logits, streams = _step(model, ids, cache, extension["top"] > 0)
            token = int(sample_next_token(logits[None], sampling.temperature, None, sampling.top_p, rng)[0])
            values = log_softmax(logits)
            extra: dict[str, Any] = {}
            if recorded:
                extra["attention"] = [[maps[layer][0, head, -1].astype(np.float64).tolist()
                                       for head in extension["heads"]] for layer in extension["layers"]]
            if streams is not None:
                lens = model.unembed(model.final_norm(streams))  # (layers + 1, 1, V)
                extra["logit_lens"] = [_top(row[0], extension["top"]) for row in lens]
            finish = ("stop" if token in sampling.stop_ids else "length" if made == max_tokens else None)
            yield TokenEvent(index, token, float(values[token]), top_logprobs(values, logprobs), finish,
                             extra or None)
            if finish is not None:
                break
            ids = np.array([[token]], dtype=np.int64)


def _top(logits: np.ndarray, k: int) -> list[tuple[int, float]]:
    order = np.argsort(-logits.astype(np.float64), kind="stable")[:k]
    return [(int(i), float(logits[i])) for i in order]


def _step(model: Any, ids: np.ndarray, cache: Any, lens: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """The next-token logits (V,) float32 after `ids` (1, T), appended to `cache`, and with
    `lens` the residual stream at the last position entering each layer and after the last
    (layers + 1, 1, d)."""
    if not lens:  # the model's own forward: the logits `CausalLM.stream` sees
        return model.forward(ids, cache=cache, last_only=True)[0, -1], None
    T = ids.shape[1]
    positions = np.arange(cache.length, cache.length + T)[None]  # (1, T)
    model.check_tokens(ids, cache.length)
    x = model.embed_inputs(ids, positions)  # (1, T, d)
    streams = [x[:, -1]]
    for layer in range(len(model.layers)):
        x = model.run_layers(x, positions, cache, layer, layer + 1)
        streams.append(x[:, -1])
    logits = model.unembed(model.final_norm(x[:, -1:]))[0, -1]  # (V,)
    return logits.astype(np.float32, copy=False), np.stack(streams)
