"""What a compiled step may read of a model and a cache, through public names:
`Module.child_modules` / `own_parameters` (live, read-only views) and `KVCache.stores` /
`advance`."""

from __future__ import annotations

import numpy as np
import pytest

from attnkit.nn import KVCache, Linear
from attnkit.nn.module import Module


class Pair(Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = Linear(4, 3, seed=0)
        self.second = Linear(3, 2, bias=False, seed=1)


def test_views_are_live_and_read_only():
    pair = Pair()
    children, params = pair.child_modules, pair.first.own_parameters
    assert list(children) == ["first", "second"] and children["first"] is pair.first
    assert params["weight"] is pair.first.weight and pair.second.own_parameters["bias"] is None
    replacement = Linear(4, 3, seed=2)
    pair.first = replacement
    pair.second.weight = np.zeros((2, 3))
    assert children["first"] is replacement  # a view, not a copy
    assert pair.second.own_parameters["weight"] is pair.second.weight
    with pytest.raises(TypeError):
        children["first"] = Linear(4, 3)
    with pytest.raises(TypeError):
        params["weight"] = np.zeros((3, 4))


def test_stores_are_every_layers_buffer():
    cache = KVCache(3, 1, 2, 4, 8)
    keys, values = cache.stores
    assert keys.shape == values.shape == (3, 1, 2, 8, 4)
    keys[1, 0, :, 0] = 5.0  # written where the compiled step writes
    values[1, 0, :, 0] = 7.0
    cache.advance(1)
    assert cache.length == 1
    k, v = cache.update(1, np.ones((1, 2, 1, 4), np.float32), np.ones((1, 2, 1, 4), np.float32))
    assert k.shape[2] == 2 and (k[0, :, 0, 0] == 5.0).all() and (v[0, :, 0, 0] == 7.0).all()
    cache.keys[0] = cache.keys[0].copy()  # a layer's buffer replaced: no store behind every layer
    assert cache.stores is None


def test_advance_refuses_what_does_not_fit():
    cache = KVCache(2, 1, 1, 4, 3)
    cache.advance(3)
    with pytest.raises(ValueError, match="at most 3 positions"):
        cache.advance(1)
    for count in (-1, 1.5, True):
        with pytest.raises(ValueError, match="count of positions"):
            cache.advance(count)
