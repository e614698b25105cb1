"""The one data structure every view draws: `AttentionMaps`.

A view never talks to a model. A provider (see `attnkit.viz.providers`) runs a
model on a text and returns `AttentionMaps`; the terminal, PNG, HTML and web
views only read it.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

_SPECIAL = re.compile(r"\[(CLS|SEP|PAD|MASK|UNK|BOS|EOS)\]|<\|[^|<>]*\|>|</?s>|<(pad|unk|mask|bos|eos)>")
"""How a special token is written when no tokenizer said which tokens are special: `[CLS]`,
`[SEP]`, `<|im_start|>`, `<s>`, `</s>`, `<pad>`..."""


def looks_special(token: str) -> bool:
    """Whether a token's text is that of a special token (`[CLS]`, `<|im_end|>`, `</s>`, ...)."""
    return _SPECIAL.fullmatch(token) is not None


@dataclass(frozen=True)
class AttentionMaps:
    """Attention weights of every layer and head for one text.

    Arguments:
        tokens: the T token strings, in order (shown as text, never as markup).
        weights: (layers, heads, T, T); row i holds where query token i attends,
            so each row sums to 1 (or to 0 for a fully masked row). Also taken as
            transformers returns attentions (`outputs.attentions`, bertviz's input): a
            tuple or list of one (1, H, T, T) or (H, T, T) torch tensor or NumPy array per
            layer, stacked here into a NumPy array (float32 for torch's half types).
        model: a short name of the model that produced the weights.
        text: the input text.
        causal: True when the model could only attend to earlier tokens.
        truncated_from: the token count before truncation, or None if the whole
            text fitted the model.
        special: T booleans, True for the tokenizer's special tokens (`[CLS]`, `[SEP]`,
            `<|im_start|>`...); None reads them from the token text (`looks_special`).
        hidden: how many tokens `hide_special` removed (0 for maps as the model gave them).
        layer_names: a name per layer where layers are not all alike (an encoder-decoder:
            "encoder 0", "decoder 0", "decoder 0 cross attention"), shown in `label`; None
            when every layer is a plain self-attention layer.
        windows: per layer, the sliding window of a local layer (a query sees its last
            `window` tokens, itself included) or None for a global one (Gemma 3: five local
            layers of 512 to one global); shown in `label`, drawn by the views
            (`outside_window`). None when no layer has a window.
        positions: each token's position in the model's input (`hide_special` drops some);
            None: 0 .. T - 1.
    """

    tokens: tuple[str, ...]
    weights: np.ndarray
    model: str = ""
    text: str = ""
    causal: bool = False
    truncated_from: int | None = None
    meta: dict = field(default_factory=dict, compare=False)
    special: tuple[bool, ...] | None = None
    hidden: int = 0
    layer_names: tuple[str, ...] | None = None
    windows: tuple[int | None, ...] | None = None
    positions: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        tokens = tuple(str(t) for t in self.tokens)
        object.__setattr__(self, "tokens", tokens)
        special = tuple(looks_special(t) for t in tokens) if self.special is None else tuple(map(bool, self.special))
        if len(special) != len(tokens):
            raise ValueError(f"expected {len(tokens)} special flags like tokens, got {len(special)}")
        object.__setattr__(self, "special", special)
        weights = _stacked_weights(self.weights)
        if weights.ndim != 4 or weights.shape[2] != weights.shape[3]:
            raise ValueError(
                f"expected weights of shape (layers, heads, T, T), got {weights.shape}"
            )
        if weights.shape[2] != len(tokens):
            raise ValueError(
                f"expected weights with T={len(tokens)} like tokens, got {weights.shape}"
            )
        if len(tokens) == 0:
            raise ValueError("expected at least one token, got 0")
        if not np.issubdtype(weights.dtype, np.floating):
            raise TypeError(f"expected floating-point weights, got {weights.dtype}")
        object.__setattr__(self, "weights", weights)
        if self.layer_names is not None:
            names = tuple(str(name) for name in self.layer_names)
            if len(names) != weights.shape[0]:
                raise ValueError(f"expected {weights.shape[0]} layer names like layers, got {len(names)}")
            object.__setattr__(self, "layer_names", names)
        if self.windows is not None:
            windows = tuple(None if w is None else _positive("window", w) for w in self.windows)
            if len(windows) != weights.shape[0]:
                raise ValueError(f"expected {weights.shape[0]} windows like layers, got {len(windows)}")
            object.__setattr__(self, "windows", windows if any(w is not None for w in windows) else None)
        if self.positions is not None:
            positions = tuple(int(i) for i in self.positions)
            if len(positions) != len(tokens) or any(b <= a for a, b in zip(positions, positions[1:])):
                raise ValueError(f"expected {len(tokens)} increasing positions like tokens, got {list(positions)}")
            object.__setattr__(self, "positions", positions)

    @property
    def num_layers(self) -> int:
        return int(self.weights.shape[0])

    @property
    def num_heads(self) -> int:
        return int(self.weights.shape[1])

    @property
    def num_tokens(self) -> int:
        return int(self.weights.shape[2])

    def check_layer(self, layer: int) -> int:
        """Return `layer` as an index in 0..layers-1 (negatives count from the end)."""
        return _check_index("layer", layer, self.num_layers, "layers")

    def check_head(self, head: int) -> int:
        """Return `head` as an index in 0..heads-1 (negatives count from the end)."""
        return _check_index("head", head, self.num_heads, "heads")

    def head(self, layer: int, head: int | None = None) -> np.ndarray:
        """The (T, T) weights of one head, or the mean over heads when `head` is None."""
        layer = self.check_layer(layer)
        if head is None:
            return self.weights[layer].mean(axis=0)
        return self.weights[layer, self.check_head(head)]

    def label(self, layer: int, head: int | None) -> str:
        """A short title such as 'layer 2, head 5' or 'layer 2, mean of 12 heads' (a rollout or
        flow map, which folds in every head: 'layer 2, all heads')."""
        layer = self.check_layer(layer)
        if self.meta.get("kind") in ("rollout", "flow"):  # one map per layer, through every head
            return f"{self._layer_label(layer)}, all heads"
        if head is None:
            return f"{self._layer_label(layer)}, mean of {self.num_heads} heads"
        return f"{self._layer_label(layer)}, head {self.check_head(head)}"

    def _layer_label(self, layer: int) -> str:
        """'layer 3', or 'layer 3 (decoder 0 cross attention)' where layers have names, or
        'layer 3 (local: window 512)' / 'layer 5 (global)' where some have windows."""
        description = self.layer_description(layer)
        return f"layer {layer}" if description is None else f"layer {layer} ({description})"

    def window_of(self, layer: int) -> int | None:
        """The sliding window of `layer` (a query sees its last `window` tokens), None: global."""
        layer = self.check_layer(layer)
        return None if self.windows is None else self.windows[layer]

    def layer_description(self, layer: int) -> str | None:
        """The layer's name and, where some layers have windows, 'local: window 512' or
        'global' (None: neither). Rollout and flow maps mix every layer below: no window."""
        parts = [] if self.layer_names is None else [self.layer_names[layer]]
        if self.windows is not None and self.meta.get("kind") not in ("rollout", "flow"):
            window = self.windows[layer]
            parts.append("global" if window is None else f"local: window {window}")
        return ", ".join(parts) or None

    def outside_window(self, layer: int) -> np.ndarray | None:
        """(T, T) booleans, True where a local layer's query cannot see the key because it is
        older than the window (key position <= query position - window); None for a global
        layer, or one whose window reaches every key shown."""
        window = self.window_of(layer)
        if window is None:
            return None
        position = np.arange(self.num_tokens) if self.positions is None else np.asarray(self.positions)
        outside = position[None, :] <= position[:, None] - window
        return outside if outside.any() else None

    @property
    def hidden_note(self) -> str:
        """'' or, after `hide_special`, a note such as '2 special tokens hidden, rows renormalised'."""
        if not self.hidden:
            return ""
        what = "special token" if not self.causal else "special or first token"
        return f"{self.hidden} {what}{'s' if self.hidden > 1 else ''} hidden, rows renormalised"

    def hidden_tokens(self) -> np.ndarray:
        """Indices of the tokens `hide_special` drops: the special tokens and, in a causal
        model, the first token, where decoders park the attention they do not need (the
        "attention sink"). Never every token: at least one is kept."""
        drop = np.array(self.special, dtype=bool)
        if self.causal:
            drop[0] = True
        if drop.all():
            drop[-1] = False
        return np.flatnonzero(drop)

    def hide_special(self) -> "AttentionMaps":
        """These maps without special tokens (and a causal model's first token), renormalised.

        The rows and columns of the hidden tokens are removed, then every row is divided by
        what is left of it, so each row again sums to 1: the weights say how a token spreads
        the attention it gives to the tokens still shown. A row left with no weight at all
        stays 0. The result is a view for the eye, not what the model computes.
        """
        drop = self.hidden_tokens()
        if not drop.size:
            return self
        keep = np.setdiff1d(np.arange(self.num_tokens), drop)
        weights = self.weights[:, :, keep][:, :, :, keep].astype(np.float64)  # (layers, heads, T', T')
        total = weights.sum(axis=-1, keepdims=True)
        weights = np.divide(weights, total, out=np.zeros_like(weights), where=total > 0)
        positions = np.arange(self.num_tokens) if self.positions is None else np.asarray(self.positions)
        return replace(
            self, tokens=tuple(self.tokens[i] for i in keep), weights=weights.astype(self.weights.dtype),
            special=tuple(self.special[i] for i in keep), hidden=self.hidden + int(drop.size),
            positions=tuple(int(positions[i]) for i in keep),
        )


