"""Maps derived from attention, as `AttentionMaps` every view draws: rollout, flow and
value-weighted attention (`attnkit show --rollout`, `--flow`, `--value-weighted`).

- rollout and flow (Abnar & Zuidema 2020, `attnkit.interpret.rollout`, in `attnkit.interpret.flow`): one map per layer,
  from the tokens after that layer back to the input tokens, the heads averaged and the
  residual connection folded in; drawn as a layer with one "head" (head 0).
- value-weighted (Kobayashi et al. 2020, `attnkit.interpret.value_weighted`): each head's
  ||alpha_ij f(x_j)||, row i divided by its sum so that it reads like attention: the share
  of query i's change that comes from key j. It needs the model itself (an attnkit model:
  minilm, smollm2, or a BERT, Llama or GPT-2 folder or GGUF file).

Each derived map keeps the tokens, special flags and truncation of the maps it came from;
`meta["kind"]` says which map it is and the model name carries it ('smollm2 (rollout)').
"""

from __future__ import annotations

import json
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from attnkit.viz.data import AttentionMaps

KINDS = ("attention", "rollout", "flow", "value-weighted")
"""What a view can draw: the attention weights, or a map derived from them."""

DESCRIPTIONS = {
    "rollout": "attention rollout: the share of each input token (columns) in each token after the layer "
               "(rows), heads averaged, residual folded in",
    "flow": "attention flow: the maximum flow from each token after the layer (rows) to each input token "
            "(columns), row-normalised",
    "value-weighted": "value-weighted attention ||alpha f(x)||, each row divided by its sum",
}

_models: dict[str, Any] = {}
_lock = threading.Lock()


def _named(maps: AttentionMaps, kind: str, weights: np.ndarray, layer_names: tuple[str, ...] | None) -> AttentionMaps:
    return replace(
        maps, weights=np.asarray(weights, dtype=np.float32), model=f"{maps.model} ({kind})" if maps.model else kind,
        meta={**maps.meta, "kind": kind}, layer_names=layer_names,
    )


def rollout_maps(maps: AttentionMaps, residual: float = 0.5) -> AttentionMaps:
    """The rollout of `maps` as AttentionMaps of shape (layers, 1, T, T): layer l holds the
    tokens after layer l read back to the input tokens (see `attnkit.interpret.rollout`)."""
    from attnkit.interpret.flow import rollout

    weights = rollout(maps.weights, residual)[:, None]  # (layers, 1, T, T)
    return _named(maps, "rollout", weights, maps.layer_names)


def flow_maps(maps: AttentionMaps, residual: float = 0.5) -> AttentionMaps:
    """The attention flow of `maps` as AttentionMaps (layers, 1, T, T) (see
    `attnkit.interpret.attention_flow`; it costs far more than rollout on long texts)."""
    from attnkit.interpret.flow import attention_flow

    weights = attention_flow(maps.weights, residual)[:, None]  # (layers, 1, T, T)
    return _named(maps, "flow", weights, maps.layer_names)


def normalise_rows(values: np.ndarray) -> np.ndarray:
    """Each row of (..., T, T) non-negative values divided by its sum (all-0 rows stay 0)."""
    values = np.asarray(values, dtype=np.float64)
    total = values.sum(axis=-1, keepdims=True)
    return np.divide(values, total, out=np.zeros_like(values), where=total > 0)


def value_weighted_maps(maps: AttentionMaps, model: Any) -> AttentionMaps:
    """Kobayashi et al.'s norms of `model` on the tokens of `maps`, rows normalised.

    Arguments:
        maps: what the model's attention gave on a text (its tokens say which ids to run).
        model: the attnkit model that made `maps` (a CausalLM, SentenceEncoder or BertModel).
    """
    from attnkit.interpret.norms import value_weighted

    ids = _token_ids(model, maps)
    norms = value_weighted(model, ids).heads  # (layers, heads, T, T)
    if norms.shape != maps.weights.shape:
        raise ValueError(f"expected value-weighted maps of shape {maps.weights.shape} like the attention, "
                         f"got {norms.shape}")
    return _named(maps, "value-weighted", normalise_rows(norms), maps.layer_names)


