"""A key/value cache in fixed-size blocks shared by many sequences, with prefix sharing.

`KVCache` reserves `max_length` positions per sequence up front; a server decoding many
requests of unknown length cannot afford that. `PagedKVCache` (vLLM's PagedAttention)
holds keys and values in blocks of `block_size` positions:

    keys, values: (num_layers, blocks, num_kv_heads, block_size, head_dim), layer-major

and each sequence owns a block table, the ids of its blocks in order: position p of a
sequence lives in block `table[p // block_size]` at offset `p % block_size`. Blocks are
taken as a sequence grows (`reserve`) and given back when it ends (`free`).

Prefix sharing (vLLM's automatic prefix caching): a full block is known by a digest of
(its parent block's digest, its tokens), so equal digests mean equal prefixes. A full block
stays cached after its sequences end; `match_prefix` attaches the cached blocks holding a
prompt's prefix to a new sequence instead of computing them again. Blocks are
reference-counted (several sequences may read one); a cached block no sequence uses is
evicted, least recently used first, only when a free block is needed. `fork` starts a
sequence that shares every block of another (n > 1 completions of one prompt); the partial
last block they share is copied before either writes to it (copy-on-write, in `reserve`).

Writing is the step's job (`attnkit.models.llama.batch.BatchStep`): it calls `reserve`,
writes each new token's key and value at its slot, then `append`s the tokens.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

__all__ = ["CacheFull", "PagedKVCache"]


class CacheFull(RuntimeError):
    """No free block is left for a `reserve` (a server answers 503/429)."""


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"expected {name} to be a positive int, got {value!r}")
    return int(value)


def _digest(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a full block: its parent's key and its tokens (int64 little-endian)."""
    return hashlib.blake2b(parent + np.asarray(tokens, "<i8").tobytes(), digest_size=16).digest()


class _Sequence:
    __slots__ = ("blocks", "tokens", "digests")

    def __init__(self) -> None:
        self.blocks: list[int] = []  # block ids in order
        self.tokens: list[int] = []  # the tokens whose K/V the blocks hold
        self.digests: list[bytes] = []  # the keys of its full blocks


