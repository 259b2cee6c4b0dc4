"""bench_matvec.py's second reference: llama.cpp's own products, timed in a process of its own.

Started by bench_matvec.py, never by hand.  It drives ggml's CPU backend, the library that
llama-cpp-python ships and llama.cpp decodes with, through its C API (ctypes): for each stored
type a weight ``[n, k]``, a graph of one ``ggml_mul_mat`` with ``x [m, k]`` per ``m``, computed
by the CPU backend on ``threads`` threads.  Weights of the types llama.cpp repacks on this CPU
(:data:`REPACKED`) live in ggml's "CPU_REPACK" buffer, as llama.cpp loads a model's weights, so
that its interleaved kernels run (Q4_0 as ``q4_0_8x8``); the others in the plain CPU buffer.  Its
activations are quantized as llama.cpp's are (Q8_0, Q8_K): these rows compare with the compiled
products' "q8 act." rows.  It loads numpy, gguf and ggml, never numba (its OpenMP threads beside
numba's would slow both; see numpy_matvec_child.py).

The weight bytes are random in 0x30..0x4F (``flush_buffer``, as bench_matvec.py's flush weights):
every block scale a normal f16, the codes arbitrary.  At start each type's product at the first ``m`` is
checked against ``gguf``'s dequantization (a wrong binding would time a wrong product).

Protocol, one line each way: arguments ``n k m1,m2,... flush_bytes threads type1,type2,...``
(types by ggml's names: ``q8_0``, ``q4_0``, ``q4_K``); it answers ``ready <json>`` (llama.cpp's
version, the types it repacks, whether numba got loaded: it must not), then for each line
``<type> <m>`` runs one graph of untimed products on ``flush_bytes`` of other weights of that type
(threads awake, the cache holding those weights, not this one), then the measured graph, and
answers its seconds once the OpenMP threads have stopped spinning; an empty line or EOF ends it.
A type it cannot run (its block does not divide ``k``) answers ``nan``.
"""

from __future__ import annotations

import ctypes as C
import json
import os
import sys
import time

import numpy as np

from numpy_matvec_child import flush_buffer, settle

#: Types llama.cpp 0.3.36 repacks on an AVX2 CPU when it loads a model (it logs "repack tensor ...
#: with q4_0_8x8", "... q4_K_8x8"; Q8_0's repacked kernels are ARM's alone) where a weight's rows
#: are a multiple of 8.  A type missing from ggml's repack table would crash in ``tensor_set``.
REPACKED = {"q4_0", "q4_K"}
#: ggml's type ids and (elements, bytes) of a block.
TYPES = {"f32": (0, 1, 4), "q4_0": (2, 32, 18), "q8_0": (8, 32, 34), "q4_K": (12, 256, 144)}


#: ggml's log levels worth showing (``enum ggml_log_level``).
WARN, ERROR = 3, 4


class _Params(C.Structure):
    _fields_ = [("mem_size", C.c_size_t), ("mem_buffer", C.c_void_p), ("no_alloc", C.c_bool)]


class Ggml:
    """The few functions of ggml's C API a product needs, from llama-cpp-python's libraries."""

    def __init__(self):
        import llama_cpp

        self.version = llama_cpp.__version__
        lib = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
        base = C.CDLL(os.path.join(lib, "libggml-base.so"), mode=C.RTLD_GLOBAL)
        cpu = C.CDLL(os.path.join(lib, "libggml-cpu.so"), mode=C.RTLD_GLOBAL)
        p, size = C.c_void_p, C.c_size_t
        for lib_, name, res, args in (
                (base, "init", p, [_Params]), (base, "new_tensor_2d", p, [p, C.c_int, C.c_int64, C.c_int64]),
                (base, "mul_mat", p, [p, p, p]), (base, "new_graph", p, [p]),
                (base, "build_forward_expand", None, [p, p]), (base, "tensor_overhead", size, []),
                (base, "graph_overhead", size, []), (base, "backend_alloc_ctx_tensors_from_buft", p, [p, p]),
                (base, "backend_cpu_buffer_type", p, []), (base, "backend_tensor_set", None, [p, p, size, size]),
                (base, "backend_tensor_get", None, [p, p, size, size]),
                (base, "backend_graph_compute", C.c_int, [p, p]), (cpu, "backend_cpu_init", p, []),
                (cpu, "backend_cpu_set_n_threads", None, [p, C.c_int])):
            fn = getattr(lib_, "ggml_" + name)
            fn.restype, fn.argtypes = res, args
            setattr(self, name, fn)
        def log(level, text, _):  # ggml logs each weight it repacks: keep its warnings and errors only
            if level in (WARN, ERROR):
                sys.stderr.write(text.decode(errors="replace"))
        self._log = C.CFUNCTYPE(None, C.c_int, C.c_char_p, C.c_void_p)(log)
        base.ggml_log_set.argtypes = [C.c_void_p, C.c_void_p]
        base.ggml_log_set(C.cast(self._log, C.c_void_p), None)
        # C++, not in the C header: the buffer type llama.cpp loads weights into ("CPU_REPACK")
        self.backend_cpu_repack_buffer_type = getattr(cpu, "_Z35ggml_backend_cpu_repack_buffer_typev")
        self.backend_cpu_repack_buffer_type.restype, self.backend_cpu_repack_buffer_type.argtypes = p, []

    def context(self, tensors: int, graph: bool = False):
        """A context holding only the metadata of ``tensors`` tensors (and a graph)."""
        return self.init(_Params(self.tensor_overhead() * tensors + (self.graph_overhead() if graph else 0), None, True))


