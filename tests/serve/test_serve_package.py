"""`attnkit.serve` is the one home of the web server: FastAPI and uvicorn are imported there
only, `import attnkit.serve` loads neither, and the old `attnkit.viz.*` paths still work
(with a DeprecationWarning) for one release."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import attnkit

SRC = Path(attnkit.__file__).parent
WEB = ("fastapi", "starlette", "uvicorn", "pydantic")
MOVED = ("openai_api", "openai_models", "openai_requests", "server", "http_checks")


def test_web_packages_are_imported_only_in_serve():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        module = ".".join(path.relative_to(SRC.parent).with_suffix("").parts)
        if module.startswith("attnkit.serve"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            found += [f"{module} (line {node.lineno}) imports {n}" for n in names if n.split(".")[0] in WEB]
    assert not found, "\n".join(found)


def test_import_attnkit_serve_stays_light():
    probe = "import sys, attnkit.serve\nprint(' '.join(sorted(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert not [m for m in loaded if m.split(".")[0] in WEB]


@pytest.mark.parametrize("name", MOVED)
def test_old_viz_paths_warn_and_give_the_same_objects(name):
    pytest.importorskip("fastapi")
    new = importlib.import_module(f"attnkit.serve.{name}")
    sys.modules.pop(f"attnkit.viz.{name}", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = importlib.import_module(f"attnkit.viz.{name}")
    assert any(issubclass(w.category, DeprecationWarning) and f"attnkit.serve.{name}" in str(w.message)
               for w in caught)
    public = [n for n in vars(new) if not n.startswith("_") and callable(getattr(new, n))]
    assert public and all(getattr(old, n) is getattr(new, n) for n in public)


def test_the_package_names_its_parts_lazily():
    pytest.importorskip("fastapi")
    import attnkit.serve as serve
    from attnkit.serve.server import BackgroundServer, create_app

    assert serve.create_app is create_app and serve.BackgroundServer is BackgroundServer
    with pytest.raises(AttributeError):
        serve.nonexistent
