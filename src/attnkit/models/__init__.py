"""Real pretrained checkpoints running on attnkit's attention.

Names load lazily (PEP 562), so `import attnkit.models` stays light: the
tokenizer and safetensors libraries load only when a model does.
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> submodule that defines it
_LAZY = {
    "BertConfig": "bert_config",
    "BertModel": "bert_model",
    "BertOutput": "bert_model",
    "BertTokenizer": "bert_tokenizer",
    "SentenceEncoder": "sentence",
    "SentenceTransformer": "sentence",
    "CheckpointError": "checkpoint",
    "ModelPackageNotFoundError": "embedded",
    "minilm_path": "embedded",
    "smollm2_gguf_path": "embedded",
    "gemma3_gguf_path": "embedded",
    "AttentionMap": "causal_lm",
    "AutoCausalLM": "auto",
    "CausalLM": "causal_lm",
    "DecoderTokenizer": "chat",
    "GGUFFile": "gguf",
    "GPT2Config": "gpt2",
    "GPT2LMHeadModel": "gpt2",
    "LlamaConfig": "llama",
    "LlamaForCausalLM": "llama",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'attnkit.models' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"attnkit.models.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_LAZY))


__all__ = sorted(_LAZY)
