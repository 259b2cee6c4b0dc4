"""Memory of any interval ``[a, b)`` of positions, for whole arrays of intervals at once.

    memory(a, b) = weights(a, b) + kv(a, b) + activations(a, b)

Each term is monotone under interval inclusion, which is what makes the solver's greedy reach
exact.  Each is answered without scanning the interval:

* ``kv``: a prefix sum.
* ``activations``: the maximum of ``live[a:b]``, by a sparse table (O(1) per query).
* ``weights``: the bytes of the *distinct* weights used in the interval.  Summing every (node,
  weight) use over-counts a weight used by several nodes in the interval; the over-count is the
  sum, over consecutive uses ``p < j`` of the same weight with ``a <= p`` and ``j < b``, of the
  weight's bytes (a weight used ``r`` times inside the interval has exactly ``r - 1`` such pairs,
  because its uses inside an interval are consecutive in its list of uses).  That is a 2-D
  dominance sum, answered by a merge-sort tree in O(log K) searches for K repeat pairs (and for
  free when no weight is shared, the common case).
"""

from __future__ import annotations

import numpy as np

from .costs import CostModel


def prefix(values: np.ndarray) -> np.ndarray:
    out = np.zeros(len(values) + 1, dtype=np.int64)
    np.cumsum(values, out=out[1:])
    return out


def floor_log2(x: np.ndarray) -> np.ndarray:
    """``floor(log2(x))`` for positive integers, exactly (frexp gives the bit length)."""
    return np.frexp(np.asarray(x, dtype=np.float64))[1].astype(np.int64) - 1


class SparseTable:
    """Range maximum (or minimum) of a fixed array in O(1) per query, vectorised."""

    def __init__(self, values: np.ndarray, op=np.maximum, empty: int = 0) -> None:
        values = np.asarray(values, dtype=np.int64)
        n = len(values)
        levels = int(floor_log2(max(n, 1))) + 1
        self.table = np.full((levels, max(n, 1)), empty, dtype=np.int64)
        self.table[0, :n] = values
        for k in range(1, levels):
            half = 1 << (k - 1)
            width = n - (1 << k) + 1
            self.table[k, :width] = op(self.table[k - 1, :width], self.table[k - 1, half : half + width])
        self.op, self.empty = op, empty

    def query(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """``op`` over ``values[a:b]``, elementwise; ``empty`` where ``a >= b``."""
        a, b = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
        length = b - a
        nonempty = length > 0
        k = floor_log2(np.where(nonempty, length, 1))
        right = np.where(nonempty, b - (1 << k), a)
        out = self.op(self.table[k, np.where(nonempty, a, 0)], self.table[k, np.where(nonempty, right, 0)])
        return np.where(nonempty, out, self.empty)

    def query_one(self, a: int, b: int) -> int:
        """``query`` for one interval, without array overhead (the solver's probe is scalar)."""
        if b <= a:
            return self.empty
        k = (b - a).bit_length() - 1
        row = self.table[k]
        return int(self.op(row[a], row[b - (1 << k)]))


class DominanceSum:
    """Sum of ``size`` over pairs with ``p >= a`` and ``j < b``, for arrays of queries ``(a, b)``.

    Pairs are ordered by ``p`` descending, so "``p >= a``" is a prefix of that order; the prefix is
    cut into power-of-two blocks (one per set bit of its length), and each block keeps its pairs
    sorted by ``j`` with running sums.  Blocks of one level are stored side by side with keys
    ``block * (n + 1) + j``, so one ``searchsorted`` answers every query of that level.
    """

    def __init__(self, p: np.ndarray, j: np.ndarray, size: np.ndarray, n: int) -> None:
        order = np.argsort(-p, kind="stable")
        self.neg_p = -p[order]  # ascending
        j, size = j[order], size[order]
        self.count = len(p)
        self.stride = n + 1
        self.levels: list[tuple[np.ndarray, np.ndarray]] = []
        block_of = np.arange(self.count, dtype=np.int64)
        level = 0
        while (1 << level) <= self.count:
            keys = (block_of >> level) * self.stride + j
            o = np.argsort(keys, kind="stable")
            self.levels.append((keys[o], prefix(size[o])))
            level += 1

    def query_one(self, a: int, b: int) -> int:
        if not self.count:
            return 0
        length = int(self.neg_p.searchsorted(-a, side="right"))
        total = 0
        for level, (keys, sums) in enumerate(self.levels):
            if (length >> level) & 1:
                block = (length >> (level + 1)) << 1
                stop = int(keys.searchsorted(block * self.stride + b, side="left"))
                total += int(sums[stop] - sums[block << level])
        return total

    def query(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        a, b = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
        total = np.zeros(np.broadcast(a, b).shape, dtype=np.int64)
        if not self.count:
            return total
        length = np.searchsorted(self.neg_p, -a, side="right")  # pairs with p >= a
        for level, (keys, sums) in enumerate(self.levels):
            bit = (length >> level) & 1
            if not bit.any():
                continue
            block = (length >> (level + 1)) << 1  # the block of this level inside the prefix
            start = np.minimum(block << level, self.count)
            stop = np.searchsorted(keys, block * self.stride + b, side="left")
            total += np.where(bit == 1, sums[stop] - sums[start], 0)
        return total


class IntervalMemory:
    """``weights``, ``kv``, ``activations`` and ``total`` of intervals ``[a, b)`` (arrays)."""

    def __init__(self, costs: CostModel) -> None:
        n = costs.n
        self.n = n
        self.kv_prefix = prefix(costs.kv)
        use_bytes = costs.weight_bytes[costs.use_weight]
        # Bytes of all uses before each position (uses are sorted by position).
        self.use_prefix = prefix(use_bytes)[np.searchsorted(costs.use_pos, np.arange(n + 1), side="left")]
        by_weight = np.lexsort((costs.use_pos, costs.use_weight))
        w, pos = costs.use_weight[by_weight], costs.use_pos[by_weight]
        again = w[1:] == w[:-1]  # consecutive uses of one weight
        self.repeats = DominanceSum(pos[:-1][again], pos[1:][again], costs.weight_bytes[w[1:][again]], n)
        self.live = SparseTable(costs.live)

    def weights(self, a, b) -> np.ndarray:
        a, b = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
        return self.use_prefix[b] - self.use_prefix[a] - self.repeats.query(a, b)

    def kv(self, a, b) -> np.ndarray:
        a, b = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
        return self.kv_prefix[b] - self.kv_prefix[a]

    def activations(self, a, b) -> np.ndarray:
        return self.live.query(a, b)

    def total(self, a, b) -> np.ndarray:
        return self.weights(a, b) + self.kv(a, b) + self.activations(a, b)

    def total_one(self, a: int, b: int) -> int:
        """``total`` of one interval, with Python integers."""
        if b <= a:
            return 0
        weights = int(self.use_prefix[b] - self.use_prefix[a]) - self.repeats.query_one(a, b)
        return weights + int(self.kv_prefix[b] - self.kv_prefix[a]) + self.live.query_one(a, b)
