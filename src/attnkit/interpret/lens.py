"""The residual stream read as logits: the logit lens and direct logit attribution.

Logit lens (nostalgebraist, 2020; TransformerLens's `accumulated_resid` + `apply_ln_to_stack`):
the residual stream entering each layer, and after the last, through the final norm (each
with its own scale) and the unembedding: lens[l] = unembed(norm(resid_l)).

Direct logit attribution: the residual stream at the last position is a sum of parts,

    resid = embeddings + sum_l (sum_h head_lh + b_O,l) + sum_l mlp_l,
    head_lh = z_lh @ W_O,lh^T          (the head's output, (E,) -> (d,), before the bias)

and with the final norm's scale s frozen (TransformerLens's `apply_ln=True`), the answer's
logit is linear in them: logit = sum_parts norm_s(part) @ u + b @ u, where u is the answer's
unembedding column (minus the wrong answer's), norm_s(c) = (c - mean(c)) / s * g for a
LayerNorm (GPT-2) and c / s * g for an RMSNorm (Llama), and b the LayerNorm's bias. The
parts sum to the logit exactly, up to rounding.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from attnkit.interpret import _hf
from attnkit.interpret._capture import capturing
from attnkit.interpret._model import decoder, head_modules, hf_decoder, layer_modules, token_ids
from attnkit.interpret._stream import residuals
from attnkit.nn.decoder_layers import RMSNorm
from attnkit.nn.layers import LayerNorm

__all__ = ["LogitAttribution", "direct_logit_attribution", "logit_lens", "top_tokens"]


def logit_lens(model: Any, ids: Any) -> np.ndarray:
    """The logits each layer's residual stream would give.

    Arguments:
        model: an attnkit decoder, or a transformers causal LM loaded with
            attn_implementation="attnkit".
        ids: text or a 1-D sequence of token ids (T,).

    Returns:
        (layers + 1, T, vocab) in the model's dtype: entry l is the residual stream entering
        layer l (entry 0: the embeddings; the last: after the last layer, the model's logits)
        through the final norm and the unembedding.
    """
    if hf_decoder(model, "logit_lens"):
        ids = token_ids(model, ids)
        return _hf.lens(model, np.concatenate(_hf.residuals(model, ids)))
    model = decoder(model, "logit_lens")
    ids = token_ids(model, ids)
    stream = np.concatenate(residuals(model, ids))  # (layers + 1, T, d)
    return model.unembed(model.final_norm(stream))


class LogitAttribution(NamedTuple):
    """What `direct_logit_attribution` returns; the parts sum to `total`.

    heads: (layers, heads) each head's direct contribution.
    mlps: (layers,) each MLP's (its biases included).
    embeddings: the token (and position) embeddings'.
    biases: the attention output biases' and the final norm's bias (0 when none).
    total: the sum of every part: the logit (difference) the model gives, up to rounding.
    """

    heads: np.ndarray
    mlps: np.ndarray
    embeddings: float
    biases: float
    total: float


def _token(model: Any, token: Any, what: str) -> int:
    if isinstance(token, str):
        ids = token_ids(model, token)
        if len(ids) != 1:
            raise ValueError(f"expected {what} to be one token, got {token!r} -> {len(ids)} tokens {ids.tolist()}")
        return int(ids[0])
    if isinstance(token, bool) or not isinstance(token, (int, np.integer)):
        raise TypeError(f"expected {what} as a token id (int) or a one-token text, got {type(token).__name__}")
    vocab = int(model.config.vocab_size)
    if not 0 <= int(token) < vocab:
        raise ValueError(f"expected {what} in [0, {vocab}), got {token}")
    return int(token)


def _unembedding(model: Any, columns: list[int]) -> np.ndarray:
    """The unembedding columns of `columns`: (d, k) float64 (logit = hidden @ them)."""
    d = int(model.config.hidden_size)
    eye = np.eye(d, dtype=np.float32 if model.dtype != np.float64 else np.float64)
    parts = []
    for start in range(0, d, 64):  # one-hot hidden states, 64 at a time: each logit is one weight, exactly
        parts.append(model.unembed(eye[None, start : start + 64])[0][:, columns])  # (64, k)
    return np.concatenate(parts).astype(np.float64)


def direct_logit_attribution(model: Any, ids: Any, answer: Any, wrong: Any = None) -> LogitAttribution:
    """Each head's and MLP's direct contribution to the answer's logit at the last position.

    Arguments:
        model: an attnkit decoder (GPT-2 or Llama family), or a transformers causal LM loaded
            with attn_implementation="attnkit" whose final norm is a LayerNorm or an RMSNorm
            (x / rms * weight) and whose attention ends in one output projection.
        ids: text or a 1-D sequence of token ids.
        answer: the answer token (an id, or a text that is one token).
        wrong: another token: attribute the difference logit(answer) - logit(wrong).

    Returns:
        LogitAttribution(heads (layers, heads), mlps (layers,), embeddings, biases, total),
        float64, with the final norm's scale frozen at its value on the full stream.
    """
    if hf_decoder(model, "direct_logit_attribution"):
        return _hf_attribution(model, ids, answer, wrong)
    model = decoder(model, "direct_logit_attribution")
    ids = token_ids(model, ids)
    columns = [_token(model, answer, "answer")] + ([] if wrong is None else [_token(model, wrong, "wrong")])
    norm = model.norm
    if not isinstance(norm, (LayerNorm, RMSNorm)):
        raise TypeError(f"direct_logit_attribution knows LayerNorm and RMSNorm final norms, got {type(norm).__name__}")
    W = _unembedding(model, columns)  # (d, k)
    modules = layer_modules(model)
    with capturing(modules, keep=lambda call: call.output[0, :, -1].astype(np.float64)) as found:  # (H, E)
        stream = [r[0, -1].astype(np.float64) for r in residuals(model, ids)]  # layers + 1 of (d,)
    layered = isinstance(norm, LayerNorm)
    projections = [(np.asarray(m.out_proj.weight, np.float64),
                    None if m.out_proj.bias is None else np.asarray(m.out_proj.bias, np.float64)) for m in modules]
    final_bias = np.asarray(norm.bias, np.float64) if layered and norm.bias is not None else None
    final = _FinalNorm(layered, np.asarray(norm.weight, np.float64), final_bias, float(norm.eps))
    return _attribute(stream, [calls[0] for calls in found], projections, final, W, wrong is not None, 0.0)


class _FinalNorm(NamedTuple):
    """The final norm, as attribution freezes it: centred (LayerNorm) or not (RMSNorm)."""

    layered: bool
    weight: np.ndarray  # (d,)
    bias: np.ndarray | None  # (d,)
    eps: float


def _attribute(stream: list[np.ndarray], z: list[np.ndarray], projections: list[tuple[np.ndarray, Any]],
               norm: _FinalNorm, W: np.ndarray, difference: bool, head_bias: float) -> LogitAttribution:
    """The decomposition of the module docstring, in float64.

    Arguments:
        stream: layers + 1 residual streams at the last position, each (d,).
        z: per layer, the heads' outputs at the last position (H, E).
        projections: per layer, the output projection (d, H*E) and its bias (d,) or None.
        W: (d, k) the answer's unembedding column (and the wrong one's); difference: k == 2.
        head_bias: the unembedding's own bias for the answer (minus the wrong one's).
    """
    u = W[:, 0] - W[:, 1] if difference else W[:, 0]  # (d,)

    def direction(part: np.ndarray) -> np.ndarray:
        """part (..., d) -> its logit (difference), through the frozen norm."""
        if norm.layered:
            part = part - part.mean(axis=-1, keepdims=True)
        return part / scale * norm.weight @ u

    final = stream[-1]
    centred = final - final.mean() if norm.layered else final
    scale = np.sqrt(np.mean(centred**2) + norm.eps)
    heads = np.zeros((len(z), max(part.shape[0] for part in z)))
    mlps = np.zeros(len(z))
    biases = head_bias
    if norm.bias is not None:
        biases += float(norm.bias @ u)
    for layer, (weight, bias) in enumerate(projections):
        H, E = z[layer].shape
        W_O = weight.reshape(-1, H, E)  # (d, H, E)
        written = np.einsum("he,dhe->hd", z[layer], W_O)  # (H, d) each head's output
        bias = np.zeros(W_O.shape[0]) if bias is None else bias
        heads[layer, :H] = direction(written)
        biases += float(direction(bias))
        mlp = stream[layer + 1] - stream[layer] - written.sum(axis=0) - bias
        mlps[layer] = float(direction(mlp))
    embeddings = float(direction(stream[0]))
    total = float(heads.sum() + mlps.sum() + embeddings + biases)
    return LogitAttribution(heads=heads, mlps=mlps, embeddings=embeddings, biases=biases, total=total)


def _hf_attribution(model: Any, ids: Any, answer: Any, wrong: Any) -> LogitAttribution:
    """`direct_logit_attribution` on a transformers causal LM loaded with attnkit's attention."""
    ids = token_ids(model, ids)
    columns = [_token(model, answer, "answer")] + ([] if wrong is None else [_token(model, wrong, "wrong")])
    modules = head_modules(model)
    with capturing(modules, keep=lambda call: call.output[0, :, -1].astype(np.float64)) as found:  # (H, E)
        stream = [r[0, -1].astype(np.float64) for r in _hf.residuals(model, ids)]  # layers + 1 of (d,)
    W, head_bias = _hf.unembedding(model, columns)  # (d, k), (k,)
    layered, weight, bias, eps = _hf.norm_parameters(model)
    final = _FinalNorm(layered, weight, bias, eps)
    difference = wrong is not None
    return _attribute(stream, [calls[0] for calls in found], [_hf.out_projection(m) for m in modules], final, W,
                      difference, float(head_bias[0] - head_bias[1] if difference else head_bias[0]))


