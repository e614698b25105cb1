"""Packaging promises: the import graph has no cycle and flows one way, imports stay light,
`pip install attnkit` runs the README's main command, a missing extra is named, a working
console script."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import attnkit
from attnkit.extras import EXTRAS

SRC = Path(attnkit.__file__).parent  # src/attnkit
ROOT = SRC.parent.parent  # the repository
HEAVY = ("torch", "matplotlib", "fastapi", "uvicorn", "starlette", "transformers", "flask")
WEB = ("fastapi", "starlette", "uvicorn", "flask", "django", "aiohttp", "tornado")


def _imported_after(code: str) -> set[str]:
    probe = f"import sys\n{code}\nprint(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    return set(out.split())


# ----------------------------------------------------------------------------- import laziness


def test_import_attnkit_stays_light():
    loaded = _imported_after("import attnkit, attnkit.nn, attnkit.masks, attnkit.functional")
    heavy = sorted(m for m in loaded if m.split(".")[0] in HEAVY)
    assert not heavy, f"import attnkit pulled in {heavy}"


def test_subpackages_are_attributes_after_import_attnkit():
    """`import attnkit` then `attnkit.nn` works, as `import torch` then `torch.nn` does."""
    code = (
        "import attnkit\n"
        "attnkit.nn.MultiHeadAttention, attnkit.masks.causal_mask, attnkit.functional.softmax\n"
        "attnkit.models.SentenceEncoder, attnkit.viz.AttentionMaps\n"
        "assert {'nn', 'models', 'viz', 'masks', 'functional'} <= set(dir(attnkit))\n"
        "try:\n    attnkit.nonexistent\nexcept AttributeError:\n    pass\nelse:\n    raise SystemExit(1)"
    )
    heavy = sorted(m for m in _imported_after(code) if m.split(".")[0] in HEAVY)
    assert not heavy, f"attnkit.nn / models / viz pulled in {heavy}"


def test_record_attention_is_a_lazy_attribute():
    """`attnkit.record_attention` loads attnkit.nn on first use, not on `import attnkit`."""
    assert "attnkit.nn" not in _imported_after("import attnkit")
    code = "import attnkit\nassert attnkit.record_attention is attnkit.nn.record_attention\n" \
           "assert 'record_attention' in dir(attnkit)"
    loaded = _imported_after(code)
    assert "attnkit.nn.interface" in loaded
    assert not sorted(m for m in loaded if m.split(".")[0] in HEAVY)


def test_models_viz_and_bench_stay_light():
    """Importing the model, view and benchmark packages (and the names they load lazily)
    loads no optional package: not even the checkpoint readers until a model loads."""
    loaded = _imported_after(
        "import attnkit.models, attnkit.viz, attnkit.bench, attnkit.runtime\n"
        "from attnkit.models import AutoCausalLM, SentenceEncoder, GGUFFile, DecoderTokenizer\n"
        "from attnkit.viz import AttentionMaps, get_provider, heatmap\n"
        "from attnkit.bench import SUITES, BenchReport\n"
    )
    optional = {*HEAVY, "scipy", "gguf", "jinja2", "prompt_toolkit", "tokenizers", "safetensors", "threadpoolctl"}
    heavy = sorted(m for m in loaded if m.split(".")[0] in optional)
    assert not heavy, f"importing models / viz / bench pulled in {heavy}"


@pytest.mark.slow  # measured > 2 s in the quick loop
def test_torch_modules_load_context_parallelism_only_when_asked():
    """`import attnkit.torch` and its modules (MultiHeadAttention, TransformerBlock) leave
    attnkit.torch.distributed (and run_on_ranks' module) unloaded until a module is given
    `context_parallel`; the names that moved keep their old spellings."""
    pytest.importorskip("torch")
    loaded = _imported_after(
        "import attnkit.torch\n"
        "from attnkit.torch import MultiHeadAttention, TransformerBlock\n"
        "TransformerBlock(8, 2, 16)(__import__('torch').zeros(1, 3, 8), is_causal=True)\n"
    )
    assert "attnkit.torch.attention" in loaded
    assert not {"attnkit.torch.distributed", "attnkit.torch.ranks"} & loaded
    code = (
        "import attnkit.torch.distributed as D, attnkit.torch.ranks as R\n"
        "assert D.run_on_ranks is R.run_on_ranks and D.RankOutcome is R.RankOutcome\n"
        "assert D._ring_attention is D.ring_attention\n"
        "from attnkit.models.generation import AttentionMap, CausalLM, prepare_prompts, sample_next_token\n"
        "import attnkit.models as M, attnkit.models.causal_lm as C, attnkit.models.sampling as S\n"
        "assert CausalLM is C.CausalLM is M.CausalLM and AttentionMap is C.AttentionMap is M.AttentionMap\n"
        "assert sample_next_token is S.sample_next_token and prepare_prompts is S.prepare_prompts\n"
        "import attnkit.functional._checks as K, attnkit.functional.precision as P\n"
        "assert K.TINY_SCALE == P.TINY_SCALE and K.scores_bound_exceeds is P.scores_bound_exceeds\n"
    )
    assert "attnkit.torch.distributed" in _imported_after(code)


def test_cli_help_stays_light_and_lists_commands():
    loaded = _imported_after(
        "import sys; sys.argv=['attnkit','--help']\n"
        "from attnkit.cli import app\n"
        "try:\n    app()\nexcept SystemExit:\n    pass"
    )
    heavy = sorted(m for m in loaded if m.split(".")[0] in HEAVY)
    assert not heavy, f"attnkit --help pulled in {heavy}"
    help_text = subprocess.run(
        [sys.executable, "-m", "attnkit", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for command in ("demo", "walkthrough"):
        assert command in help_text


# ----------------------------------------------------------------------------- the import graph
#
# An edge A -> B means module A imports module B, anywhere in A: at module level or inside
# a function (DESIGN.md: no cycles, "not even through imports inside functions"). Edges:
#
# - `import attnkit.x.y`, `from attnkit.x import y` (to attnkit.x.y when y is a module, else
#   to attnkit.x, whose __init__ defines y), `from . import y` and `from ..x import y`;
# - an import by name: a string that is exactly a module's dotted name (importlib, a table
#   of suites), and a package __init__'s lazy tables (`_LAZY` values and `_SUBMODULES`: the
#   submodules its PEP 562 `__getattr__` imports).
#
# Not edges: a module's own ancestors named in a string (`importlib.resources.files("attnkit")`
# reads package data; Python imported that package before the module anyway), and the
# implicit import of a module's parent package.


def _module_files() -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package __init__), for every module under src/attnkit."""
    modules = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute name of a relative import (`from ..x import y` in `module`)."""
    if level == 0:
        return name or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _imports(module: str, path: Path, is_package: bool, modules: dict) -> dict[str, int]:
    """Every attnkit module that `module` imports -> the first line doing so."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found: dict[str, int] = {}

    def add(target: str, line: int) -> None:
        if target.split(".")[0] != "attnkit":
            return
        while target not in modules:  # `import attnkit.x.y` of a name that is not a module
            target = target.rsplit(".", 1)[0]
        if target != module:
            found.setdefault(target, line)

    ancestors = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node.level, node.module)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                add(submodule if submodule in modules else base, node.lineno)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value in modules and node.value not in ancestors:
                add(node.value, node.lineno)
    if is_package:
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            if not any(isinstance(t, ast.Name) and t.id in ("_LAZY", "_SUBMODULES") for t in targets):
                continue
            table = node.value
            names = table.values if isinstance(table, ast.Dict) else getattr(table, "elts", [])
            for name in names:
                if isinstance(name, ast.Constant) and f"{module}.{name.value}" in modules:
                    add(f"{module}.{name.value}", node.lineno)
    return found


