"""Products ``x [M, K] @ W[N, K]^T`` on a 4096 x 4096 weight: GB/s of weight bytes, per stored type.

Per ``M`` (1 = one decode step; 4, 16, 64 = batched steps): numpy's ``x @ W.T`` on the f32 weight
(the reference, measured in the same run: this machine is shared and noisy, compare the ratios),
then the compiled products (``dist_runtime.backends.compiled.linear``) on the weight stored as
every type they read, with f32 activations and (block types) Q8_0 activations.  GB/s = the weight's
stored bytes / the median time; "vs numpy" = our GB/s / the reference's GB/s at the same ``M``.  A
decode step streams every weight once, so GB/s at ``M`` = 1 bounds decoding speed.  The last table
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


def median_seconds(fn, runs: int) -> float:
    fn()  # warm up: compile or load the kernel, page in the weight, start the threads
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
    times: dict[tuple[str, int], float] = {}
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
    reference = {}
    for name, nbytes, fn in rows:
        cells = []
        for m in ms:
            x = rng.standard_normal((m, args.k), dtype=np.float32)
            seconds = median_seconds(lambda: fn(x), args.runs)
            times[(name, m)] = seconds
            gbs = nbytes / seconds / 1e9
            reference.setdefault(m, gbs)
            cells.append(f"{gbs:6.2f} ({gbs / reference[m]:4.2f}x)")
        print(f"| {name:<26} | {nbytes / 1e6:6.1f} |" + "".join(f" {c:>15} |" for c in cells))
    if 1 in ms:
        print("\ntime at M = 8 / time at M = 1 (each weight block read once for all rows)\n")
        for name, _, fn in rows:
            x8 = rng.standard_normal((8, args.k), dtype=np.float32)
            print(f"  {name:<26} {median_seconds(lambda: fn(x8), args.runs) / times[(name, 1)]:5.2f}x")


if __name__ == "__main__":
    main()
