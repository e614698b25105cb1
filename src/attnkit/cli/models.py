"""`attnkit models`, and the one check of every command's `--model`.

attnkit never downloads anything. It loads the three models that ship as pip
packages (found on disk, never imported), a small untrained model for the
views, and any model folder or `.gguf` file given by its path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from rich.text import Text

from attnkit.cli._app import app, console, fail, say, usage

ENCODER, DECODER, ANY = "encoder", "decoder", "any"

_USED_BY = {
    "minilm": "embed, similarity, show and compare (their default), serve",
    "smollm2": "generate and chat (their default), show, compare, serve",
    "gemma3": "generate, chat, show, compare, serve",
    "random": "show, compare, serve",
}

HOW_TO_ADD = (
    "Any other model: give its path to --model. A BERT-family folder (config.json, model.safetensors, "
    "tokenizer.json or vocab.txt) works with embed, similarity, show, compare and serve; a Llama, Qwen2 or "
    "Gemma 3 .gguf file with generate, chat, show, compare and serve; a Llama, Gemma 3 or GPT-2 folder (config.json, "
    "*.safetensors, tokenizer.json) with generate, chat, show, compare and serve. A folder of any other "
    "transformers architecture (config.json, weights, tokenizer.json) works with show, compare and serve, "
    "run by transformers with attnkit's attention (pip install 'attnkit[hf]')."
)


BACKEND_HELP = (
    "Attention backend: naive (exact, forms the weights) or flash (tiled, O(n) memory), "
    "or any name registered in attnkit.functional.ATTENTION_BACKENDS."
)


def check_backend(name: str) -> str:
    """`--backend` checked before anything loads: a usage error naming the known backends."""
    from attnkit.functional import ATTENTION_BACKENDS

    if name not in ATTENTION_BACKENDS:
        usage(f"expected --backend to be one of {', '.join(sorted(ATTENTION_BACKENDS))}, got {name!r}")
    return name


def model_option(name: Optional[str], kind: str, command: str) -> Optional[str]:
    """Check a command's `--model` before anything loads; exit with the reason if it cannot work.

    Arguments:
        name: what the user gave (None: the command's default).
        kind: ENCODER (embed, similarity), DECODER (generate, chat) or ANY (the views).
        command: the command's name, for messages.

    Returns:
        None for the embedded model of that kind, else the name to load (a provider name
        for ANY, a path otherwise).
    """
    from attnkit.viz.providers import ModelNotAvailableError, check_model_name

    if kind == ENCODER and name in (None, "minilm"):
        return None
    if kind == DECODER and name in (None, "smollm2"):
        return None
    if kind == ENCODER and name in ("smollm2", "gemma3", "random"):
        fail(f"{name} is not a sentence encoder; attnkit {command} needs minilm or the path of a "
             "BERT-family folder (see `attnkit models`)")
    if kind == DECODER and name in ("minilm", "random"):
        fail(f"{name} does not generate text; attnkit {command} needs smollm2, a .gguf file or a Llama "
             "or GPT-2 folder (see `attnkit models`)")
    assert name is not None
    try:
        check_model_name(name)
    except ModelNotAvailableError as error:
        fail(str(error))
    if kind == ENCODER and not Path(name).expanduser().is_dir():
        fail(f"cannot read a sentence encoder from {name!r}: expected a BERT-family folder holding "
             "config.json and model.safetensors")
    return name


def missing_extras(model: Optional[str], *, template: bool = False, prompt: bool = False) -> list[str]:
    """The extras a run on `model` (smollm2, minilm, random or a path; None = the
    command's embedded default) needs and this machine lacks, found without importing
    them: gguf for a GGUF file, chat for a chat template (`template`) or the terminal
    prompt (`prompt`)."""
    from importlib.util import find_spec

    wanted = []
    if model in ("smollm2", "gemma3") or (model is not None and str(model).lower().endswith(".gguf")):
        wanted.append(("gguf", "gguf"))
    elif model is not None and Path(model).expanduser().is_dir() and any(Path(model).expanduser().glob("*.gguf")):
        wanted.append(("gguf", "gguf"))
    if template:
        wanted.append(("jinja2", "chat"))
    if prompt:
        wanted.append(("prompt_toolkit", "chat"))
    def absent(module: str) -> bool:
        try:
            return find_spec(module) is None
        except (ImportError, ValueError):  # a finder that refuses it: not importable here
            return True

    return sorted({extra for module, extra in wanted if absent(module)})


def _extras_line(extras: list[str]) -> str:
    return f"the {', '.join(extras)} extra{'s' if len(extras) > 1 else ''}: pip install 'attnkit[{','.join(extras)}]'"


def require_pieces(model: Optional[str], kind: str, command: str, *, template: bool = False,
                   prompt: bool = False) -> None:
    """Everything a command needs that is missing, in one line, before anything loads:
    the embedded model's package and every extra (not one at a time, after a long load)."""
    if kind == DECODER and model is None:
        model = "smollm2"
    package = _where(model)[1] if model in ("smollm2", "minilm", "gemma3") else ""  # why it is missing, or ""
    extras = missing_extras(model, template=template, prompt=prompt)
    if extras:
        fail(f"attnkit {command} needs {_extras_line(extras)}" + (f"; and {package}" if package else ""))
    if package:
        fail(package)


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _human(size: int) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size} bytes"  # pragma: no cover


def _where(name: str) -> tuple[Optional[Path], str]:
    """(the model's file or folder, '') when installed, else (None, the reason with the install command)."""
    from attnkit.models import embedded

    try:
        if name == "gemma3":
            return embedded.gemma3_gguf_path(), ""
        return (embedded.minilm_path() if name == "minilm" else embedded.smollm2_gguf_path()), ""
    except embedded.ModelPackageNotFoundError as error:
        return None, str(error)


@app.command()
def models() -> None:
    """List the models attnkit can load here, where they are, and how to add one. Nothing is downloaded."""
    from attnkit.viz.providers import PROVIDERS

    console.print(Text("Models attnkit can load on this machine", style="bold"))
    for name, info in PROVIDERS.items():
        console.print()
        console.print(Text.assemble((f"{name:<8}", "bold"), info.description), soft_wrap=True)
        if name == "random":
            say(f"{'':8}built in: random weights, no checkpoint")
        else:
            path, reason = _where(name)
            package = info.install.split()[-1]
            missing = missing_extras(name)
            if path is None:
                say(f"{'':8}not installed ({package}): {reason}", style="yellow")
            elif missing:
                say(f"{'':8}installed from the pip package {package}: {path} ({_human(_size(path))}), "
                    f"but it needs {_extras_line(missing)}", style="yellow")
            else:
                say(f"{'':8}installed from the pip package {package}: {path} ({_human(_size(path))})")
        say(f"{'':8}used by: {_USED_BY[name]}")
    console.print()
    say(HOW_TO_ADD)
    say("attnkit never downloads anything: it reads these packages and the paths you give, offline.")