def _as_array(value: Any) -> np.ndarray:
    """A NumPy array of an array, or of a torch tensor (torch already imported when one is
    passed; half and bfloat16 tensors become float32, which NumPy can hold)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        if value.dtype in (torch.float16, torch.bfloat16):
            value = value.float()
        return value.numpy()
    return np.asarray(value)


def _stacked_weights(weights: Any) -> np.ndarray:
    """(layers, heads, T, T) from a stacked array or tensor, or from one map per layer as
    transformers returns them: (1, H, T, T) (batch size 1) or (H, T, T) each."""
    if not isinstance(weights, (list, tuple)):
        return _as_array(weights)
    if not weights:
        raise ValueError("expected one attention map per layer, got an empty sequence (transformers 5's "
                         "outputs[-1] is cross_attentions, empty for an encoder: pass outputs.attentions)")
    layers = [_as_array(w) for w in weights]
    shapes = sorted({w.shape for w in layers})
    if len(shapes) != 1 or len(shapes[0]) not in (3, 4):
        raise ValueError(f"expected every layer's map of one shape (1, H, T, T) or (H, T, T), got {shapes}")
    if len(shapes[0]) == 4:
        if shapes[0][0] != 1:
            raise ValueError(
                f"expected maps of batch size 1, (1, H, T, T) per layer, got {shapes[0]}; pick one "
                "sequence: [layer[i:i + 1] for layer in outputs.attentions]"
            )
        layers = [w[0] for w in layers]
    return np.stack(layers)  # (layers, H, T, T)


def _positive(what: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"expected each {what} to be a positive int or None, got {value!r}")
    return int(value)


def _check_index(what: str, value: int, size: int, plural: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"expected {what} as an int, got {type(value).__name__}")
    if not -size <= value < size:
        raise ValueError(
            f"{what} {value} is out of range: the model has {size} {plural}, "
            f"valid {plural} are 0..{size - 1}"
        )
    return int(value) % size


def maps_from_random_model(
    tokens: list[str] | tuple[str, ...],
    *,
    layers: int = 2,
    heads: int = 4,
    d_model: int = 32,
    causal: bool = False,
    seed: int = 0,
    model: str = "random",
) -> AttentionMaps:
    """Attention of a small random-weight transformer (`attnkit.nn.TransformerBlock`s) on `tokens`.

    Used by tests and demos before (or without) a real checkpoint. Each token's
    embedding is drawn from a hash of its text (so equal tokens get equal
    embeddings), plus a sinusoidal position code; query and key projections
    are scaled up so that the untrained heads attend less uniformly.

    Returns:
        AttentionMaps with float32 weights of shape (layers, heads, T, T).
    """
    from attnkit.nn import TransformerBlock, record_attention, sinusoidal_positional_encoding

    tokens = tuple(tokens)
    if not tokens:
        raise ValueError("expected at least one token, got 0")
    T = len(tokens)
    d_model = heads * max(4, -(-d_model // heads))  # a multiple of heads
    rng = np.random.default_rng(seed)
    x = np.stack([_token_vector(t, d_model, seed) for t in tokens])  # (T, D)
    x = (x + sinusoidal_positional_encoding(T, d_model, dtype=np.float64))[None]  # (1, T, D)
    x = x.astype(np.float32)
    weights = np.empty((layers, heads, T, T), dtype=np.float32)
    for layer in range(layers):
        block = TransformerBlock(d_model, heads, 2 * d_model, norm_first=True, seed=rng)
        # Untrained heads attend almost uniformly; sharper queries and keys give
        # them distinct patterns worth looking at.
        state = block.state_dict()
        for name in ("attn.q_proj.weight", "attn.k_proj.weight"):
            state[name] = state[name] * np.float32(3.0)
        block.load_state_dict(state)
        with record_attention(block) as recording:
            x = block(x, is_causal=causal)
        weights[layer] = recording.maps[0][0]  # (H, T, T)
    return AttentionMaps(tokens=tokens, weights=weights, model=model, text=" ".join(tokens), causal=causal)


def _token_vector(token: str, d_model: int, seed: int) -> np.ndarray:
    import zlib

    h = zlib.crc32(token.encode("utf-8")) ^ (seed * 0x9E3779B1 & 0xFFFFFFFF)
    return np.random.default_rng(h).normal(0, 1, d_model)
