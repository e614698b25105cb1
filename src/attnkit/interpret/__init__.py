"""What each head does, and whether it matters.

Works on attnkit's own models (BERT/MiniLM encoders, GPT-2 and Llama-family decoders such
as SmolLM2) and on transformers models: attention maps, and, when loaded with
attn_implementation="attnkit", ablation, patching, the logit lens and attribution. `ids` is a 1-D
integer array or a text (tokenized with the model's tokenizer); results are NumPy arrays
indexed ``[layer, head]`` unless stated. See docs/interpret.md for the formulas.

- Detectors: `detect_heads(model, ids, pattern)` (TransformerLens's `detect_head`, "mul";
  the patterns: `detection_pattern`), `induction_scores(model, length, seed)` (on
  `repeated_random_tokens`), `sink_scores(model, ids, epsilon)`.
- Interventions: `ablate(model, heads, how)` (a context manager), `head_importance(model, ids)`
  (the loss with each head alone ablated, every head in one batched sweep), `patch_heads` and
  `patch_residual` (activation patching).
- The residual stream: `logit_lens(model, ids)` (`top_tokens(model, lens, k)` decodes its best
  tokens), `direct_logit_attribution(model, ids, answer)`.
- Maps: `value_weighted(model, ids)` (Kobayashi et al.'s norms), `rollout(weights)` and
  `attention_flow(weights)` (Abnar & Zuidema; or `rollout(model, ids)`: the model's attention), and `query_key_contributions(model, ids, layer,
  head, query, key)` (each dimension's part of one score).

Every name loads on first use: `import attnkit.interpret` imports nothing heavy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> the submodule (under attnkit.interpret) that defines it
_LAZY = {
    "HEAD_PATTERNS": "heads",
    "SinkScores": "heads",
    "detect_heads": "heads",
    "detection_pattern": "heads",
    "induction_scores": "heads",
    "repeated_random_tokens": "heads",
    "sink_scores": "heads",
    "ablate": "ablation",
    "HeadImportance": "importance",
    "head_importance": "importance",
    "patch_heads": "patching",
    "patch_residual": "patching",
    "LogitAttribution": "lens",
    "direct_logit_attribution": "lens",
    "logit_lens": "lens",
    "top_tokens": "lens",
    "ValueWeighted": "norms",
    "value_weighted": "norms",
    "QueryKeyContributions": "query_key",
    "query_key_contributions": "query_key",
    "attention_flow": "flow",
    "rollout": "flow",
}

if TYPE_CHECKING:  # what static tools see; at run time __getattr__ loads these
    from attnkit.interpret.ablation import ablate  # noqa: F401
    from attnkit.interpret.importance import HeadImportance, head_importance  # noqa: F401
    from attnkit.interpret.heads import (  # noqa: F401
        HEAD_PATTERNS,
        SinkScores,
        detect_heads,
        detection_pattern,
        induction_scores,
        repeated_random_tokens,
        sink_scores,
    )
    from attnkit.interpret.lens import LogitAttribution, direct_logit_attribution, logit_lens, top_tokens  # noqa: F401
    from attnkit.interpret.patching import patch_heads, patch_residual  # noqa: F401
    from attnkit.interpret.query_key import QueryKeyContributions, query_key_contributions  # noqa: F401
    from attnkit.interpret.flow import attention_flow, rollout  # noqa: F401
    from attnkit.interpret.norms import ValueWeighted, value_weighted  # noqa: F401


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'attnkit.interpret' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"attnkit.interpret.{_LAZY[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_LAZY))


__all__ = sorted(_LAZY)
