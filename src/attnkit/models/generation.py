"""Text generation for attnkit's decoders, under the name it had in 0.1.0.

The `CausalLM` base class (and `AttentionMap`, what its `attention` returns) now
lives in `attnkit.models.causal_lm`, the decoding helpers (`prepare_prompts`,
`sample_next_token`, `apply_repetition_penalty`) in `attnkit.models.sampling`;
this module re-exports both, so `from attnkit.models.generation import CausalLM`
keeps working.
"""

from __future__ import annotations

from attnkit.models.causal_lm import AttentionMap, CausalLM
from attnkit.models.sampling import apply_repetition_penalty, prepare_prompts, sample_next_token

__all__ = ["AttentionMap", "CausalLM", "apply_repetition_penalty", "sample_next_token", "prepare_prompts"]
