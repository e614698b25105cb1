"""`attnkit.nn.paged.PagedKVCache`: blocks, prefix sharing, reference counts, LRU eviction,
fork with copy-on-write, a reserve that takes nothing when it fails, clear errors."""

from __future__ import annotations

import numpy as np
import pytest

from attnkit.nn.paged import CacheFull, PagedKVCache


def cache(blocks=8, size=4):
    return PagedKVCache(2, 1, 3, blocks=blocks, block_size=size)


def fill(c, seq, tokens):
    """Reserve and append `tokens`, writing each token's id into its slot's keys (to see copies)."""
    c.reserve(seq, len(tokens))
    table, start = c.block_table(seq), c.length(seq)
    for i, t in enumerate(tokens):
        p = start + i
        c.keys[:, table[p // c.block_size], :, p % c.block_size] = t
    c.append(seq, tokens)


def held_keys(c, seq):
    table = c.block_table(seq)
    return [int(c.keys[0, table[p // c.block_size], 0, p % c.block_size, 0]) for p in range(c.length(seq))]


def test_layout_and_growth():
    c = cache()
    assert c.keys.shape == c.values.shape == (2, 8, 1, 4, 3) and c.keys.dtype == np.float32
    s = c.add_sequence()
    assert c.length(s) == 0 and c.block_table(s).dtype == np.int32 and len(c.block_table(s)) == 0
    fill(c, s, [1, 2, 3, 4, 5])
    assert c.length(s) == 5 and c.tokens(s) == [1, 2, 3, 4, 5] and len(c.block_table(s)) == 2
    assert c.used_blocks == 2 and c.free_blocks == 6 and c.bytes_used() == 2 * c.block_bytes
    assert c.block_bytes == 2 * 2 * 1 * 4 * 3 * 4
    assert held_keys(c, s) == [1, 2, 3, 4, 5]


def test_prefix_sharing_and_lru_eviction():
    c = cache(blocks=4)
    a = c.add_sequence()
    fill(c, a, list(range(10)))  # blocks: [0..3] [4..7] [8, 9]
    b = c.add_sequence()
    assert c.match_prefix(b, list(range(10)) + [99]) == 8  # two full blocks shared
    assert list(c.block_table(b)) == list(c.block_table(a))[:2] and c.used_blocks == 3
    assert held_keys(c, b) == list(range(8))
    c2 = c.add_sequence()
    assert c.match_prefix(c2, list(range(8))) == 4  # the last token is always left to compute
    c.free(c2)
    c.free(a)
    assert c.used_blocks == 2 and c.cached_blocks == 0  # b still holds both full blocks; the partial one is empty
    c.free(b)
    assert c.used_blocks == 0 and c.cached_blocks == 2 and c.free_blocks == 4
    d = c.add_sequence()
    assert c.match_prefix(d, list(range(9))) == 8 and c.cached_blocks == 0
    c.free(d)
    # the cached blocks are evicted, least recently used first, only when blocks are needed
    e = c.add_sequence()
    fill(c, e, [50, 51, 52, 53, 54, 55, 56, 57])
    assert c.cached_blocks == 2  # the two empty blocks were taken first
    fill(c, e, [58])
    assert c.cached_blocks == 1  # the prefix's second block went first: its tail, the older end
    f = c.add_sequence()
    assert c.match_prefix(f, list(range(9))) == 4


def test_eviction_order_keeps_the_prefix_longest():
    c = cache(blocks=3)
    a = c.add_sequence()
    fill(c, a, list(range(12)))
    c.free(a)  # three cached blocks; the tail is evicted first
    b = c.add_sequence()
    fill(c, b, [70])
    assert c.cached_blocks == 2
    d = c.add_sequence()
    assert c.match_prefix(d, list(range(12))) == 8


def test_fork_copies_a_shared_partial_block_on_write():
    c = cache()
    a = c.add_sequence()
    fill(c, a, [1, 2, 3, 4, 5, 6])
    b = c.fork(a)
    assert c.tokens(b) == c.tokens(a) and list(c.block_table(b)) == list(c.block_table(a))
    assert c.used_blocks == 2 and not c.writable(a) and not c.writable(b)
    fill(c, b, [7])
    assert c.block_table(b)[1] != c.block_table(a)[1] and c.block_table(b)[0] == c.block_table(a)[0]
    fill(c, a, [8])
    assert held_keys(c, a) == [1, 2, 3, 4, 5, 6, 8] and held_keys(c, b) == [1, 2, 3, 4, 5, 6, 7]
    assert c.used_blocks == 3 and c.writable(a) and c.writable(b)


def test_fork_does_not_share_the_room_reserved_past_the_tokens():
    c = cache()
    a = c.add_sequence()
    fill(c, a, [1, 2, 3, 4])
    c.reserve(a, 4)
    b = c.fork(a)
    assert len(c.block_table(b)) == 1 and len(c.block_table(a)) == 2


def test_reserve_takes_nothing_when_it_raises():
    c = cache(blocks=3)
    a = c.add_sequence()
    fill(c, a, [1, 2, 3, 4, 5])
    before = (c.free_blocks, list(c.block_table(a)))
    with pytest.raises(CacheFull, match="needs 3 more blocks"):
        c.reserve(a, 12)
    assert (c.free_blocks, list(c.block_table(a))) == before
    b, d = c.fork(a), c.fork(a)
    c.reserve(b, 3)  # a copy of the shared partial block: the last free block
    with pytest.raises(CacheFull, match="needs 1 more"):
        c.reserve(a, 1)  # a and d still share theirs: its copy-on-write needs a block too
    assert c.free_blocks == 0 and c.length(d) == 5 and isinstance(CacheFull("x"), RuntimeError)


def test_bad_ids_and_arguments():
    c = cache()
    with pytest.raises(ValueError, match="live sequence"):
        c.length(0)
    s = c.add_sequence()
    for bad in (-1, 7, True, "0"):
        with pytest.raises(ValueError, match="live sequence"):
            c.block_table(bad)
    with pytest.raises(ValueError, match="count"):
        c.reserve(s, -1)
    with pytest.raises(ValueError, match="reserve first"):
        c.append(s, [1])
    fill(c, s, [1])
    with pytest.raises(ValueError, match="empty sequence"):
        c.match_prefix(s, [1, 2, 3])
    c.free(s)
    with pytest.raises(ValueError, match="live sequence"):
        c.free(s)
    with pytest.raises(ValueError, match="blocks"):
        PagedKVCache(1, 1, 1, blocks=0)
    with pytest.raises(TypeError, match="dtype"):
        PagedKVCache(1, 1, 1, blocks=1, dtype=np.int32)