class Weights:
    """Weights ``[n, k]`` of ``kind`` from their stored bytes ``datas``, in the buffer llama.cpp
    would load them into (repacked where it repacks the type)."""

    def __init__(self, g: Ggml, kind: str, datas: list, n: int, k: int):
        self.g, self.kind, self.n, self.k = g, kind, n, k
        self.ctx = g.context(len(datas))
        self.tensors = [g.new_tensor_2d(self.ctx, TYPES[kind][0], k, n) for _ in datas]
        self.repacked = kind in REPACKED and n % 8 == 0
        buft = g.backend_cpu_repack_buffer_type() if self.repacked else g.backend_cpu_buffer_type()
        self.buffer = g.backend_alloc_ctx_tensors_from_buft(self.ctx, buft)
        if not self.buffer:
            raise MemoryError(f"ggml could not allocate {len(datas)} {kind} weights")
        for w, data in zip(self.tensors, datas):
            g.backend_tensor_set(w, data.ctypes.data, 0, data.nbytes)


class Products:
    """``y_i = x @ W_i^T`` for every weight of ``weights``, ``x`` of ``m`` rows, in one ggml
    graph computed by ``backend``."""

    def __init__(self, weights: Weights, backend, m: int):
        g = self.g = weights.g
        self.backend, self.m, self.n = backend, m, weights.n
        self.ctx = g.context(len(weights.tensors) + 1, graph=True)
        self.x = g.new_tensor_2d(self.ctx, TYPES["f32"][0], weights.k, m)
        self.ys = [g.mul_mat(self.ctx, w, self.x) for w in weights.tensors]
        self.graph = g.new_graph(self.ctx)
        for y in self.ys:
            g.build_forward_expand(self.graph, y)
        self.buffer = g.backend_alloc_ctx_tensors_from_buft(self.ctx, g.backend_cpu_buffer_type())

    def set_x(self, x: np.ndarray) -> None:
        x = np.ascontiguousarray(x, np.float32)
        self.g.backend_tensor_set(self.x, x.ctypes.data, 0, x.nbytes)

    def run(self) -> None:
        if self.g.backend_graph_compute(self.backend, self.graph) != 0:
            raise RuntimeError("ggml_backend_graph_compute failed")

    def y(self, i: int = 0) -> np.ndarray:
        out = np.empty((self.m, self.n), np.float32)
        self.g.backend_tensor_get(self.ys[i], out.ctypes.data, 0, out.nbytes)
        return out


def check(product: Products, kind: str, data: np.ndarray, x: np.ndarray, n: int, k: int) -> float:
    """The relative error of ggml's product against gguf's dequantization of the same bytes."""
    from gguf.quants import GGMLQuantizationType, dequantize

    product.set_x(x)
    product.run()
    qtype = GGMLQuantizationType[kind.upper()] if kind != "f32" else GGMLQuantizationType.F32
    w = dequantize(data.reshape(n, -1), qtype).astype(np.float64)
    ref = x.astype(np.float64) @ w.T
    return float(np.abs(product.y() - ref).max() / max(np.abs(ref).max(), 1e-30))


def main() -> None:
    if len(sys.argv) != 7:
        sys.exit("usage: ggml_matvec_child.py n k m1,m2,... flush_bytes threads type1,type2,... "
                 "(bench_matvec.py starts it; see its docstring)")
    n, k, ms = int(sys.argv[1]), int(sys.argv[2]), [int(v) for v in sys.argv[3].split(",")]
    flush_bytes, threads, kinds = int(sys.argv[4]), int(sys.argv[5]), sys.argv[6].split(",")
    g = Ggml()
    backend = g.backend_cpu_init()
    g.backend_cpu_set_n_threads(backend, threads)
    rng = np.random.default_rng(1)
    xs = {m: rng.standard_normal((m, k), dtype=np.float32) for m in ms}
    measured, flushes, errors, repacked, keep = {}, {}, {}, [], []
    for kind in kinds:
        _, block, block_bytes = TYPES[kind]
        if k % block:
            continue
        size = n * (k // block) * block_bytes
        data = flush_buffer(size, 0)
        weight = Weights(g, kind, [data], n, k)
        measured[kind] = {m: Products(weight, backend, m) for m in ms}
        errors[kind] = check(measured[kind][ms[0]], kind, data, xs[ms[0]], n, k)
        others = flush_buffer(max(flush_bytes // size, 1) * size, 7)
        flush = Weights(g, kind, np.split(others, len(others) // size), n, k)
        del others  # ggml holds its own copy
        flushes[kind] = Products(flush, backend, min(ms))
        flushes[kind].set_x(xs[min(ms)])
        for m in ms:
            measured[kind][m].set_x(xs[m])
            measured[kind][m].run()  # warm up
        repacked += [kind] * weight.repacked
        keep += [weight, flush]
    print("ready " + json.dumps({"llama_cpp": g.version, "repacked": repacked,
                                 "errors": errors, "numba_loaded": "numba" in sys.modules}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        kind, m = line.split()
        if kind not in measured:
            print("nan", flush=True)
            continue
        flushes[kind].run()
        product = measured[kind][int(m)]
        start = time.perf_counter()
        product.run()
        seconds = time.perf_counter() - start
        settle()
        print(repr(seconds), flush=True)


if __name__ == "__main__":
    main()
