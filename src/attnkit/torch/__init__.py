"""attnkit's PyTorch side (optional extra `attnkit[torch]`).

- `MultiHeadAttention`, `TransformerBlock`, `FeedForward` (plus `Linear`,
  `LayerNorm`): torch modules with attnkit.nn's class names, arguments and
  state-dict keys, running on F.scaled_dot_product_attention;
- `from_numpy` / `to_numpy` / `numpy_state_dict`: move weights between the two sides;
- `from_torch` / `to_torch`: to and from torch's own `nn.MultiheadAttention` and
  `nn.TransformerEncoderLayer` (`attnkit.torch.interop` holds every crossing);
- `flash_attention` / `FlashAttentionFunction`: attnkit's tiled algorithm as a
  torch autograd Function (forward keeps lse, backward recomputes);
- `attnkit.torch.induction`: the induction-head task behind `attnkit train`.

Importing this module imports torch; `import attnkit` never does.
"""

from __future__ import annotations

from attnkit.runtime import require

require("torch", "torch", "attnkit.torch")  # the torch side: without torch, say which pip command brings it

from attnkit.torch.flash import FlashAttentionFunction, FlashOutput, flash_attention
from attnkit.torch.attention import AttentionResult, MultiHeadAttention
from attnkit.torch.block import BlockOutput, TransformerBlock
from attnkit.torch.cache import KVCache
from attnkit.torch.layers import ACTIVATIONS, FeedForward, LayerNorm, Linear
from attnkit.torch.interop import from_numpy, from_torch, numpy_state_dict, to_numpy, to_torch

__all__ = [
    "ACTIVATIONS",
    "AttentionResult",
    "BlockOutput",
    "FeedForward",
    "FlashAttentionFunction",
    "FlashOutput",
    "KVCache",
    "LayerNorm",
    "Linear",
    "MultiHeadAttention",
    "TransformerBlock",
    "flash_attention",
    "from_numpy",
    "from_torch",
    "numpy_state_dict",
    "to_numpy",
    "to_torch",
]
