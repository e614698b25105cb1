"""Context parallelism's cross-rank agreement check (issue 29): ring and Ulysses
attention refuse, on every rank together, a `scale` that differs between ranks and
batch dims that differ past the sixth (the check's all-gather row holds six; the
rest go in a second all-gather), and still run when every rank agrees.

One gloo world of 2 processes (`run_on_ranks`), as tests/torch/test_distributed.py.
"""

from __future__ import annotations

import math

import pytest

from conftest import optional

torch = optional("torch")
if torch is not None:
    from attnkit.torch import distributed as D

pytestmark = pytest.mark.usefixtures("torch")

E = 8


def _agreement(rank, world):
    """Worker: each case's error message on this rank (None: it ran)."""
    messages = {}

    def attempt(name, fn):
        try:
            out = fn()
            messages[name] = None if bool(torch.isfinite(out).all()) else "not finite"
        except ValueError as error:
            messages[name] = str(error)

    q = torch.randn(1, 2, 4, E, generator=torch.Generator().manual_seed(rank))
    attempt("ring scale", lambda: D.ring_attention(q, q, q, scale=0.5 + rank))
    attempt("ulysses scale", lambda: D.ulysses_attention(q, q, q, scale=0.5 if rank == 0 else None))
    # seven batch dims: the seventh differs on rank 1
    deep = torch.randn(1, 1, 1, 1, 1, 1, 1 + rank, 2, 4, E)
    attempt("ring seventh dim", lambda: D.ring_attention(deep, deep, deep))
    attempt("ulysses seventh dim", lambda: D.ulysses_attention(deep, deep, deep))
    same = torch.randn(1, 1, 1, 1, 1, 1, 2, 2, 4, E)
    attempt("seven dims agree", lambda: D.ring_attention(same, same, same, causal=True, scale=0.25))
    attempt("default scale stated", lambda: D.ring_attention(q, q, q, scale=None if rank else 1 / math.sqrt(E)))
    return messages


@pytest.mark.slow  # measured > 2 s in the quick loop
def test_ranks_that_disagree_on_scale_or_deep_batch_dims_all_raise():
    outcomes = D.run_on_ranks(_agreement, 2, timeout_s=60)
    for rank, outcome in enumerate(outcomes):
        assert outcome.error is None, f"rank {rank}: {outcome.error}"
        messages = outcome.value
        for name in ("ring scale", "ulysses scale"):
            assert "ranks disagree" in (messages[name] or ""), (rank, name, messages[name])
            assert "rank 0: " in messages[name] and "scale 0.5" in messages[name], messages[name]
        assert "scale 1.5" in messages["ring scale"]
        for name in ("ring seventh dim", "ulysses seventh dim"):
            assert "ranks disagree" in (messages[name] or ""), (rank, name, messages[name])
            assert "batch dims past the 6th (1,)" in messages[name] and "(2,)" in messages[name], messages[name]
        assert messages["seven dims agree"] is None, messages["seven dims agree"]
        assert messages["default scale stated"] is None, messages["default scale stated"]
