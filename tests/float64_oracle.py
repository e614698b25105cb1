"""A float64-throughout transcription of a transformers decoder: the truth float32 is measured from.

`copy.deepcopy(model).double()` is not float64 throughout: transformers' Llama-family
RMSNorm normalizes in float32 (`hidden_states.to(torch.float32)`), its rotary embedding
rounds the angles position * theta_i to float32 (`position_ids.float() * inv_freq.float()`,
theta_i itself computed in float32), and its eager attention takes the softmax in float32.
`float64_transcription` replaces the first two forwards with the same formulas in float64
and attends with "sdpa" (float64 stays float64 there). The rotary frequencies of a scaled
rope (linear, dynamic, yarn, llama3) are `attnkit.nn.positional.rope_frequencies` in float64,
whose formulas are checked against transformers' own `ROPE_INIT_FUNCTIONS` in
test_checkpoint_decoders.py; the default ones are written out here.
"""

from __future__ import annotations

import copy
import types

import numpy as np


def _rms_norm64(self, hidden):
    import torch

    hidden = hidden.to(torch.float64)
    return self.weight * (hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _rotary64(self, x, position_ids):
    import torch

    theta, scaling, head_dim = self._float64_rope
    if scaling is None:
        inv_freq = 1.0 / (float(theta) ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    else:
        from attnkit.nn.positional import rope_frequencies

        seq_len = int(position_ids.max()) + 1  # dynamic: the current length, as a fresh transformers model
        inv_freq = torch.from_numpy(rope_frequencies(head_dim, theta, scaling, seq_len=seq_len, dtype=np.float64))
    angles = position_ids[..., None].to(torch.float64) * inv_freq  # (B, T, E/2)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos() * self.attention_scaling, angles.sin() * self.attention_scaling


def _rope_of(config) -> tuple[float, object, int]:
    """(theta, attnkit's RopeScaling or None, head dim) of a transformers config."""
    parameters = dict(getattr(config, "rope_parameters", None) or {})
    theta = parameters.get("rope_theta", getattr(config, "rope_theta", None))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if parameters.get("rope_type", "default") == "default":
        return float(theta), None, int(head_dim)
    from attnkit.models.llama import LlamaConfig  # the scaling's parameters, as attnkit's loader reads them

    ours = LlamaConfig.from_hf(config.to_dict())
    return ours.rope_theta, ours.rope_scaling, ours.head_dim


def float64_transcription(model):
    """A float64 copy of transformers' `model` with no float32 rounding left (see above)."""
    truth = copy.deepcopy(model).double()
    truth.config._attn_implementation = "sdpa"
    for module in truth.modules():
        name = type(module).__name__
        if name.endswith("RMSNorm"):
            module.forward = types.MethodType(_rms_norm64, module)
        elif name.endswith("RotaryEmbedding"):
            module._float64_rope = _rope_of(truth.config)
            module.forward = types.MethodType(_rotary64, module)
    return truth
