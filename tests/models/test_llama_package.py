"""`attnkit.models.llama` as a package: its public names, and the old homes of the compiled
step kept one release as deprecated aliases."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

import attnkit


def test_the_package_exports_what_the_module_did():
    import attnkit.models.llama as llama

    for name in ("LlamaConfig", "LlamaBlock", "LlamaForCausalLM", "unpermute_rotary_rows", "HF_COMPUTED_KEYS",
                 "hf_tensor_shapes", "gguf_tensor_shapes", "state_from_gguf", "SlidingWindowSelfAttention",
                 "compiled_step_reason"):
        assert getattr(llama, name) is not None and name in llama.__all__


@pytest.mark.parametrize("old, new, names", [
    ("attnkit.kernels.decode", "attnkit.models.llama.step", ("decode_step", "prepare", "FRAME", "shared_size")),
    ("attnkit.models.fused_decode", "attnkit.models.llama.fused", ("fused_logits", "compiled_step_reason")),
])
def test_old_homes_warn_and_give_the_same_objects(old, new, names):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.")):
        module = importlib.import_module(old)
    moved = importlib.import_module(new)
    for name in names:
        assert getattr(module, name) is getattr(moved, name)


def test_no_file_of_the_package_is_over_600_lines():
    folder = Path(attnkit.__file__).parent / "models" / "llama"
    lengths = {path.name: len(path.read_text().splitlines()) for path in folder.glob("*.py")}
    assert len(lengths) >= 6 and max(lengths.values()) <= 600, lengths
