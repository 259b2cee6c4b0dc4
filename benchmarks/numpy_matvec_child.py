"""bench_matvec.py's reference: numpy's f32 ``x @ W.T`` timed in a process of its own.

Started by bench_matvec.py, never by hand.  It imports numpy (and threadpoolctl, when installed, to
say which BLAS runs) and nothing of dist_runtime: no numba, no TBB, whose worker threads in the
benchmark's own process make OpenBLAS's threads slower (numpy's M = 1 falls to 9 GB/s in an
interleaved run).  The weight is built as the tests' ``weight(DType.F32, n, k)`` builds it (seeded
standard normal, f32), the rows of ``x`` likewise.

Protocol, one line each way: arguments ``n k m1,m2,... [flush_rows [one|many]]``; it answers ``ready <json>`` (numpy's
version, the BLAS, whether numba got loaded: it must not), then for each line ``<m>`` read from
stdin runs untimed products on ``flush_rows`` rows of other weights (``many``, the default: weights of
the measured one's shape, one product each; ``one``: one weight of all those rows), its threads awake and the
cache holding those weights, not this one, as the parent does before each of its products, then the
product, and answers its seconds (``time.perf_counter``
around that product alone) once OpenBLAS's threads have stopped spinning (:func:`settle`); an
empty line or EOF ends it.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np


def settle(limit: float = 1.0) -> None:
    """Wait until this process's threads are idle (its CPU time grows < 1 ms in 10 ms): worker
    threads spin a while after a parallel call, and those spinning would slow the next product
    (measured: OpenBLAS's, spinning ~0.1 s after each product, make the compiled F32 product after
    numpy's turn read 16 GB/s instead of 24 at M = 1).  bench_matvec.py uses it too."""
    end = time.perf_counter() + limit
    while time.perf_counter() < end:
        used = time.process_time()
        time.sleep(0.01)
        if time.process_time() - used < 0.001:
            return


def flush_buffer(nbytes: int, seed: int = 7) -> np.ndarray:
    """``nbytes`` random bytes in 0x30..0x4F: read as f16, bf16 or f32 (the byte of highest order
    sets the exponent) every value is a normal float, so no flush product meets NaN, inf or
    subnormal arithmetic; random so that no two pages are alike (a host merging equal pages would
    put the flush in cache).  bench_matvec.py's flush weights and ggml_matvec_child.py's weights
    are made of it: it lives here, where nothing but numpy is loaded, so that both can import it."""
    return np.random.default_rng(seed).integers(0x30, 0x50, nbytes, dtype=np.uint8)


def blas() -> str:
    try:
        from threadpoolctl import threadpool_info

        return "; ".join(f"{i.get('internal_api')} {i.get('version')} ({i.get('architecture')}, "
                         f"{i.get('num_threads')} threads)" for i in threadpool_info() if i.get("user_api") == "blas")
    except ImportError:
        info = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        return f"{info.get('name')} {info.get('version')}"


def main() -> None:
    if not 4 <= len(sys.argv) <= 6:
        sys.exit("usage: numpy_matvec_child.py n k m1,m2,... [flush_rows [one|many]] (bench_matvec.py starts it; "
                 "see its docstring)")
    n, k, ms = int(sys.argv[1]), int(sys.argv[2]), [int(v) for v in sys.argv[3].split(",")]
    flush_rows = int(sys.argv[4]) if len(sys.argv) > 4 else 2560
    as_one = len(sys.argv) > 5 and sys.argv[5] == "one"
    w = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32)
    rng = np.random.default_rng(1)
    xs = {m: rng.standard_normal((m, k), dtype=np.float32) for m in ms}
    # The parent's flush (bench_matvec --flush-mb, --flush-as-one): other weights of this one's shape
    # read one product each, as in a decode step, or one weight of all those rows.
    flushes = ([np.full((flush_rows, k), 0.5, np.float32)] if as_one else
               [rng.standard_normal((n, k), dtype=np.float32) for _ in range(-(-flush_rows // n))])
    for x in xs.values():
        x @ w.T  # warm up: page the weight in, start OpenBLAS's threads
    print("ready " + json.dumps({"numpy": np.__version__, "blas": blas(), "numba_loaded": "numba" in sys.modules}),
          flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        x = xs[int(line)]
        for flush in flushes:  # as the parent does before each product (one row, or its fewest): threads awake
            xs[min(xs)] @ flush.T
        start = time.perf_counter()
        x @ w.T
        seconds = time.perf_counter() - start
        settle()
        print(repr(seconds), flush=True)


if __name__ == "__main__":
    main()