def top_tokens(model: Any, lens: Any, k: int = 1) -> list[list[list[str]]]:
    """The k most likely tokens at each layer and position of a logit lens, decoded.

    Arguments:
        model: the model whose tokenizer decodes the ids (an attnkit decoder, or any object
            with `tokenizer.decode(ids)`).
        lens: (layers + 1, T, vocab) logits, as `logit_lens` returns.
        k: how many tokens per cell (1 .. vocab), best first.

    Returns:
        [layer][position] -> k token strings, best first (ties in id order).
    """
    lens = np.asarray(lens)
    if lens.ndim != 3:
        raise ValueError(f"expected lens of shape (layers + 1, T, vocab) as logit_lens returns, got {lens.shape}")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"expected k to be an int >= 1, got {k!r}")
    decode = getattr(getattr(model, "tokenizer", None), "decode", None)
    if decode is None:
        raise TypeError(f"expected a model with a tokenizer to decode the tokens, got {type(model).__name__}")
    k = min(int(k), lens.shape[-1])
    some = np.argpartition(-lens, k - 1, axis=-1)[..., :k]  # (layers + 1, T, k), unordered
    order = np.argsort(-np.take_along_axis(lens, some, axis=-1), axis=-1, kind="stable")
    best = np.take_along_axis(some, order, axis=-1)  # best first
    return [[[decode([int(i)]) for i in cell] for cell in row] for row in best]