def _token_ids(model: Any, maps: AttentionMaps) -> np.ndarray:
    """The ids the provider ran for `maps.text`, cut to the tokens `maps` shows."""
    from attnkit.models.causal_lm import CausalLM

    T = maps.num_tokens
    if isinstance(model, CausalLM):
        ids = list(model.tokenizer.encode(maps.text))[:T]
    else:  # a BERT encoder: [CLS] ... [SEP]; a cut text ends with [SEP] as the provider's does
        ids = list(model.tokenizer.encode([maps.text])[0].ids)
        if len(ids) > T:
            ids = ids[: T - 1] + ids[-1:]
    if len(ids) != T:
        raise ValueError(f"expected {T} tokens like the attention maps, the model's tokenizer gave {len(ids)}")
    return np.asarray(ids, dtype=np.int64)


def load_model(name: str) -> Any:
    """The attnkit model behind a view's `--model` (minilm, smollm2, or a BERT, Llama or GPT-2
    folder or GGUF file), loaded once per process: the one its provider already runs
    (`attnkit.viz.providers.get_provider(name).model`), not a second copy.

    Raises:
        ValueError: `random` or an architecture attnkit runs only through transformers
            (value-weighted maps read attnkit's own attention modules).
    """
    with _lock:
        if name not in _models:
            _models[name] = _load(name)
        return _models[name]


def _load(name: str) -> Any:
    if name == "random":
        raise ValueError("value-weighted maps need a model with value and output projections to read: "
                         "use --model minilm, smollm2, or a model path (random draws its maps only)")
    from attnkit.viz.providers import get_provider

    shared = get_provider(name).model  # the views' own copy (None: a model run through transformers)
    if shared is not None:
        return shared
    if name == "minilm":
        return _encoder(None)
    if name == "smollm2":
        return _decoder(None)
    path = Path(name).expanduser()
    config = path / "config.json"
    if path.is_dir() and config.is_file():
        from attnkit.models.auto import CAUSAL_LM_TYPES
        from attnkit.viz.providers import OWN_ENCODER_TYPES

        model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type")
        if model_type in OWN_ENCODER_TYPES:
            return _encoder(path)
        if model_type not in CAUSAL_LM_TYPES:
            raise ValueError(f"value-weighted maps need a model attnkit runs itself (BERT, Llama, GPT-2, Qwen2, "
                             f"Mistral), got model_type {model_type!r} in {str(path)!r}")
    return _decoder(path)


def _encoder(path: Path | None) -> Any:
    from attnkit.models.sentence import SentenceEncoder

    return SentenceEncoder.from_pretrained(path)


def _decoder(path: Path | None) -> Any:
    from attnkit.models.auto import AutoCausalLM

    return AutoCausalLM.from_pretrained(path)


def derive(maps: AttentionMaps, kind: str, *, model: Any = None, residual: float = 0.5) -> AttentionMaps:
    """`maps`, or the map of `kind` derived from them.

    Arguments:
        maps: the attention of a model on a text.
        kind: one of `KINDS`: "attention" (maps as they are), "rollout", "flow",
            "value-weighted".
        model: for "value-weighted", the model that produced `maps`: its `--model` name
            (loaded once), or the attnkit model itself, already loaded (a provider's
            `Provider.model`).
        residual: the identity's share for rollout and flow.
    """
    if kind not in KINDS:
        raise ValueError(f"expected kind to be one of {', '.join(KINDS)}, got {kind!r}")
    if kind == "attention":
        return maps
    if kind == "rollout":
        return rollout_maps(maps, residual)
    if kind == "flow":
        return flow_maps(maps, residual)
    if model is None:
        raise ValueError("value-weighted maps need the model that made the maps (model=its name or the model)")
    return value_weighted_maps(maps, load_model(model) if isinstance(model, str) else model)
