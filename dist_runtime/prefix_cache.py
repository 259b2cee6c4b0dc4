"""Automatic prefix caching: a request whose prompt begins with tokens already computed starts from
their KV rows instead of computing them again.

As vLLM's automatic prefix caching, a prompt is cut into blocks of :data:`BLOCK` tokens and each
block is keyed by a hash chained over it and every block before it, so a key names a whole prefix.
A session that ends leaves its KV caches here (its buffers, not a copy), indexed by the keys of
the whole blocks of tokens it fed; a new request takes the longest cached prefix of its prompt
(at most all but its last token, whose logits it needs) as copied rows, and feeds the rest.  The
rows are the bits the prompt's prefill would write: every kernel of the numba backend gives a row
the same bits whatever rows share its pass or chunk (tests/test_prefix_cache.py checks the tokens).
Entries are evicted least recently used once their bytes pass the budget.

The cache belongs to one executor (its KV element type and numerics made the rows), or to one
pipeline, whose stages keep the entries' states (the pipeline's coordinator holds the index, a
handle per entry, and tells the stages to keep, copy and drop them).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

#: Tokens per block: a prefix is reused in whole blocks (vLLM's default block size).
BLOCK = 16


def block_keys(tokens: Sequence[int]) -> list[bytes]:
    """One key per whole block of ``tokens``: a hash of the block chained with the previous key."""
    keys, prev = [], b""
    ids = np.asarray(tokens, np.int64)
    for i in range(len(ids) // BLOCK):
        prev = hashlib.blake2b(prev + ids[i * BLOCK:(i + 1) * BLOCK].tobytes(), digest_size=16).digest()
        keys.append(prev)
    return keys


@dataclass(eq=False)
class Entry:
    """A finished session's KV states (``handle``: the states by node, or where a pipeline's
    stages keep them), the rows of whole blocks they hold and their bytes."""

    handle: Any
    rows: int
    nbytes: int
    keys: list[bytes] = field(default_factory=list)


class PrefixCache:
    """Cached prefixes within ``budget`` bytes of KV buffers (0: cache nothing); ``evict(handle)``
    is called for each entry dropped (a pipeline's stages free its states)."""

    def __init__(self, budget: int, evict: Callable[[Any], None] | None = None) -> None:
        self.budget, self.evict = budget, evict
        self._index: dict[bytes, tuple[Entry, int]] = {}  # block key -> (entry, rows up to its end)
        self._lru: OrderedDict[int, Entry] = OrderedDict()
        self.used = 0
        self.hits = self.lookups = 0

    def add(self, tokens: Sequence[int], handle: Any, nbytes: int) -> bool:
        """Keep ``handle``, whose states hold the KV rows of ``tokens`` (one row per token, in
        order) in ``nbytes``; False when it takes nothing (no whole block, or over the budget)."""
        keys = block_keys(tokens)
        if not keys or nbytes > self.budget:
            return False
        entry = Entry(handle, len(keys) * BLOCK, nbytes, keys)
        for i, key in enumerate(keys):
            self._index[key] = (entry, (i + 1) * BLOCK)
        self._lru[id(entry)] = entry
        self.used += nbytes
        while self.used > self.budget:
            self._evict(next(iter(self._lru.values())))
        return True

    def lookup(self, prompt: Sequence[int]) -> tuple[Entry | None, int]:
        """The entry holding the longest cached prefix of ``prompt`` (at most all but its last
        token), and its rows; (None, 0) when none is cached."""
        self.lookups += 1
        found, rows = None, 0
        for key in block_keys(prompt[:len(prompt) - 1]):
            hit = self._index.get(key)
            if hit is None:
                break
            found, rows = hit
        if found is not None:
            self.hits += 1
            self._lru.move_to_end(id(found))
        return found, rows

    def clear(self) -> None:
        for entry in list(self._lru.values()):
            self._evict(entry)

    def _evict(self, entry: Entry) -> None:
        del self._lru[id(entry)]
        self.used -= entry.nbytes
        for key in entry.keys:  # a key a newer entry took over stays with it
            if self._index.get(key, (None,))[0] is entry:
                del self._index[key]
        if self.evict is not None:
            self.evict(entry.handle)
