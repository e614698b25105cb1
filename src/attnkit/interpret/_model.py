"""The models `attnkit.interpret` reads, as one small interface.

- attnkit decoders (`CausalLM`: GPT-2, Llama/SmolLM2, Qwen2, Mistral): everything.
- attnkit encoders (`SentenceEncoder`, `BertModel`): attention maps, ablation, value-weighted
  maps, the query/key view (no output head: no patching, lens or attribution).
- transformers models (any class defined in transformers): attention maps, through
  `output_attentions=True`, or `attnkit.record_attention` when loaded with
  attn_implementation="attnkit"; loaded so, also head interventions (ablation, head
  patching: attnkit's attention function applies the edits), and for decoders with an
  output head the residual stream (`_hf`: residual patching, the logit lens).

`ids`: a 1-D sequence of token ids, or a text tokenized with the model's tokenizer.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attnkit.models.bert import BertModel, SentenceEncoder
from attnkit.models.causal_lm import CausalLM
from attnkit.nn.interface import AttentionModule, record_attention

__all__ = [
    "attention_maps", "decoder", "encoder", "head_modules", "hf_decoder", "is_model", "layer_modules", "run",
    "token_ids",
    "vocab_size",
]


def is_transformers_model(model: Any) -> bool:
    """Whether `model` is a transformers model (checked by class, without importing torch)."""
    return type(model).__module__.startswith("transformers.") and callable(getattr(model, "named_modules", None))


def _describe(model: Any) -> str:
    return type(model).__name__


def encoder(model: Any) -> BertModel | None:
    """The `BertModel` of an attnkit encoder, or None."""
    if isinstance(model, SentenceEncoder):
        return model.model
    return model if isinstance(model, BertModel) else None


def decoder(model: Any, what: str) -> CausalLM:
    """`model` if it is an attnkit decoder; otherwise TypeError saying `what` needs one."""
    if not isinstance(model, CausalLM):
        raise TypeError(
            f"{what} needs a decoder with an output head (an attnkit CausalLM: GPT-2, Llama, SmolLM2, ...; "
            f"load one with attnkit.models.AutoCausalLM.from_pretrained, or a transformers causal LM loaded "
            f"with attn_implementation='attnkit'), got {_describe(model)}"
        )
    return model


def is_model(model: Any) -> bool:
    """Whether `model` is one `attnkit.interpret` runs: an attnkit decoder or encoder, or a
    transformers model."""
    return isinstance(model, CausalLM) or encoder(model) is not None or is_transformers_model(model)


def _check_model(model: Any) -> None:
    if isinstance(model, CausalLM) or encoder(model) is not None or is_transformers_model(model):
        return
    raise TypeError(
        "expected an attnkit model (a CausalLM such as SmolLM2 or GPT-2, a SentenceEncoder or BertModel) "
        f"or a transformers model, got {_describe(model)}"
    )


def token_ids(model: Any, ids: Any) -> np.ndarray:
    """`ids` as a (T,) int64 array: text tokenized with the model's tokenizer (special tokens
    added as the tokenizer adds them), or a 1-D integer sequence, checked."""
    _check_model(model)
    if isinstance(ids, str):
        if isinstance(model, CausalLM):
            if model.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass token ids instead of text")
            out = model.tokenizer.encode(ids)
        elif isinstance(model, SentenceEncoder):
            out = model.tokenizer.encode([ids])[0].ids
        elif is_transformers_model(model):
            out = _transformers_tokenizer(model)(ids)["input_ids"]
        else:
            raise ValueError(f"a {_describe(model)} has no tokenizer; pass token ids instead of text")
        ids = out
    array = np.asarray(ids)
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f"expected a text or a non-empty 1-D sequence of token ids, got shape {array.shape}")
    if not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"expected integer token ids, got dtype {array.dtype}")
    if isinstance(model, CausalLM):  # the model's own checks: what its forward refuses, refused here
        model.check_tokens(array[None])
    vocab = vocab_size(model)
    if array.min() < 0 or (vocab is not None and array.max() >= vocab):
        raise ValueError(f"expected token ids in [0, {vocab}), got {array.min()}..{array.max()}")
    return array.astype(np.int64)


def _transformers_tokenizer(model: Any):
    from transformers import AutoTokenizer

    source = getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "")
    if not source:
        raise ValueError(f"{_describe(model)} does not say where it was loaded from; pass token ids instead of text")
    return AutoTokenizer.from_pretrained(source, local_files_only=True)


def vocab_size(model: Any) -> int | None:
    if isinstance(model, CausalLM):
        return int(model.config.vocab_size)
    bert = encoder(model)
    if bert is not None:
        return int(bert.config.vocab_size)
    return getattr(getattr(model, "config", None), "vocab_size", None)


def layer_modules(model: Any) -> list[AttentionModule]:
    """One attention module per layer, in layer order (attnkit models only: what reads a
    module's own weights, such as value-weighted maps and the query/key view)."""
    _check_model(model)
    if isinstance(model, CausalLM):
        return [block.attn for block in model.layers]
    bert = encoder(model)
    if bert is not None:
        return [block.attn for block in bert.blocks]
    raise TypeError(
        f"this needs an attnkit model (its attention goes through attnkit's modules), got "
        f"{_describe(model)}; for a transformers model, load the same folder with "
        "attnkit.models.AutoCausalLM.from_pretrained"
    )


def head_modules(model: Any) -> list[Any]:
    """One attention module per layer, in layer order, for head interventions (`intervene`
    edits): attnkit's `AttentionModule`s, or the attention modules of a transformers model
    loaded with attn_implementation="attnkit" (ValueError for another implementation: its
    attention function applies no edits)."""
    _check_model(model)
    if not is_transformers_model(model):
        return layer_modules(model)
    from attnkit.interpret import _hf

    return [module for _, module in _hf.attention_layers(model)]


def hf_decoder(model: Any, what: str) -> bool:
    """True for a transformers model with an output head loaded with attnkit's attention
    (`what` can run on it), False for an attnkit decoder; TypeError/ValueError otherwise."""
    if isinstance(model, CausalLM):
        return False
    if is_transformers_model(model) and callable(getattr(model, "get_output_embeddings", None)) \
            and model.get_output_embeddings() is not None:
        head_modules(model)  # ValueError unless loaded with attnkit's attention
        return True
    decoder(model, what)  # raises, naming what it needs
    return False


def run(model: Any, ids: np.ndarray) -> np.ndarray:
    """One forward of a model over (T,) ids: logits (T, vocab) for a decoder, the last
    hidden state (T, d) for an encoder (NumPy; a transformers model runs under no_grad)."""
    if isinstance(model, CausalLM):
        return model.forward(ids)
    if is_transformers_model(model):
        from attnkit.interpret import _hf

        return _hf.forward(model, ids)
    bert = encoder(model)
    return bert(ids[None], token_type_ids=np.zeros((1, len(ids)), np.int64)).last_hidden_state[0]


def attention_maps(model: Any, ids: Any) -> np.ndarray:
    """Every layer's attention over one sequence: (layers, heads, T, T) in the model's dtype."""
    ids = token_ids(model, ids)
    if is_transformers_model(model):
        return _transformers_maps(model, ids)
    bert = encoder(model)
    with record_attention(model if bert is None else bert) as recording:
        run(model, ids)
    return np.stack([w[0] for w in recording.maps])


def _transformers_maps(model: Any, ids: np.ndarray) -> np.ndarray:
    import torch

    implementation = str(getattr(model.config, "_attn_implementation", "") or "")
    tensor = torch.as_tensor(ids, dtype=torch.long)[None]
    with torch.no_grad():
        if implementation.startswith("attnkit"):
            import attnkit.hf  # noqa: F401  (adds transformers models to record_attention)

            with record_attention(model) as recording:
                model(input_ids=tensor)
            maps = [np.asarray(w)[0] for w in recording.maps]
        else:
            out = model(input_ids=tensor, output_attentions=True)
            attentions = getattr(out, "attentions", None)
            if not attentions or any(a is None for a in attentions):
                raise ValueError(
                    f"{_describe(model)} returned no attention weights (attn_implementation="
                    f"{implementation or 'unknown'}); load it with attn_implementation='eager' or 'attnkit'"
                )
            maps = [a[0].detach().cpu().numpy() for a in attentions]
    return np.stack(maps)