class PagedKVCache:
    """Keys and values in fixed-size blocks shared by many sequences (vLLM's PagedAttention),
    with prefix sharing (full blocks keyed by the hash of (parent block's hash, their tokens);
    reference-counted; a block no sequence uses stays cached, LRU-evicted when memory is needed).

    Arguments:
        num_layers, num_kv_heads, head_dim: the model's sizes.
        blocks: how many blocks the cache holds (memory: 2 * num_layers * blocks *
            num_kv_heads * block_size * head_dim * itemsize bytes, taken lazily by the OS).
        block_size: positions a block holds.
        dtype: float32 (default) or float64.

    Attributes:
        keys, values: (num_layers, blocks, num_kv_heads, block_size, head_dim).
        block_size: positions a block holds.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, blocks: int, block_size: int = 16,
                 dtype=np.float32) -> None:
        sizes = [_positive(name, value) for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                                                             ("head_dim", head_dim), ("blocks", blocks),
                                                             ("block_size", block_size))]
        self.num_layers, self.num_kv_heads, self.head_dim, self.blocks, self.block_size = sizes
        dtype = np.dtype(dtype)
        if dtype not in (np.float32, np.float64):
            raise TypeError(f"expected dtype float32 or float64, got {dtype}")
        self.dtype = dtype
        shape = (self.num_layers, self.blocks, self.num_kv_heads, self.block_size, self.head_dim)
        self.keys = np.zeros(shape, dtype)
        self.values = np.zeros(shape, dtype)
        self._refs = np.zeros(self.blocks, np.int64)  # sequences using each block
        self._empty = list(range(self.blocks - 1, -1, -1))  # unused blocks holding nothing (pop from the end)
        self._cached: OrderedDict[int, None] = OrderedDict()  # unused blocks holding a prefix, oldest first
        self._by_digest: dict[bytes, int] = {}  # full block's key -> block id
        self._digest_of: dict[int, bytes] = {}  # block id -> its key (registered blocks)
        self._sequences: dict[int, _Sequence] = {}
        self._next_id = 0

    # -- bookkeeping ---------------------------------------------------------------------
    def _sequence(self, seq) -> _Sequence:
        if isinstance(seq, bool) or not isinstance(seq, (int, np.integer)) or int(seq) not in self._sequences:
            raise ValueError(f"expected the id of a live sequence of this cache (one of {sorted(self._sequences)}), "
                             f"got {seq!r}")
        return self._sequences[int(seq)]

    @property
    def free_blocks(self) -> int:
        """Blocks no live sequence uses: empty ones and cached prefixes (evicted when needed)."""
        return len(self._empty) + len(self._cached)

    @property
    def used_blocks(self) -> int:
        """Blocks used by at least one live sequence."""
        return self.blocks - self.free_blocks

    @property
    def cached_blocks(self) -> int:
        """Unused blocks that still hold a prefix `match_prefix` can attach."""
        return len(self._cached)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's keys and values over every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.block_size * self.head_dim * self.dtype.itemsize

    def bytes_used(self) -> int:
        """Bytes of the blocks held by live sequences."""
        return self.used_blocks * self.block_bytes

    @property
    def sequences(self) -> list[int]:
        """The live sequences' ids."""
        return list(self._sequences)

    def length(self, seq: int) -> int:
        """Tokens whose keys and values sequence `seq` holds."""
        return len(self._sequence(seq).tokens)

    def tokens(self, seq: int) -> list[int]:
        """The tokens whose keys and values sequence `seq` holds, in order."""
        return list(self._sequence(seq).tokens)

    def block_table(self, seq: int) -> np.ndarray:
        """(n,) int32 ids of sequence `seq`'s blocks, in order (room reserved included)."""
        return np.array(self._sequence(seq).blocks, np.int32)

    def capacity(self, seq: int) -> int:
        """Tokens sequence `seq` may hold without another `reserve` (its blocks' positions)."""
        return len(self._sequence(seq).blocks) * self.block_size

    def writable(self, seq: int) -> bool:
        """Whether the block the next token of `seq` goes in is its own (not shared with a fork)."""
        s = self._sequence(seq)
        index = len(s.tokens) // self.block_size
        return index >= len(s.blocks) or self._refs[s.blocks[index]] == 1

    # -- blocks ----------------------------------------------------------------------------
    def _take(self) -> int:
        """A block for new keys: an empty one, else the least recently used cached one."""
        if self._empty:
            block = self._empty.pop()
        else:
            block, _ = self._cached.popitem(last=False)
            del self._by_digest[self._digest_of.pop(block)]
        self._refs[block] = 1
        return block

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self._digest_of:
                self._cached[block] = None  # the most recently used end
            else:
                self._empty.append(block)

    # -- sequences -------------------------------------------------------------------------
    def add_sequence(self) -> int:
        """A new empty sequence's id."""
        seq = self._next_id
        self._next_id += 1
        self._sequences[seq] = _Sequence()
        return seq

    def match_prefix(self, seq: int, tokens: Sequence[int]) -> int:
        """Attach the cached full blocks holding a prefix of `tokens` to the empty sequence
        `seq`; returns how many tokens are now in its cache: a multiple of `block_size`, and
        always < len(tokens) (the last token is left to compute, so its logits exist)."""
        s = self._sequence(seq)
        if s.blocks or s.tokens:
            raise ValueError(f"expected an empty sequence, sequence {seq} holds {len(s.tokens)} tokens "
                             f"and {len(s.blocks)} blocks")
        tokens = [int(t) for t in tokens]
        size, parent = self.block_size, b""
        for index in range((len(tokens) - 1) // size if tokens else 0):
            chunk = tokens[index * size:(index + 1) * size]
            digest = _digest(parent, chunk)
            block = self._by_digest.get(digest)
            if block is None:
                break
            if self._refs[block] == 0:
                del self._cached[block]
            self._refs[block] += 1
            s.blocks.append(block)
            s.digests.append(digest)
            s.tokens.extend(chunk)
            parent = digest
        return len(s.tokens)

    def reserve(self, seq: int, count: int) -> None:
        """Room for `count` more tokens of `seq`: blocks taken as needed, and a partial last
        block shared with a fork copied first (copy-on-write).

        Raises:
            CacheFull: not enough free blocks (then nothing was taken).
        """
        s = self._sequence(seq)
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 0:
            raise ValueError(f"expected a count of tokens >= 0, got {count!r}")
        if count == 0:
            return
        length, size = len(s.tokens), self.block_size
        index = length // size
        copy = index < len(s.blocks) and length % size != 0 and self._refs[s.blocks[index]] > 1
        need = max(0, -(-(length + count) // size) - len(s.blocks)) + int(copy)
        if need > self.free_blocks:
            raise CacheFull(f"sequence {seq} needs {need} more blocks of {size} tokens for {count} tokens; "
                            f"{self.free_blocks} of {self.blocks} are free")
        if copy:
            shared = s.blocks[index]
            block = self._take()
            self.keys[:, block] = self.keys[:, shared]
            self.values[:, block] = self.values[:, shared]
            self._release(shared)
            s.blocks[index] = block
        while len(s.blocks) * size < length + count:
            s.blocks.append(self._take())

    def append(self, seq: int, tokens: Sequence[int]) -> None:
        """Count `tokens` as held by `seq`: their keys and values were written at its next
        slots (by the step). A block that fills is registered for prefix sharing."""
        s = self._sequence(seq)
        tokens = [int(t) for t in tokens]
        if len(s.tokens) + len(tokens) > len(s.blocks) * self.block_size:
            raise ValueError(f"sequence {seq} has room for {len(s.blocks) * self.block_size - len(s.tokens)} more "
                             f"tokens, got {len(tokens)}: call reserve first")
        size = self.block_size
        s.tokens.extend(tokens)
        for index in range(len(s.digests), len(s.tokens) // size):
            parent = s.digests[-1] if s.digests else b""
            digest = _digest(parent, s.tokens[index * size:(index + 1) * size])
            s.digests.append(digest)
            block = s.blocks[index]
            if digest not in self._by_digest and block not in self._digest_of:
                self._by_digest[digest] = block
                self._digest_of[block] = digest

    def free(self, seq: int) -> None:
        """Drop sequence `seq`; its full blocks stay cached for sharing until evicted."""
        s = self._sequence(seq)
        for block in reversed(s.blocks):  # the last blocks become the oldest cached: a prefix outlives its tail
            self._release(block)
        del self._sequences[int(seq)]

    def fork(self, seq: int) -> int:
        """A new sequence sharing every block of `seq` (a partial last block is copied when
        either writes to it: `reserve`)."""
        s = self._sequence(seq)
        child = self.add_sequence()
        c = self._sequences[child]
        held = -(-len(s.tokens) // self.block_size)  # blocks holding tokens (not the room reserved past them)
        c.blocks, c.tokens, c.digests = list(s.blocks[:held]), list(s.tokens), list(s.digests)
        for block in c.blocks:
            self._refs[block] += 1
        return child

    def __repr__(self) -> str:
        return (f"PagedKVCache(layers={self.num_layers}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"blocks={self.blocks}x{self.block_size}, used={self.used_blocks}, cached={self.cached_blocks}, "
                f"sequences={len(self._sequences)})")
