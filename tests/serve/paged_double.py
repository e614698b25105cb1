"""A stand-in for `PagedKVCache` and `BatchStep` that keeps only the bookkeeping (blocks
counted, prefixes remembered) and computes each sequence's logits with the model's plain
forward over all its tokens: the logits of a sequence depend on its tokens only, so the
scheduler's tests (admission, preemption, cancellation, prefix hits) check its decisions
without depending on the batched kernel's bits. The real cache and step are tested in
tests/serve/test_engine.py too."""

from __future__ import annotations

import math
import sys
import types
from dataclasses import dataclass

import numpy as np


def _paged():
    try:
        from attnkit.nn.paged import CacheFull
    except ImportError:  # the real module is not there: the scheduler reads this one's names
        class CacheFull(RuntimeError):
            pass

        sys.modules["attnkit.nn.paged"] = types.SimpleNamespace(CacheFull=CacheFull)
    try:
        from attnkit.models.llama.batch import StepRow
    except ImportError:
        @dataclass(frozen=True)
        class StepRow:
            sequence: int
            token: int
            logits: bool

        sys.modules["attnkit.models.llama.batch"] = types.SimpleNamespace(StepRow=StepRow)
    return CacheFull, StepRow


class DoubleCache:
    def __init__(self, blocks: int, block_size: int = 4) -> None:
        self.CacheFull, _ = _paged()
        self.block_size, self.blocks = block_size, blocks
        self.seqs: dict[int, dict] = {}
        self.cached: set[tuple[int, ...]] = set()
        self.next = 0
        self.freed: list[int] = []

    def add_sequence(self) -> int:
        self.next += 1
        self.seqs[self.next] = {"tokens": [], "blocks": 0}
        return self.next

    def match_prefix(self, seq, tokens):
        found = 0
        for end in range(self.block_size, len(tokens), self.block_size):
            if tuple(tokens[:end]) in self.cached:
                found = end
        self.seqs[seq] = {"tokens": list(tokens[:found]), "blocks": found // self.block_size}
        return found

    def length(self, seq):
        return len(self.seqs[seq]["tokens"])

    def tokens(self, seq):
        return list(self.seqs[seq]["tokens"])

    def reserve(self, seq, count):
        entry = self.seqs[seq]
        need = math.ceil((len(entry["tokens"]) + count) / self.block_size) - entry["blocks"]
        if need > self.free_blocks:
            raise self.CacheFull(f"{need} blocks asked, {self.free_blocks} free")
        entry["blocks"] += max(need, 0)

    def free(self, seq):
        tokens = self.seqs.pop(seq)["tokens"]
        for end in range(self.block_size, len(tokens) + 1, self.block_size):
            self.cached.add(tuple(tokens[:end]))
        self.freed.append(seq)

    def fork(self, seq):
        new = self.add_sequence()
        self.seqs[new] = {"tokens": list(self.seqs[seq]["tokens"]), "blocks": self.seqs[seq]["blocks"]}
        return new

    @property
    def used_blocks(self):
        return sum(s["blocks"] for s in self.seqs.values())

    @property
    def free_blocks(self):
        return self.blocks - self.used_blocks

    @property
    def cached_blocks(self):
        return len(self.cached)

    def bytes_used(self):
        return self.used_blocks


class DoubleStep:
    compiled, reason = False, "a test double"

    def __init__(self, model, cache: DoubleCache) -> None:
        self.model, self.cache = model, cache
        self.batches: list[list] = []

    def run(self, rows):
        self.batches.append(list(rows))
        out = []
        for row in rows:
            entry = self.cache.seqs[row.sequence]
            assert math.ceil((len(entry["tokens"]) + 1) / self.cache.block_size) <= entry["blocks"], "not reserved"
            entry["tokens"].append(row.token)
            if row.logits:
                out.append(self.model.forward(np.asarray(entry["tokens"]))[-1])
        vocab = self.model.config.vocab_size
        return np.asarray(out, dtype=np.float32).reshape(len(out), vocab)
