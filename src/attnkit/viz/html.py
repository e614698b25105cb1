"""A self-contained interactive HTML view, and the page `attnkit serve` uses.

One file holds everything: the page, its CSS and JavaScript (from
`attnkit/viz/assets/`, inlined) and the weights. It loads nothing from the
network; its Content-Security-Policy forbids it, and allows only the one
script whose hash it lists.

Weights travel as 8-bit codes q = round(255 * sqrt(w)) (the square root keeps
small weights visible: w = 0.002 gets q = 11), gzipped and base64-encoded. The
page keeps them as bytes and decodes when it draws, so 512 tokens of a 30-layer
model fit in memory. Token text is embedded in JSON whose '<', '>' and '&' are
escaped, and the page inserts it with textContent only.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from attnkit.viz.data import AttentionMaps
from attnkit.viz.summary import pattern_difference, summarize_heads


def encode_weights(weights: np.ndarray, level: int = 6) -> str:
    """(layers, heads, T, T) weights as base64 of gzipped codes round(255 * sqrt(w)).

    `level` is gzip's compression level (1 fastest, 9 smallest).
    """
    w = np.clip(np.nan_to_num(np.asarray(weights, dtype=np.float32), nan=0.0), 0.0, 1.0)
    codes = np.rint(np.sqrt(w) * 255).astype(np.uint8)
    return base64.b64encode(gzip.compress(codes.tobytes(), compresslevel=level, mtime=0)).decode("ascii")


def decode_weights(data: str, shape: tuple[int, ...]) -> np.ndarray:
    """The inverse of `encode_weights` (up to rounding): float32 array of `shape`."""
    codes = np.frombuffer(gzip.decompress(base64.b64decode(data)), dtype=np.uint8)
    return ((codes.astype(np.float32) / 255) ** 2).reshape(shape)


def doc_payload(maps: AttentionMaps, level: int = 6) -> dict[str, Any]:
    """The JSON-ready description of one `AttentionMaps` that the page reads."""
    summary = summarize_heads(maps)
    return {
        "model": maps.model,
        "text": maps.text,
        "tokens": list(maps.tokens),
        "layers": maps.num_layers,
        "heads": maps.num_heads,
        "causal": maps.causal,
        # encoder-decoders: which is which; local/global layers: their windows
        "layer_names": (None if maps.layer_names is None and maps.windows is None else
                        [maps.layer_description(layer) for layer in range(maps.num_layers)]),
        "windows": None if maps.windows is None else list(maps.windows),
        "kind": maps.meta.get("kind", "attention"),  # rollout/flow: one map per layer, heads averaged
        "truncated_from": maps.truncated_from,
        "hide": maps.hidden_tokens().tolist(),  # what "hide special tokens" drops
        "weights": encode_weights(maps.weights, level),
        "summary": {
            "pattern": summary.pattern.tolist(),
            "previous": np.round(summary.previous, 4).tolist(),
            "first": np.round(summary.first, 4).tolist(),
            "self": np.round(summary.self, 4).tolist(),
            "entropy": np.round(summary.entropy, 4).tolist(),
        },
    }


def payload(
    maps: AttentionMaps | Sequence[AttentionMaps], *, layer: int = 0, head: int | None = 0, level: int = 6
) -> dict[str, Any]:
    """Documents, the first selection, and (for two texts) where their heads differ."""
    docs = [maps] if isinstance(maps, AttentionMaps) else list(maps)
    if not docs:
        raise ValueError("expected at least one AttentionMaps, got none")
    layer = docs[0].check_layer(layer)
    head = -1 if head is None else docs[0].check_head(head)
    out: dict[str, Any] = {"docs": [doc_payload(d, level) for d in docs], "layer": layer, "head": head}
    if len(docs) == 2:
        diff = pattern_difference(docs[0], docs[1])
        out["difference"] = {
            "method": "rows" if docs[0].num_tokens == docs[1].num_tokens else "summary",
            "values": np.round(diff, 4).tolist(),
        }
    return out


def safe_json(value: Any) -> str:
    """JSON that can sit inside a <script> element: no '<', '>', '&', U+2028 or U+2029."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    for char, escape in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"),
                         ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(char, escape)
    return text


def _asset(name: str) -> str:
    return resources.files("attnkit.viz").joinpath("assets", name).read_text(encoding="utf-8")


def script_hash() -> str:
    """The CSP source ('sha256-...') of the page's one script."""
    digest = hashlib.sha256(_asset("viewer.js").encode("utf-8")).digest()
    return "'sha256-" + base64.b64encode(digest).decode("ascii") + "'"


def content_security_policy(*, server: bool = False) -> str:
    """The page's policy: its own script only, no network (a served page may call its origin)."""
    parts = [
        "default-src 'none'",
        f"script-src {script_hash()}",
        "style-src 'unsafe-inline'",
        "img-src data: blob:",
        "connect-src 'self'" if server else "connect-src 'none'",
        "base-uri 'none'",
        "form-action 'none'",
    ]
    return "; ".join(parts)


def render_page(config: dict[str, Any], *, server: bool = False) -> str:
    """The viewer page with `config` (see `payload`) embedded as JSON."""
    page = _asset("viewer.html")
    page = page.replace("{{CSP}}", content_security_policy(server=server))
    page = page.replace("{{CSS}}", _asset("viewer.css"))
    page = page.replace("{{JS}}", _asset("viewer.js"))
    before, after = page.split("{{DATA}}")
    return before + safe_json(config) + after


def render_html(
    maps: AttentionMaps | Sequence[AttentionMaps],
    *,
    layer: int = 0,
    head: int | None = 0,
    title: str | None = None,
    hide_special: bool = False,
    log_scale: bool = False,
    view: str = "all",
) -> str:
    """One self-contained HTML page showing `maps` (one text, or two to compare).

    Arguments:
        maps: one AttentionMaps, or two from the same model to compare.
        layer, head: what the page shows first (head None = mean of the layer's heads).
        title: the page title; by default names the model.
        hide_special, log_scale: the page's two checkboxes, ticked or not at first
            ("hide special tokens", "log colour scale"); the page can change both.
        view: "all", "head" (the head view and matrix only) or "model" (the model view only).
    """
    if view not in ("all", "head", "model"):
        raise ValueError(f"expected view 'all', 'head' or 'model', got {view!r}")
    config = payload(maps, layer=layer, head=head)
    config["options"] = {"hide_special": bool(hide_special), "log_scale": bool(log_scale)}
    config["view"] = view
    docs = [maps] if isinstance(maps, AttentionMaps) else list(maps)
    config["mode"] = "file"
    config["title"] = title or f"attnkit: attention of {docs[0].model}"
    config["subtitle"] = (
        "Two sentences side by side, same model, same head."
        if len(docs) == 2
        else "Pick a layer and head; hover a token to see where it attends."
    )
    config["warnings"] = [
        f"The text was truncated to {d.num_tokens} tokens (it had {d.truncated_from})."
        for d in docs
        if d.truncated_from
    ]
    return render_page(config)


def save_html(maps: AttentionMaps | Sequence[AttentionMaps], path: str | Path, **kwargs: Any) -> Path:
    """Write `render_html(maps, **kwargs)` to `path` (UTF-8) and return the path."""
    path = Path(path)
    path.write_text(render_html(maps, **kwargs), encoding="utf-8")
    return path
