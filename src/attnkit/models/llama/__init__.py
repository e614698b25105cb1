"""Llama-family decoders (Llama 2/3, SmolLM2, Qwen2, Mistral): one package, one file a job.

- `config`: `LlamaConfig` and the readers of a checkpoint's keys (Hugging Face
  `config.json`, GGUF metadata), every key read, implemented or refused by name.
- `weights`: the weight name maps (Hugging Face and GGUF names -> attnkit's), the shape
  tables checked before anything is read, and `state_from_gguf`.
- `model`: `LlamaBlock` and `LlamaForCausalLM` (the math is in its docstring), its loaders
  and the quantized model built on the file's blocks; `sliding`: the sliding-window
  attention layers (Mistral, Qwen2), float and quantized.
- `fused`: when a decode step runs as one compiled call (`compiled_step_reason`, one
  function that says why not), and the step's frame built from the model's public parts.
- `batch`: `BatchStep`, rows of many sequences over a `attnkit.nn.PagedKVCache` in one call.
- `step`: the step's named frame layout (`FRAME`), `prepare` and `decode_step`, the threads
  that run it; `step_kernels`: the compiled code itself, built into one explicit object.

`attnkit.models.llama.LlamaForCausalLM` and the other names below are the public way in.
"""

from attnkit.models.llama.batch import BatchStep, StepRow, new_cache
from attnkit.models.llama.config import HF_COMPUTED_KEYS, LlamaConfig
from attnkit.models.llama.fused import compiled_step_reason
from attnkit.models.llama.model import LlamaBlock, LlamaForCausalLM
from attnkit.models.llama.sliding import QuantizedSlidingWindowSelfAttention, SlidingWindowSelfAttention
from attnkit.models.llama.weights import gguf_tensor_shapes, hf_tensor_shapes, state_from_gguf, unpermute_rotary_rows

__all__ = [
    "BatchStep",
    "HF_COMPUTED_KEYS",
    "LlamaBlock",
    "LlamaConfig",
    "LlamaForCausalLM",
    "QuantizedSlidingWindowSelfAttention",
    "SlidingWindowSelfAttention",
    "StepRow",
    "compiled_step_reason",
    "gguf_tensor_shapes",
    "hf_tensor_shapes",
    "new_cache",
    "state_from_gguf",
    "unpermute_rotary_rows",
]
