"""Attention: the numba backend's compiled loop next to the CPU library's BLAS products, by size.

Prints, for causal grouped-query attention with the decode benchmark's heads (12 query heads, 4 kv
heads, head_dim 64), the median time of ``dist_runtime.backends.numba``'s kernel and of
``dist_runtime.kernels.attention.sdpa`` for several (query rows, keys), and their ratio.  numba's
loops win only small products (a decode step) and BLAS large ones (a prefill); the vector cores
(``backends/compiled/attention.py``) are faster at every size here.  The numba backend runs every
attention compiled (batch-invariant), on the vector cores for these heads.  Keys and values of 12 layers are cycled
(24 MB at 1024 keys, which this VM's cache partly holds).  The last line is the issue's decode
target (#15), from memory: one query row over 1025 keys (a length no piece size divides,
as a real context's), K/V sets of 512 MB cycled, against the time the K/V bytes take at the bandwidth the
compiled F32 product reads weights at in the same run.

Run as (see the OPENBLAS trap in shared/notes/performance.md: unset both for this command only)::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/bench_attention.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from dist_runtime.backends.compiled.attention import attention_rows
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
    print(f"causal attention, {HEADS} heads / {KV_HEADS} kv heads x {HEAD_DIM}; median of {args.repeat}")
    print(f"{'Tq':>5} {'Tk':>5} {'numba us':>10} {'cpu us':>10} {'cpu / numba':>12}")
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
        print(f"{tq:5d} {tk:5d} {ours * 1e6:10.1f} {ref * 1e6:10.1f} {ref / ours:11.2f}x")
    from_memory(args.repeat)


def from_memory(repeat: int, keys: int = 1025, cycled: float = 512e6) -> None:
    """The issue's decode target (#15): one query row over ``keys`` keys within 2x the time its K/V
    bytes take at the memory's speed.  K/V sets of ``cycled`` bytes in all are cycled (more than
    this VM's caches, as a real step's, which streams every weight between two layers' attention),
    and the speed is the compiled F32 product's at M = 1 over 512 MB of weights in the same run
    (the bandwidth a decode step streams its weights at; numpy's equals it: docs/benchmarks.md)."""
    from dist_runtime.backends import compiled

    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, HEADS * HEAD_DIM), dtype=np.float32)
    kv_bytes = 2 * keys * KV_HEADS * HEAD_DIM * 4
    sets = [tuple(rng.standard_normal((keys, KV_HEADS * HEAD_DIM), dtype=np.float32) for _ in "kv")
            for _ in range(int(cycled // kv_bytes) + 1)]
    out = np.empty_like(q)
    attend = median_seconds(lambda k, v: attention_rows(q, k, v, HEADS, KV_HEADS, HEAD_DIM, True, 0, out),
                            sets, repeat)
    del sets
    x = rng.standard_normal((1, 4096), dtype=np.float32)
    weights = [(rng.standard_normal((4096, 4096), dtype=np.float32), None) for _ in range(8)]
    product = median_seconds(lambda w, _: compiled.linear(x, w), weights, repeat)
    bandwidth = weights[0][0].nbytes / product
    floor = kv_bytes / bandwidth
    print(f"\nfrom memory: 1 query row over {keys} keys ({kv_bytes / 1e6:.1f} MB of K/V), {attend * 1e6:.1f} us; "
          f"the bytes at {bandwidth / 1e9:.1f} GB/s (compiled F32 product, M = 1) take {floor * 1e6:.1f} us: "
          f"{attend / floor:.2f}x (target <= 2x)")


if __name__ == "__main__":
    main()
