"""`import attnkit.torch` without torch names its pip command, as every other extra does, and
points at PyTorch's CPU wheels (PyPI's Linux torch is the 3 GB CUDA build)."""

from __future__ import annotations

import subprocess
import sys


def test_import_attnkit_torch_without_torch_names_the_pip_command():
    code = (
        "import importlib.abc, sys\n"
        "class NotInstalled(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'torch':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, NotInstalled())\n"
        "from attnkit.runtime import MissingExtraError\n"
        "try:\n"
        "    import attnkit.torch\n"
        "except MissingExtraError as error:\n"
        "    print(error)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == (
        "attnkit.torch needs the package 'torch', which is not installed; install it with: "
        "pip install 'attnkit[torch]' (no GPU? install the CPU build first, far smaller: "
        "pip install torch --index-url https://download.pytorch.org/whl/cpu)"
    )
