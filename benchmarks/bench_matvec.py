"""Matrix-vector products on a 4096 x 4096 weight: GB/s of weight read, per weight format.

Rows: plain numpy ``x @ W.T`` on the f32 weight (the reference, measured in the same run, since
this machine is shared and noisy: compare the ratios), then ``dist_runtime.kernels.quant.quant_matmul`` on the
weight stored as F32, F16, BF16, Q8_0 and Q4_0.  GB/s = the weight's stored bytes / the median time
of ``--runs`` products; "vs numpy" = our GB/s / the reference's GB/s; "time x" = our time / the
reference's time.  A decode step is a chain of such products, so this bounds decoding speed.

Run it as::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/bench_matvec.py

Trap (/work/shared/notes/performance.md): OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE may be set on
these machines for old OpenBLAS builds and slow a current numpy's OpenBLAS down; unset them for this
command alone (as above), never in tests or CI.  The script prints which BLAS numpy uses and warns
when either variable is set.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from dist_runtime.dtypes import DType
from dist_runtime.kernels.quant import quant_matmul, quantize


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


def median_seconds(fn, runs: int) -> float:
    fn()  # warm up: page in the weight, let BLAS start its threads
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=4096, help="rows of the weight (N)")
    parser.add_argument("--k", type=int, default=4096, help="columns of the weight (K)")
    parser.add_argument("--m", type=int, default=1, help="rows of x (1 = matrix-vector)")
    parser.add_argument("--runs", type=int, default=21)
    args = parser.parse_args()

    print(f"numpy {np.__version__}; BLAS: {blas_info()}")
    for var in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):
        if var in os.environ:
            print(f"warning: {var}={os.environ[var]} is set; it may slow OpenBLAS (see the docstring)")

    rng = np.random.default_rng(0)
    w = rng.standard_normal((args.n, args.k), dtype=np.float32)
    x = rng.standard_normal((args.m, args.k), dtype=np.float32)
    cases = {"numpy x @ W.T (f32)": (lambda: x @ w.T, w.nbytes)}
    for dtype in (DType.F32, DType.F16, DType.BF16, DType.Q8_0, DType.Q4_0):
        stored = w if dtype is DType.F32 else quantize(w, dtype)
        cases[f"quant_matmul {dtype.name}"] = (lambda s=stored: quant_matmul(x, s), stored.nbytes)

    print(f"\nx [{args.m}, {args.k}] @ W[{args.n}, {args.k}]^T, median of {args.runs} runs\n")
    print(f"| {'product':<24} | {'weight MB':>9} | {'ms':>8} | {'GB/s':>6} | {'vs numpy':>8} | {'time x':>6} |")
    print(f"|{'-' * 26}|{'-' * 11}|{'-' * 10}|{'-' * 8}|{'-' * 10}|{'-' * 8}|")
    reference = None
    for name, (fn, nbytes) in cases.items():
        seconds = median_seconds(fn, args.runs)
        reference = reference or (nbytes / seconds, seconds)
        gbs = nbytes / seconds
        print(f"| {name:<24} | {nbytes / 1e6:>9.1f} | {seconds * 1e3:>8.2f} | {gbs / 1e9:>6.2f} | "
              f"{gbs / reference[0]:>8.2f} | {seconds / reference[1]:>6.1f} |")


if __name__ == "__main__":
    main()