def _import_graph() -> dict[str, dict[str, int]]:
    modules = _module_files()
    return {name: _imports(name, path, is_package, modules) for name, (path, is_package) in modules.items()}


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (a, b, ..., a) through each strongly connected component of more than one
    module (Tarjan's algorithm, then a path back to the component's first module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, {}):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    cycles = []
    for component in components:  # the shortest way from its first module back to it
        start, members = component[0], set(component)
        parent: dict[str, str | None] = {start: None}
        queue, end = [start], None
        while end is None:
            node = queue.pop(0)
            if start in graph[node]:
                end = node
            for target in sorted(graph[node]):
                if target in members and target not in parent:
                    parent[target] = node
                    queue.append(target)
        path = []
        while end is not None:
            path.append(end)
            end = parent[end]
        cycles.append(path[::-1] + [start])
    return cycles


def _describe(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    steps = [f"{a} (line {graph[a][b]}) -> {b}" for a, b in zip(cycle, cycle[1:])]
    return "\n  ".join(steps)


def test_the_import_graph_is_read_right():
    """The walker sees function-level, relative and by-name imports (else the cycle test proves nothing)."""
    graph = _import_graph()
    assert "attnkit.functional.softmax" in graph["attnkit.functional"]  # module level
    assert "attnkit.models.auto" in graph["attnkit.cli.generate"]  # inside a function
    assert "attnkit.bench.attention" in graph["attnkit.bench"]  # the suite table, by name
    assert "attnkit.models.auto" in graph["attnkit.models"]  # a PEP 562 lazy table
    assert {"attnkit.nn", "attnkit.models", "attnkit.viz"} <= set(graph["attnkit"])  # _SUBMODULES
    assert "attnkit" not in graph["attnkit.models.chat"]  # resources of its own package: not an edge
    modules = _module_files()
    relative = _resolve("attnkit.nn.block", False, 1, "attention"), _resolve("attnkit.nn", True, 2, "masks")
    assert relative == ("attnkit.nn.attention", "attnkit.masks") and set(relative) <= set(modules)
    assert _cycles({"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3, "d": 4}, "d": {}}) == [["a", "b", "c", "a"]]


def test_no_import_cycles():
    graph = _import_graph()
    cycles = _cycles(graph)
    assert not cycles, "import cycles (DESIGN.md: none, not even inside functions):\n" + "\n".join(
        f"  {_describe(cycle, graph)}" for cycle in cycles
    )


def test_functional_and_nn_never_import_torch_matplotlib_or_a_web_framework():
    forbidden = {"torch", "matplotlib", "scipy", "transformers", *WEB}
    found = []
    for name, (path, _) in _module_files().items():
        if not name.startswith(("attnkit.functional", "attnkit.nn")):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            found += [f"{name} (line {node.lineno}) imports {n}" for n in names if n.split(".")[0] in forbidden]
    assert not found, "\n".join(found)


# Which layers each layer may import (DESIGN.md: functional <- nn <- models <- viz / cli).
# `attnkit.runtime` (threads, optional packages) sits under all of them; the package
# itself (`attnkit`, re-exporting functional) may be imported from above.
ALLOWED = {
    "deprecation": set(),  # helpers of deprecated spellings: under every layer
    "extras": set(),  # optional packages: under every layer
    "runtime": {"deprecation", "extras"},  # aliases of their names, until 0.3.0
    "kernels": {"runtime"},  # compiled loops: below everything that uses them
    "functional": {"kernels", "runtime"},
    "masks": {"functional"},
    "nn": {"functional", "kernels", "runtime"},
    "walkthrough": {"functional", "nn"},
    "quant": {"functional", "kernels", "nn", "runtime"},  # GGML blocks: loops on kernels, layers on nn
    "models": {"functional", "kernels", "nn", "quant", "runtime"},
    "torch": {"functional", "nn", "runtime"},
    "interpret": {"functional", "nn", "models", "hf", "runtime"},  # hf: transformers models' hooks
    "viz": {"functional", "masks", "nn", "models", "hf", "interpret", "runtime"},  # hf: views of transformers folders
    "serve": {"functional", "masks", "nn", "models", "hf", "interpret", "viz", "runtime"},  # viz: the page's views
    "hf": {"attnkit", "functional", "masks", "nn", "torch", "runtime"},
    "bench": {"attnkit", "functional", "kernels", "masks", "nn", "models", "quant", "torch", "hf", "interpret",
              "serve", "runtime"},  # serve: `attnkit bench serve` runs the server it measures
}
for _layer, _below in ALLOWED.items():  # runtime's neighbours sit under every layer
    if "runtime" in _below:
        _below |= {"deprecation", "extras"}

# Deprecated aliases (CHANGELOG.md), kept one release where a name used to live: each may
# import its names' new home, wherever that is, and nothing else imports it. (The moved
# module paths of 0.2, `attnkit.viz.server`, `attnkit.kernels.quant`, ..., are no files:
# `attnkit/__init__.py`'s MOVED_MODULES maps them to their new homes.)
MOVED = {"attnkit.models.quantized": "attnkit.quant"}


def test_layers_import_downward_only():
    def layer(module: str) -> str:
        return module.split(".")[1] if "." in module else "attnkit"

    graph = _import_graph()
    upward = [
        f"{a} (line {line}) imports {b}"
        for a, targets in graph.items()
        for b, line in targets.items()
        if layer(a) in ALLOWED and layer(b) != layer(a) and layer(b) not in ALLOWED[layer(a)]
        and not (a in MOVED and b.startswith(MOVED[a]))
    ]
    importers = [f"{a} imports the deprecated {b}" for a, targets in graph.items() for b in targets
                 if b in MOVED]
    assert not importers, "\n".join(importers)
    assert not upward, "imports against the layers' direction:\n" + "\n".join(upward)


def test_moved_module_paths_are_no_files_and_import_with_a_warning():
    """0.2's moved module paths (`attnkit.MOVED_MODULES`) are no files under the layer below
    their new home (no arrow points up at it, not even by name); importing one warns, naming
    the new home, and gives the module that holds its names; no module of the package
    imports an old path."""
    import importlib
    import re

    pytest.importorskip("fastapi")
    moved = attnkit.MOVED_MODULES.moved
    assert {"attnkit.viz.server", "attnkit.kernels.quant", "attnkit.kernels.decode"} <= set(moved)
    modules = _module_files()
    for old, (target, home) in moved.items():
        assert old not in modules and target in modules, old
        sys.modules.pop(old, None)
        with pytest.warns(DeprecationWarning, match=re.escape(f"{old} is deprecated: use {home}")):
            module = importlib.import_module(old)
        assert module is importlib.import_module(target)
    importers = []
    for name, (path, is_package) in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, is_package, node.level, node.module)
                names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            else:
                continue
            importers += [f"{name} (line {node.lineno}) imports {n}" for n in names if n in moved]
    assert not importers, "\n".join(importers)


def test_moved_modules_take_a_table_of_strings_and_install_once():
    from attnkit.deprecation import MovedModules

    before = list(sys.meta_path)
    assert MovedModules(dict(attnkit.MOVED_MODULES.moved)).install() is attnkit.MOVED_MODULES
    assert sys.meta_path == before  # an equal table is not installed twice
    with pytest.raises(TypeError, match=r"expected old path -> \(module, new home\) strings, got 'a.b': 'c.d'"):
        MovedModules({"a.b": "c.d"})
    hook = MovedModules({"attnkit_test_old.path": ("json", "json")})
    assert hook.find_spec("json") is None and hook.find_spec("attnkit_test_old.path").loader is hook


# ----------------------------------------------------------------------------- extras


def _requirement_name(requirement: str) -> str:
    """The import name of a requirement string ('prompt_toolkit>=3' -> 'prompt_toolkit')."""
    name = requirement.split(";")[0]
    for separator in "<>=!~[ ":
        name = name.split(separator)[0]
    return name.strip().lower().replace("-", "_")


def test_extras_in_pyproject_match_the_runtime_table():
    tomllib = pytest.importorskip("tomllib", reason="Python 3.10 has no tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras = project["optional-dependencies"]
    core = {_requirement_name(r) for r in project["dependencies"]}
    assert core == {"numpy", "rich", "typer", "threadpoolctl", "safetensors", "tokenizers"}, core
    for extra, modules in EXTRAS.items():
        assert {_requirement_name(r) for r in extras[extra]} == set(modules), extra
    everything = {_requirement_name(r) for extra in EXTRAS for r in extras[extra]}
    assert everything - {"torch", "transformers"} == {_requirement_name(r) for r in extras["all"]}  # all: no torch
    assert everything <= {_requirement_name(r) for r in extras["test"]}  # the test extra has them all


BLOCKED = ("gguf", "jinja2", "prompt_toolkit", "matplotlib", "fastapi", "uvicorn", "starlette", "torch", "scipy",
           "transformers", "sentence_transformers")


def _cli_without_extras(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`attnkit ARGS` in a Python where only the core dependencies can be imported."""
    code = (
        "import importlib.abc, sys\n"
        f"BLOCKED = {BLOCKED!r}\n"
        "class NotInstalled(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in BLOCKED:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, NotInstalled())\n"
        f"sys.argv = ['attnkit', *{args!r}]\n"
        "from attnkit.cli import main\n"
        "main()\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, "COLUMNS": "200"})


@pytest.mark.slow
def test_the_main_command_runs_on_the_core_dependencies(minilm_folder, tmp_path):
    result = _cli_without_extras(["show", "The cat sat on the mat because it was tired.", "--no-color"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "cat" in result.stdout and result.stderr.count("error") == 0


def test_a_missing_extra_is_named_in_one_line(tmp_path):
    """`--png` without matplotlib: one line naming the extra, exit 1, before any work, no file."""
    result = _cli_without_extras(["show", "Hello", "--model", "random", "--png", "out.png"], tmp_path)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: --png needs the package 'matplotlib', which is not installed; "
        "install it with: pip install 'attnkit[png]'"
    ]
    assert list(tmp_path.iterdir()) == []
    result = _cli_without_extras(["train", "--steps", "1"], tmp_path)
    assert result.returncode == 1 and "pip install 'attnkit[torch]'" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


@pytest.mark.slow
def test_a_gguf_model_without_the_gguf_extra_says_which_extra(smollm2_file, tmp_path):
    result = _cli_without_extras(["generate", "The capital of France is", "-n", "2"], tmp_path)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (  # named before the model loads
        "error: attnkit generate needs the gguf extra: pip install 'attnkit[gguf]'"
    )
    assert "Traceback" not in result.stderr


def test_require_names_the_extra(monkeypatch):
    from attnkit.extras import MissingExtraError, require

    monkeypatch.setitem(EXTRAS, "pictures", ("attnkit_no_such_package",))
    with pytest.raises(MissingExtraError) as info:
        require("attnkit_no_such_package", "pictures", "Drawing")
    assert str(info.value) == ("Drawing needs the package 'attnkit_no_such_package', which is not installed; "
                               "install it with: pip install 'attnkit[pictures]'")
    assert isinstance(info.value, ImportError) and info.value.name == "attnkit_no_such_package"
