"""How the compiled attention (``backends/compiled/attention.py``) cuts its work, and the memory
that takes: one module the kernels and the partitioner's costs (``partitioner/flops.py``) share,
so that a plan counts what the kernel allocates.

A query row's keys beyond :data:`SPLIT_KEYS` are cut into a multiple of :data:`PIECES` of equal
pieces of at most SPLIT_KEYS, each attended alone (its own softmax) and merged by their exps'
sums, so that threads share one row's keys, each reading whole rows.  Fixed by the row's keys,
never by the threads: its bits depend on its keys alone.  Equal pieces, a multiple of 4, so that 2
or 4 threads get equal work: cut every 256 keys, a 1025-key row's five pieces (one of a single
key) keep one thread on three of them, 183-189 us a layer against 130.  No (rows x keys) score
matrix exists: a task's scores live while it runs, one task a thread.

A prompt's consecutive query rows with as many pieces attend together, up to :data:`GROUP_ROWS`
at a time, one task per piece index: each key and value row, widened once, serves every row of
the group (each row's bits as alone: its own softmax over its own keys, its sums in key order).
"""

from __future__ import annotations

SPLIT_KEYS, PIECES = 256, 4
#: Query rows that attend together (one task): 512 rows over 2048 F16 keys, 24 heads of 128, two
#: threads (Zen 3), 155-167 ms in groups of 4 against 220-248 one row at a time (the same kernels).
GROUP_ROWS = 4


def pieces_of_row(keys: int) -> int:
    """Pieces a query row seeing ``keys`` keys is cut into."""
    return 1 if keys <= SPLIT_KEYS else -(-keys // (SPLIT_KEYS * PIECES)) * PIECES


def workspace_bytes(rows: int, keys: int, heads: int, head_dim: int, threads: int = 1) -> int:
    """Bytes the compiled attention allocates for ``rows`` query rows, each seeing at most
    ``keys`` keys: each piece's weighted values and softmax statistics (f32) until the merge, and
    on each of ``threads`` threads one task's scores (a group's, over a piece's keys and the few
    its rows' pieces differ by), exps' bits and weighted values."""
    pieces = rows * pieces_of_row(keys)
    group = min(rows, GROUP_ROWS)
    span = min(keys, SPLIT_KEYS + group)
    return 4 * pieces * heads * (head_dim + 2) + threads * 4 * (span * (group * heads + 1) + group * heads * head_dim)
