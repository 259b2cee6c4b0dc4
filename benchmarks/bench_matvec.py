"""Products ``x [M, K] @ W[N, K]^T`` on a 4096 x 4096 weight: GB/s of weight bytes, per stored type.

Per ``M`` (1 = one decode step; 4, 16, 64 = batched steps): numpy's ``x @ W.T`` on the f32 weight
(the reference, measured in the same run: this machine is shared and noisy, compare the ratios),
then the compiled products (``dist_runtime.backends.compiled.linear``) on the weight stored as
every type they read, with f32 activations and (block types) Q8_0 activations.  GB/s = the weight's
stored bytes / the median time; "vs numpy" = our GB/s / the reference's GB/s at the same ``M``.
The runs are interleaved, round after round of every product, so a burst of load from elsewhere
slows all alike, and each product reads its weight from memory, as in a decode step (run after run
of one product would find a 9 MB weight still in this CPU's 32 MB L3).  A decode step streams every
weight once, so GB/s at ``M`` = 1 bounds decoding speed.  The last table
gives each type's time at ``M`` = 8 over its time at ``M`` = 1 (each weight block is read once for
all rows, so this stays well under 8 until the arithmetic, not the memory, is the limit).

Run it as::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/bench_matvec.py

Trap (shared/notes/performance.md): OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE may be set on these
machines for old OpenBLAS builds and slow a current numpy's OpenBLAS down; unset them for this
command alone (as above), never in tests or CI.  The script prints which BLAS numpy uses, the
compiled path (AVX2 or portable) and the threads.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

import sys
from pathlib import Path

from dist_runtime.backends import compiled
from dist_runtime.dtypes import DType

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_compiled_linear import weight  # noqa: E402  (the tests' weights of every type, K-quants too)

def blas_info() -> str:
    """Which BLAS numpy calls, and its threads: threadpoolctl if installed, else numpy's config."""
    try:
        from threadpoolctl import threadpool_info

        return "; ".join(
            f"{i.get('internal_api')} {i.get('version')} ({i.get('architecture')}, "
            f"{i.get('num_threads')} threads)"
            for i in threadpool_info()
            if i.get("user_api") == "blas"
        )
    except ImportError:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        return f"{blas.get('name')} {blas.get('version')} ({blas.get('openblas configuration', '')})"


def medians(calls: dict, runs: int) -> dict:
    """Each call's median seconds, the calls' runs interleaved (round after round of all of them,
    as bench_decode.py does), so that a burst of load from elsewhere on this shared machine slows
    every product alike instead of the one measured at that moment."""
    for fn in calls.values():
        fn()  # warm up: compile or load the kernel, page in the weight, start the threads
    times: dict = {key: [] for key in calls}
    for _ in range(runs):
        for key, fn in calls.items():
            start = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - start)
    return {key: statistics.median(t) for key, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=4096, help="rows of the weight (N)")
    parser.add_argument("--k", type=int, default=4096, help="columns of the weight (K)")
    parser.add_argument("--ms", default="1,4,16,64", help="rows of x to measure (default: 1,4,16,64)")
    parser.add_argument("--runs", type=int, default=21)
    parser.add_argument("--threads", type=int, default=None, help="kernel threads (default: numba's, the cores)")
    args = parser.parse_args()
    if args.threads:
        compiled.set_threads(args.threads)

    import numba

    print(f"numpy {np.__version__}; BLAS: {blas_info()}")
    print(f"compiled products: {compiled.cpu.REASON}; {numba.get_num_threads()} thread(s), "
          f"layer {numba.threading_layer() if hasattr(numba, 'threading_layer') else '?'}")
    for var in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):
        if var in os.environ:
            print(f"warning: {var}={os.environ[var]} is set; it may slow OpenBLAS (see the docstring)")

    rng = np.random.default_rng(0)
    w = weight(DType.F32, args.n, args.k)
    types = [d for d in (DType.F32, DType.F16, DType.BF16, DType.Q8_0, DType.Q4_0, DType.Q4_1, DType.Q5_0,
                         DType.Q4_K, DType.Q5_K, DType.Q6_K) if d in compiled.KERNELS]
    weights = {d: weight(d, args.n, args.k) for d in types}  # K-quants: random codes, sane scales
    ms = [int(v) for v in args.ms.split(",")]
    print(f"\nW [{args.n}, {args.k}], median of {args.runs} runs; GB/s of weight bytes (vs numpy f32 at the same M)\n")
    head = f"| {'product':<26} | {'MB':>6} |" + "".join(f" {'M=' + str(m):>15} |" for m in ms)
    print(head)
    print("|" + "-" * 28 + "|" + "-" * 8 + "|" + "".join("-" * 17 + "|" for _ in ms))
    rows = [("numpy x @ W.T (f32)", w.nbytes, lambda x: x @ w.T)]
    for d in types:
        modes = ("f32", "q8_0") if d.is_quantized else ("f32",)
        for mode in modes:
            rows.append((f"compiled {d.name}" + (" q8 act." if mode == "q8_0" else ""), weights[d].nbytes,
                         lambda x, s=weights[d], a=mode: compiled.linear(x, s, activations=a)))
    measured = ms + ([8] if 1 in ms and 8 not in ms else [])
    xs = {m: rng.standard_normal((m, args.k), dtype=np.float32) for m in measured}
    times = medians({(name, m): (lambda fn=fn, x=xs[m]: fn(x)) for name, _, fn in rows for m in measured}, args.runs)
    for name, nbytes, _ in rows:
        cells = []
        for m in ms:
            gbs, reference = nbytes / times[(name, m)] / 1e9, rows[0][1] / times[(rows[0][0], m)] / 1e9
            cells.append(f"{gbs:6.2f} ({gbs / reference:4.2f}x)")
        print(f"| {name:<26} | {nbytes / 1e6:6.1f} |" + "".join(f" {c:>15} |" for c in cells))
    if 1 in ms:
        print("\ntime at M = 8 / time at M = 1 (each weight block read once for all rows)\n")
        for name, _, _ in rows:
            print(f"  {name:<26} {times[(name, 8)] / times[(name, 1)]:5.2f}x")


if __name__ == "__main__":
    main()
