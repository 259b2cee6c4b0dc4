"""Products ``x [M, K] @ W[N, K]^T`` on a 4096 x 4096 weight: GB/s of weight bytes, per stored type.

Per ``M`` (1 = one decode step; 4, 16, 64 = batched steps): numpy's ``x @ W.T`` on the f32 weight
(the reference, measured in the same run: this machine is shared and noisy, compare the ratios) in a
child process of its own (``numpy_matvec_child.py``), which never loads numba: numba's TBB worker
threads in the same process as OpenBLAS's slow numpy down (its M = 1 falls to 9 GB/s in an
interleaved run; ``--numpy-here`` shows it), so the reference would not be numpy's real speed.
Then the compiled products (``dist_runtime.backends.compiled.linear``) on the weight stored as every type they read, with f32
activations and (block types) Q8_0 activations.  Where llama-cpp-python is installed, llama.cpp's
own products on Q8_0, Q4_0 and Q4_K weights too, the best-known CPU kernels for them (ggml's CPU
backend, with the weights repacked as llama.cpp loads them and the activations quantized as it
does: compare them with the "q8 act." rows; ``ggml_matvec_child.py``), in a child process of
their own with the same threads and the same flush, and a table of our q8 rows over them.
GB/s = the weight's stored bytes / the median time;
"vs numpy" = our GB/s / the reference's GB/s at the same ``M``. The runs are interleaved, round
after round of every product (the reference's turn is a request to the child, which times its
product alone and answers once OpenBLAS's threads stop spinning, while this process waits), so a
burst of load from elsewhere slows all alike, and each measured product follows untimed ones over
``--flush-mb`` of other weights of its shape (1 GiB by default, more than the 480 MiB of L3 this VM
reports), so that its weight comes from memory, as in a decode step of a model larger than the cache
(run after run of one product would find its weight in cache). The untimed products are of the
measured one's own kind, as in a decode step of a model stored in that type: numpy's f32 products in
its child (16 weights of 64 MB), and the measured compiled product itself (same stored type, same
activations) on other weights, which are views into one buffer of random bytes whose every 16- and
32-bit reading is a normal float (:func:`flush_weights`).

The untimed products are of the measured one's own kind because a product's own code and small data
(the Python wrapper, the driver, quantizing ``x``) come back from memory after a gigabyte of other
weights streamed through the caches, where a flush of its own kind keeps them warm: after 1 GiB of
compiled F32 products (``--flush-kind f32``) a product of another type pays a fixed ~70-100 us on
its first call, which no decode step pays (a Q4_K product with Q8_K activations, 1024 x 4096, one
thread, after 400 MB of products of each kind, medians of 8 rounds, first call / second call: after
F32 245 / 143 us, after itself 174 / 160).  And they are products over weights of the measured
shape, not one product over one weight of ``--flush-mb`` (``--flush-as-one``): after that every
compiled product reads slower than after the same bytes as weight-sized products (the Q4_0 product
with Q8_0 activations 10.3-13.8 GB/s against 16.6-18.0) while numpy's reference hardly moves, so the
ratios would measure something a decode step, a chain of weight-sized products, never does (F32
0.90 against 1.00x, Q4_0 0.47 against 0.74x); why one long product leaves the next slower here is
not known.

A decode step streams every weight once, so GB/s at ``M`` = 1 bounds decoding speed. The last table
gives each type's time at ``M`` = 8 over its time at ``M`` = 1 (each weight block is read once for all
rows, so this stays well under 8 until the arithmetic, not the memory, is the limit).

Run it as::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/bench_matvec.py

Trap (shared/notes/performance.md): OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE may be set on these
machines for old OpenBLAS builds and slow a current numpy's OpenBLAS down; unset them for this
command alone (as above), never in tests or CI.  The script prints which BLAS the child's numpy
uses, the compiled path (AVX2 or portable) and the threads.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from dist_runtime.backends import compiled, set_threads
from dist_runtime.dtypes import DType
from dist_runtime.tensor import QuantizedArray

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_compiled_linear import weight  # noqa: E402  (the tests' weights of every type, K-quants too)

from numpy_matvec_child import flush_buffer, settle  # noqa: E402  (the child's own: it loads numpy alone)

class Child:
    """A reference timed in a process of its own that never loads numba (``script``:
    numpy_matvec_child.py, ggml_matvec_child.py): ``child(request)`` sends one request line (the
    child runs its untimed products, then the measured one) and returns the seconds it measured.

    As in a decode step, every measured product follows others on other weights in its own
    process, untimed (:func:`main`'s ``before``, the children's flushes), so that the process's
    threads are awake: this process sleeps during the reference's turn (:func:`settle`), and
    without an untimed product first the compiled F32 product at M = 1, always first after
    numpy's turn, reads 15.4-25.1 GB/s where its M = 8 reads 36-50 (23.8-28.4 with it).  Those
    untimed products read ``--flush-mb`` of other weights, the same in every process: by default
    more than the 480 MiB of L3 this machine reports, so that every measured weight comes from
    memory as in a decode step of a large model.  With a flush that fits in the cache
    (``--flush-mb 42``) the reference cycles 109 MB while the compiled products share the cache
    with every other weight of the round: numpy's F32 M = 1 reads 56 GB/s over one 67 MB weight in
    a loop, 46 over two, 31 over eight (536 MB), where the compiled F32 product reads 45 over two
    and 31.5 over eight -- the reference would have the cache, not a faster kernel.
    """

    def __init__(self, script: str, args: list):
        path = Path(__file__).resolve().with_name(script)
        self.proc = subprocess.Popen([sys.executable, str(path), *map(str, args)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line.startswith("ready "):
            self.proc.kill()
            raise RuntimeError(f"the reference process {script} did not start ({line!r})")
        self.info = json.loads(line[len("ready "):])
        if self.info["numba_loaded"]:
            self.close()
            raise RuntimeError(f"the reference process {script} loaded numba: its numbers would not be its own")

    def __call__(self, request) -> float:
        settle()  # numba's workers idle before the child runs, as the child waits for its own after
        self.proc.stdin.write(f"{request}\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


#: The stored types llama.cpp's own products run in bench_matvec (ggml_matvec_child.py), by ggml's
#: names: the types of Q8_0 / Q4_0 / Q4_K_M files, the targets' types.
GGML_TYPES = {DType.Q8_0: "q8_0", DType.Q4_0: "q4_0", DType.Q4_K: "q4_K"}


def llama_cpp_reference(args, ms: list, flush_bytes: int):
    """llama.cpp's products in their child process, or None (and why) where llama-cpp-python is
    not installed or ``--no-llama-cpp`` is given."""
    if args.no_llama_cpp:
        return None, "--no-llama-cpp"
    if args.flush_kind != "same" or args.flush_as_one:
        return None, "its flush is of its own kind: with the default --flush-kind same only"
    try:
        import llama_cpp  # noqa: F401  (only whether it is there: the child loads its libraries)
    except ImportError:
        return None, "llama-cpp-python not installed (see bench_decode.py's docstring)"
    import numba

    child = Child("ggml_matvec_child.py", [args.n, args.k, ",".join(map(str, ms)), flush_bytes,
                                          args.threads or numba.get_num_threads(), ",".join(GGML_TYPES.values())])
    bad = {kind: err for kind, err in child.info["errors"].items() if not err < 0.05}
    if bad:
        child.close()
        raise RuntimeError(f"llama.cpp's products disagree with gguf's dequantization (relative error {bad})")
    return child, None


def flush_weights(dtype: DType, n: int, k: int, buffer: np.ndarray) -> list:
    """Weights ``[n, k]`` of ``dtype``, as many as ``buffer`` holds (at least one), each a view of
    its own slice of it: the untimed products' weights, none of them the measured one."""
    row = k // dtype.block_size * dtype.block_bytes if dtype.is_quantized else k * dtype.numpy.itemsize
    size = n * row
    slices = [buffer[i * size:(i + 1) * size].reshape(n, row) for i in range(buffer.nbytes // size)]
    if dtype.is_quantized:
        return [QuantizedArray(b, dtype, (n, k)) for b in slices]
    return [b.view(dtype.numpy) for b in slices]


def medians(calls: dict, runs: int, before=None) -> dict:
    """Each call's median seconds, the calls' runs interleaved (round after round of all of them,
    as bench_decode.py does), so that a burst of load from elsewhere on this shared machine slows
    every product alike instead of the one measured at that moment.  ``before(key)``, if given, runs
    untimed before each call.  A call that returns a number (the child's reference) has measured
    its own seconds."""
    for fn in calls.values():
        fn()  # warm up: compile or load the kernel, page in the weight, start the threads
    times: dict = {key: [] for key in calls}
    for _ in range(runs):
        for key, fn in calls.items():
            if before:
                before(key)
            start = time.perf_counter()
            own = fn()
            times[key].append(own if isinstance(own, float) else time.perf_counter() - start)
    return {key: statistics.median(t) for key, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=4096, help="rows of the weight (N)")
    parser.add_argument("--k", type=int, default=4096, help="columns of the weight (K)")
    parser.add_argument("--ms", default="1,4,16,64", help="rows of x to measure (default: 1,4,16,64)")
    parser.add_argument("--runs", type=int, default=21)
    parser.add_argument("--threads", type=int, default=None, help="kernel threads (default: numba's, the cores)")
    parser.add_argument("--flush-mb", type=int, default=1024,
                        help="MB of another weight read (untimed) before each measured product, in both "
                             "processes (default 1024: more than this VM's reported L3, so every weight "
                             "comes from memory)")
    parser.add_argument("--flush-kind", choices=("same", "f32"), default="same",
                        help="the untimed products before each measured one: 'same' (default) the measured "
                             "product itself on other weights, as in a decode step of a model of that type; "
                             "'f32' the compiled F32 product, which costs the other types' products a fixed "
                             "~70-100 us each (see the docstring)")
    parser.add_argument("--flush-as-one", action="store_true",
                        help="read the flush as one F32 product over one weight of --flush-mb instead of "
                             "products over weights of the measured shape, as a decode step does (see the "
                             "docstring)")
    parser.add_argument("--no-llama-cpp", action="store_true",
                        help="leave out llama.cpp's own products (its rows need llama-cpp-python installed)")
    parser.add_argument("--numpy-here", action="store_true",
                        help="also time numpy in this process, beside numba's threads (which slow it: see the "
                             "docstring)")
    args = parser.parse_args()
    for name in ("n", "k", "runs", "flush_mb"):
        if getattr(args, name) < (0 if name == "flush_mb" else 1):
            parser.error(f"--{name.replace('_', '-')} must be {'>= 0' if name == 'flush_mb' else 'positive'}, "
                         f"got {getattr(args, name)}")
    compiled.init()  # the threading layer, before any compiled product runs
    if args.threads:
        set_threads(args.threads)

    import numba

    try:
        ms = [int(v) for v in args.ms.split(",")]
    except ValueError:
        parser.error(f"--ms must be comma-separated row counts, got {args.ms!r}")
    if min(ms) < 1:
        parser.error(f"--ms must be positive row counts, got {args.ms!r}")
    measured = ms + ([8] if 1 in ms and 8 not in ms else [])
    flush_rows = max(1, args.flush_mb * 2**20 // (4 * args.k))
    numpy_ref = Child("numpy_matvec_child.py", [args.n, args.k, ",".join(map(str, measured)), flush_rows,
                                                "one" if args.flush_as_one else "many"])
    print(f"reference: numpy {numpy_ref.info['numpy']} in a child process without numba; BLAS: {numpy_ref.info['blas']}")
    try:
        ggml_ref, why_not = llama_cpp_reference(args, measured, args.flush_mb * 2**20)
    except BaseException:
        numpy_ref.close()
        raise
    if ggml_ref:
        print(f"llama.cpp: llama-cpp-python {ggml_ref.info['llama_cpp']}'s ggml in a child process without numba, "
              f"the same threads, weights as it loads them (repacked: {', '.join(ggml_ref.info['repacked']) or 'none'}), "
              f"activations quantized as it does")
    else:
        print(f"llama.cpp: no rows ({why_not})")
    print(f"compiled products: {compiled.cpu.REASON}; {numba.get_num_threads()} thread(s), "
          f"layer {numba.threading_layer() if hasattr(numba, 'threading_layer') else '?'}")
    for var in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):
        if var in os.environ:
            print(f"warning: {var}={os.environ[var]} is set; it may slow OpenBLAS (see the docstring)")

    rng = np.random.default_rng(0)
    types = [d for d in (DType.F32, DType.F16, DType.BF16, DType.Q8_0, DType.Q4_0, DType.Q4_1, DType.Q5_0,
                         DType.Q4_K, DType.Q5_K, DType.Q6_K) if d in compiled.PRODUCTS]
    if any(args.k % d.block_size for d in types):
        print(f"left out: {', '.join(d.name for d in types if args.k % d.block_size)} "
              f"(their blocks do not divide K = {args.k})")
        types = [d for d in types if not args.k % d.block_size]
    weights = {d: weight(d, args.n, args.k) for d in types}  # K-quants: random codes, sane scales
    same = args.flush_kind == "same" and not args.flush_as_one
    if args.flush_as_one:
        f32_flushes = [np.full((flush_rows, args.k), 0.5, np.float32)]
        what = "one other f32 weight"
    elif same:
        # at least one weight of every type, as the child reads at least one f32 weight
        buffer = flush_buffer(max(args.flush_mb * 2**20, args.n * args.k * 4))
        what = "other weights of this shape, a product of the measured kind each"
    else:
        f32_flushes = [weight(DType.F32, args.n, args.k, seed=100 + i) for i in range(-(-flush_rows // args.n))]
        what = f"{len(f32_flushes)} other f32 weights of this shape, a compiled F32 product each"
    flushed = buffer.nbytes / 2**20 if same else sum(f.nbytes for f in f32_flushes) / 2**20
    print(f"\nW [{args.n}, {args.k}], median of {args.runs} runs, each after {flushed:.0f} MB of {what}; "
          f"GB/s of weight bytes (vs numpy f32 at the same M)\n")
    head = f"| {'product':<26} | {'MB':>6} |" + "".join(f" {'M=' + str(m):>15} |" for m in ms)
    print(head)
    print("|" + "-" * 28 + "|" + "-" * 8 + "|" + "".join("-" * 17 + "|" for _ in ms))
    rows = [("numpy x @ W.T (f32)", args.n * args.k * 4, lambda x: numpy_ref(len(x)))]
    for d, kind in GGML_TYPES.items() if ggml_ref else ():
        if d in types:
            rows.append((f"llama.cpp {d.name}", weights[d].nbytes, lambda x, kind=kind: ggml_ref(f"{kind} {len(x)}")))
    flushes = {}  # product name -> its untimed products, each a callable
    if args.numpy_here:
        w = weight(DType.F32, args.n, args.k)
        rows.append(("numpy, in this process", w.nbytes, lambda x: x @ w.T))
        flushes[rows[-1][0]] = [(lambda x, f=f: x @ f.T) if same else functools.partial(compiled.linear, w=f)
                                for f in (flush_weights(DType.F32, args.n, args.k, buffer) if same else f32_flushes)]
    for d in types:
        modes = ("f32", "q8_0") if d.is_quantized else ("f32",)
        others = flush_weights(d, args.n, args.k, buffer) if same else f32_flushes
        for mode in modes:
            name = f"compiled {d.name}" + (" q8 act." if mode == "q8_0" else "")
            rows.append((name, weights[d].nbytes, lambda x, s=weights[d], a=mode: compiled.linear(x, s, activations=a)))
            flushes[name] = [functools.partial(compiled.linear, w=w, activations=mode if same else "f32")
                             for w in others]
    xs = {m: rng.standard_normal((m, args.k), dtype=np.float32) for m in measured}

    def before(key):
        for flush in flushes.get(key[0], ()):  # the child flushes its own, with the same rows
            flush(xs[min(measured)])

    try:
        times = medians({(name, m): (lambda fn=fn, x=xs[m]: fn(x)) for name, _, fn in rows for m in measured},
                        args.runs, before)
    finally:
        numpy_ref.close()
        if ggml_ref:
            ggml_ref.close()
    for name, nbytes, _ in rows:
        cells = []
        for m in ms:
            gbs, reference = nbytes / times[(name, m)] / 1e9, rows[0][1] / times[(rows[0][0], m)] / 1e9
            cells.append(f"{gbs:6.2f} ({gbs / reference:4.2f}x)")
        print(f"| {name:<26} | {nbytes / 1e6:6.1f} |" + "".join(f" {c:>15} |" for c in cells))
    if ggml_ref:
        print("\nours with q8 activations / llama.cpp, GB/s at the same M (llama.cpp's numerics both)\n")
        for d in GGML_TYPES:
            if d in types:
                ratios = (times[(f"llama.cpp {d.name}", m)] / times[(f"compiled {d.name} q8 act.", m)] for m in ms)
                print(f"  {d.name:<6}" + "".join(f"  M={m}: {r:4.2f}x" for m, r in zip(ms, ratios)))
    if 1 in ms:
        print("\ntime at M = 8 / time at M = 1 (each weight block read once for all rows)\n")
        for name, _, _ in rows:
            print(f"  {name:<26} {times[(name, 8)] / times[(name, 1)]:5.2f}x")


if __name__ == "__main__":
    main()
