"""Attention: the numba backend's compiled loop next to the CPU library's BLAS products, by size.

Prints, for causal grouped-query attention with the decode benchmark's heads (12 query heads, 4 kv
heads, head_dim 64), the median time of ``dist_runtime.backends.numba``'s kernel and of
``dist_runtime.kernels.attention.sdpa`` for several (query rows, keys), and their ratio.  numba's
loops won only small products (a decode step) and BLAS large ones (a prefill); the vector cores
(``backends/compiled/attention.py``) measured faster at every size here, so the numba backend runs
every size of these heads on them (``backends.numba.SMALL_ATTENTION`` and ``DECODE_KEYS`` bound
only numba's loops, for other head sizes).  Keys and values of 12 layers are cycled,
so they come from memory as in a real step rather than from cache.

Run as (see the OPENBLAS trap in shared/notes/performance.md: unset both for this command only)::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/bench_attention.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from dist_runtime.backends.compiled.attention import attention_rows
from dist_runtime.backends.numba import DECODE_KEYS, SMALL_ATTENTION, small_attention
from dist_runtime.kernels.attention import sdpa

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 12, 4, 64, 12
SIZES = [(1, 64), (1, 256), (1, 512), (1, 1024), (1, 2048), (1, 4096), (1, 8192), (1, 16384), (4, 64), (4, 1024), (16, 64), (16, 128), (16, 512),
         (32, 64), (64, 64), (64, 512), (256, 256), (128, 1024), (512, 512), (1024, 1024)]


def median_seconds(fn, layers, repeat: int) -> float:
    fn(*layers[0])  # compile / warm up
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        for k, v in layers:
            fn(k, v)
        times.append((time.perf_counter() - t) / len(layers))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=9, help="timed rounds per size (default 9)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"causal attention, {HEADS} heads / {KV_HEADS} kv heads x {HEAD_DIM}; median of {args.repeat}; "
          f"SMALL_ATTENTION = {SMALL_ATTENTION}, DECODE_KEYS = {DECODE_KEYS}")
    print(f"{'Tq':>5} {'Tk':>5} {'numba us':>10} {'cpu us':>10} {'cpu / numba':>12}  runs on")
    for tq, tk in SIZES:
        q = rng.standard_normal((tq, HEADS * HEAD_DIM), dtype=np.float32)
        layers = [tuple(rng.standard_normal((tk, KV_HEADS * HEAD_DIM), dtype=np.float32) for _ in "kv")
                  for _ in range(LAYERS)]
        out = np.empty_like(q)
        ours = median_seconds(
            lambda k, v: attention_rows(q, k, v, HEADS, KV_HEADS, HEAD_DIM, True, 0, out), layers, args.repeat)
        ref = median_seconds(
            lambda k, v: sdpa(q, k, v, num_heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, causal=True),
            layers, args.repeat)
        chosen = "numba" if small_attention(tq, tk, HEAD_DIM) else "cpu"
        print(f"{tq:5d} {tk:5d} {ours * 1e6:10.1f} {ref * 1e6:10.1f} {ref / ours:11.2f}x  {chosen}")


if __name__ == "__main__":
    main()
