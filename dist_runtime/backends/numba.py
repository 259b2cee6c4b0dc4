"""``numba``: the small ops of a decode step and the matmul family compiled (F32 prefills on BLAS).

A decode step of a Llama-family model is mostly matrix-vector products, which BLAS runs at memory
bandwidth; between them come ~10 small ops per layer, on which numpy spends its dispatch and
temporaries: in a 30 ms token of ``benchmarks/bench_decode.py``'s model, Sdpa took 272 us a call,
FusedSkipNorm 60, Rope 48 -- 6 ms in all.  This backend compiles those ops with numba, one pass over
the data each (2-22 us a call):

- RmsNorm and FusedSkipNorm, any rank (rows of the last dim);
- Rope on ``[T, heads * head_dim]``, full or partial rotary;
- Sdpa and SdpaWindow without a mask input, on ``[Tq, heads * head_dim]`` queries and
  ``[Tk, kv_heads * head_dim]`` keys and values: grouped-query, end-aligned, causal or not,
  windowed, each key and value row read once, whole, for all the query heads (one pass over the
  keys, one over the values, a vectorised exp).  Only small
  products run here (``small_attention``: a decode step over up to 8192 keys, or ``Tq * Tk <=
  1024``); larger ones go to the CPU library, whose BLAS products win there
  (``benchmarks/bench_attention.py``) -- except when the backend is ``invariant``: then every
  attention runs here, since a row's result must not depend on how many query rows share the call
  (a prompt fed in chunks, sessions batched) and BLAS's does.

and the matmul family -- Matmul (the lm_head and tied embeddings included), FusedNormMatmul,
FusedSwiGlu, LoraApply -- on the compiled products of :mod:`dist_runtime.backends.compiled`:
weights as stored (F32, F16, BF16, GGML blocks), read in place, threads over output rows,
batch-invariant; FusedSwiGlu's ``silu(gate) * up`` and FusedNormMatmul's norm compiled too.
``NumbaBackend(activations="q8_0")`` (the backend name ``numba-q8``) quantizes the activations per
block as llama.cpp does.  ``inspect --plan`` says per product which path runs it and why.

Its activations are F32 and its weights any type the compiled products read; every other dtype
and op it declines at plan time, and :func:`dist_runtime.backends.assign.assign_backends` sends
those nodes to the CPU library.  A node
whose inputs at run time leave the fast path (a large attention, an empty tensor, a shape the CPU
library would reject) is run by the CPU library's kernel, which gives the same result or the same
error.  Each op it takes is one entry of :attr:`NumbaBackend.ops`.
Results agree with the CPU library within float rounding (``tests/test_backends_numba.py``).

The small ops use no threads.  The products use numba's TBB threads when installed, else its
``workqueue`` pool (:mod:`.compiled.threads`; OpenMP's spinning workers, beside OpenBLAS's on the
same 2 cores, made the next matrix-vector product 60x slower), as many threads as the stage's CPU share (``NUMBA_NUM_THREADS``, set per stage actor).  numba compiles each kernel on
first use and caches the machine code beside this file (8 s for all of them in a new checkout,
0.6 s to load them in a later process).  With numba installed, ``GraphExecutor(model)`` uses this
backend by default (:func:`dist_runtime.backends.default_backends`), and a node hinted ``numba``
(``BackendHint.NUMBA``) asks for it.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from dist_runtime.kernels.positions import position, rope_cos_sin

from ..dtypes import DType
from ..ir.graph import Node, TensorSpec
from ..ir.hints import BackendHint
from ..ir.ops import (FusedNormMatmul, FusedSkipNorm, FusedSwiGlu, LoraApply, Matmul, OpPayload, RmsNorm, Rope,
                      Sdpa, SdpaWindow)
from ..tensor import Array
from . import BoundKernel, OpEntry, TableBackend, compiled, register_backend
from .compiled import simd
from .blas import WEIGHT_SLOTS, matmul_family_supports
from .cpu import CpuBackend

F32 = np.dtype(np.float32)

#: Attention runs here while query rows x keys <= SMALL_ATTENTION, or for one query row (a decode
#: step) over at most DECODE_KEYS keys; beyond, the CPU library's BLAS products, on every core,
#: win (``benchmarks/bench_attention.py``).  A decode step here, on one thread, measured 1.2-1.9x
#: faster than the CPU library on two at 2048-8192 keys (0.45 / 0.9 / 1.8 ms against 0.78 / 1.2 /
#: 2.4); beyond 8192 it was not measured.
SMALL_ATTENTION = 1024

#: From this many rows an F32 product goes to BLAS when invariance is not asked for.  The 125M
#: model's prefill with BLAS / compiled (TBB threads), one session: 16 rows 54.9 / 38.3 ms, 128
#: rows 182.8 / 179.2, 512 rows 687.6 / 885.6; its decode step 18.3 / 16.9 ms.
BLAS_ROWS = 128
DECODE_KEYS = 8192




def small_attention(query_rows: int, keys: int) -> bool:
    """Whether an attention of this size runs in the compiled loop (else in the CPU library)."""
    return query_rows * keys <= SMALL_ATTENTION or (query_rows == 1 and keys <= DECODE_KEYS)


# Reassociation lets the reductions vectorise; no "nnan"/"ninf", so NaN and inf propagate as in
# numpy.  The numpy error model makes x / 0 an inf, not a ZeroDivisionError.
_jit = numba.njit(nogil=True, cache=True, boundscheck=False, error_model="numpy",
                  fastmath={"reassoc", "contract", "nsz", "arcp"})


@_jit
def _rms_rows(x, weight, eps, out):
    """``out[i] = x[i] / sqrt(mean(x[i]^2) + eps) * weight`` for each row ``i`` of a 2-D ``x``."""
    n = x.shape[1]
    for i in range(x.shape[0]):
        ss = 0.0  # f64: the sum of squares of a wide row loses nothing
        for j in range(n):
            ss += np.float64(x[i, j]) * x[i, j]
        inv = np.float32(1.0 / math.sqrt(ss / max(n, 1) + eps))
        for j in range(n):
            out[i, j] = x[i, j] * inv * weight[j]


@_jit
def _skip_rms_rows(x, residual, weight, eps, total, out):
    """``total = x + residual`` and ``out = RmsNorm(total)``."""
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            total[i, j] = x[i, j] + residual[i, j]
    _rms_rows(total, weight, eps, out)


@_jit
def _rope_rows(x, cos, sin, head_dim, rope_dim, out):
    """Rotate-half rotary embedding of row ``t`` by ``cos[t]``, ``sin[t]`` (``[T, rope_dim/2]``)."""
    half = rope_dim // 2
    for t in range(x.shape[0]):
        for base in range(0, x.shape[1], head_dim):
            for i in range(half):
                x1, x2 = x[t, base + i], x[t, base + half + i]
                out[t, base + i] = x1 * cos[t, i] - x2 * sin[t, i]
                out[t, base + half + i] = x2 * cos[t, i] + x1 * sin[t, i]
            for i in range(base + rope_dim, base + head_dim):
                out[t, i] = x[t, i]


# exp's argument reduction (x - n * ln2 in two parts) must not be reassociated: no fast-math
# beyond fusing a multiply-add, which keeps it one fixed sequence of operations.
_exact = numba.njit(nogil=True, cache=True, boundscheck=False, error_model="numpy", fastmath={"contract"})

#: Below this, exp(x) is under float32's smallest normal: taken as 0.
_EXP_MIN = np.float32(-87.33654)


@_exact
def _exp_shifted(s, m, n, bits):
    """``s[t] = exp(s[t] - m)`` for ``t < n`` (all ``s[t] <= m``), vectorised (``libm``'s scalar
    ``expf`` per key and head was a fifth of a decode step's attention over 1024 keys).  Cephes' ``expf``: ``2^k``
    times a degree-7 polynomial in ``r = x - k ln2`` (relative error ~1e-7, well inside the
    softmax tests' 1e-5), ``2^k`` built in ``bits`` (int32 scratch, ``>= n``) and read back as float32."""
    for t in range(n):
        x0 = s[t] - m
        x = _EXP_MIN if x0 < _EXP_MIN else x0  # NaN stays NaN
        k = np.floor(x * np.float32(1.44269504) + np.float32(0.5))
        r = x - k * np.float32(0.693359375) - k * np.float32(-2.12194440e-4)
        p = np.float32(1.9875691500e-4)
        p = p * r + np.float32(1.3981999507e-3)
        p = p * r + np.float32(8.3334519073e-3)
        p = p * r + np.float32(4.1665795894e-2)
        p = p * r + np.float32(1.6666665459e-1)
        p = p * r + np.float32(5.0000001201e-1)
        bits[t] = (np.int32(k) + np.int32(127)) << np.int32(23)
        s[t] = np.float32(0.0) if x0 < _EXP_MIN else p * r * r + r + np.float32(1.0)
    powers = bits[:n].view(np.float32)
    for t in range(n):
        s[t] *= powers[t]


@intrinsic
def _prefetch_row(typingctx, a, row):
    """Hint the caches to load row ``row`` of the 2-D array ``a`` (every 64-byte line of it); a
    hint never faults, so a row past the end is harmless."""
    def codegen(context, builder, sig, args):
        arr = context.make_array(sig.args[0])(context, builder, args[0])
        stride = cgutils.unpack_tuple(builder, arr.strides, 2)[0]
        start = builder.mul(args[1], stride)
        with cgutils.for_range_slice(builder, start, builder.add(start, stride), ir.Constant(start.type, 64)) as (at, _):
            simd.prefetch(builder, arr.data, at, 3)
        return context.get_dummy_value()
    return types.void(a, types.intp), codegen


#: Key (and value) rows ahead of the one in use that the decode attention prefetches: its passes
#: walk rows of a few hundred bytes to a few KB, which the hardware prefetcher alone left waiting
#: on memory once the cache held no longer all the layers' K and V.
AHEAD_ROWS = 4


@_jit
def _attend_row(q, k, v, lo, hi, kv_heads, groups, head_dim, scale, scores, bits, out):
    """One query row ``q [heads * head_dim]`` (head ``h`` on kv head ``h // groups``):
    ``out[h] = softmax(K_h @ q[h] * scale) @ V_h`` over key rows ``[lo, hi)``.

    One pass over the key rows and one over the value rows, each row read once, whole, for every
    head (grouped-query attention's saving: the K/V bytes of a step, not ``groups`` times them;
    and one sequential stream rather than one per kv head).  ``scores [heads, >= hi - lo]`` and
    ``bits [>= hi - lo]`` are scratch.  Per head the arithmetic is one fixed sequence whatever the
    other heads or rows: a row's result is the same alone or in a batch.
    """
    n = hi - lo
    for t in range(n):
        _prefetch_row(k, lo + t + AHEAD_ROWS)
        kt = k[lo + t]
        h = 0
        for g in range(kv_heads):
            kh = kt[g * head_dim:(g + 1) * head_dim]
            for _ in range(groups):
                qh = q[h * head_dim:(h + 1) * head_dim]
                d = np.float32(0.0)
                for i in range(head_dim):
                    d += qh[i] * kh[i]
                scores[h, t] = d * scale
                h += 1
    for h in range(kv_heads * groups):
        sh = scores[h]
        m = np.float32(-np.inf)
        for t in range(n):
            m = max(m, sh[t])
        _exp_shifted(sh, m, n, bits)
        total = np.float32(0.0)
        for t in range(n):
            total += sh[t]
        inv = np.float32(1.0) / total
        for t in range(n):
            sh[t] *= inv
    out[:] = 0.0
    for t in range(n):
        _prefetch_row(v, lo + t + AHEAD_ROWS)
        vt = v[lo + t]
        h = 0
        for g in range(kv_heads):
            vh = vt[g * head_dim:(g + 1) * head_dim]
            for _ in range(groups):
                p, oh = scores[h, t], out[h * head_dim:(h + 1) * head_dim]
                for i in range(head_dim):
                    oh[i] += p * vh[i]
                h += 1


@_jit
def _attention_rows(q, k, v, num_heads, kv_heads, head_dim, causal, window, out):
    """Softmax attention of each query row and head over the keys it may see.

    Query row ``r`` sits at key position ``r + Tk - Tq`` (end-aligned, as with a KV cache).
    Causal: it sees keys up to its own position; ``window > 0`` keeps the ``window`` nearest
    (behind it if causal, on either side if not).  The caller makes sure every row sees a key.
    """
    tq, tk = q.shape[0], k.shape[0]
    scale = np.float32(1.0 / math.sqrt(head_dim))
    scores = np.empty((num_heads, tk), np.float32)
    bits = np.empty(tk, np.int32)
    for r in range(tq):
        at = r + tk - tq
        lo, hi = 0, tk
        if causal:
            hi = at + 1
        if window > 0:
            lo = max(0, at - window + 1)
            if not causal:
                hi = min(tk, at + window)
        _attend_row(q[r], k, v, lo, hi, kv_heads, num_heads // kv_heads, head_dim, scale, scores, bits, out[r])


@_jit
def _silu_mul_compiled(gate, up):
    """``gate = silu(gate) * up``, in place (both fresh, contiguous 1-D products)."""
    for i in range(gate.shape[0]):
        g = gate[i]
        gate[i] = g / (np.float32(1.0) + np.exp(-g)) * up[i]


#: Every Rope node of a step (q and k of every layer) rotates by the same positions.
_cos_sin = functools.lru_cache(maxsize=64)(rope_cos_sin)


def _rows(x: np.ndarray) -> np.ndarray:
    """``x`` as contiguous 2-D rows of its last dim (a view when it already is)."""
    return np.ascontiguousarray(x.reshape(-1, x.shape[-1]) if x.ndim != 2 else x)


def _rms_compiled(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RmsNorm of F32 ``x`` over its last dim, any rank."""
    out = np.empty(x.shape, F32)
    _rms_rows(_rows(x), weight, eps, out.reshape(-1, x.shape[-1]))
    return out


def _is_f32(*arrays) -> bool:
    """Plain, non-empty F32 arrays (anything else is the CPU library's to run or reject)."""
    return all(type(a) is np.ndarray and a.dtype == F32 and a.size for a in arrays)


# -- the binders: ``binder(backend, node) -> BoundKernel``; off the fast path, the CPU library's kernel
def _bind_rms_norm(backend: NumbaBackend, node: Node) -> BoundKernel:
    op, reference = node.op, backend.reference(node)

    def run(inputs, ctx):
        x, weight = inputs
        if not (_is_f32(x, weight) and weight.shape == x.shape[-1:]):
            return reference(inputs, ctx)
        return (_rms_compiled(x, weight, op.eps),)
    return run


def _bind_skip_norm(backend: NumbaBackend, node: Node) -> BoundKernel:
    op, reference = node.op, backend.reference(node)

    def run(inputs, ctx):
        x, residual, weight = inputs
        if not (_is_f32(x, residual, weight) and residual.shape == x.shape
                and weight.shape == x.shape[-1:]):
            return reference(inputs, ctx)
        total, out = np.empty(x.shape, F32), np.empty(x.shape, F32)
        width = x.shape[-1]
        _skip_rms_rows(_rows(x), _rows(residual), weight, op.eps,
                       total.reshape(-1, width), out.reshape(-1, width))
        return total, out
    return run


def _takes_weight(x, w) -> bool:
    """``x [..., K]`` F32 against a stored ``W [N, K]`` the compiled products read."""
    return _is_f32(x) and compiled.supports(w) and w.shape[1] == x.shape[-1]


def _bind_swiglu(backend: NumbaBackend, node: Node) -> BoundKernel:
    reference = backend.reference(node)

    def run(inputs, ctx):
        x, w_gate, w_up = inputs
        if not (_takes_weight(x, w_gate) and _takes_weight(x, w_up) and w_gate.shape == w_up.shape):
            return reference(inputs, ctx)
        gate, up = backend.linear(x, w_gate), backend.linear(x, w_up)
        _silu_mul_compiled(gate.reshape(-1), up.reshape(-1))
        return (gate,)
    return run


def _bind_norm_matmul(backend: NumbaBackend, node: Node) -> BoundKernel:
    op, reference = node.op, backend.reference(node)

    def run(inputs, ctx):
        x, norm_weight, w = inputs
        if not (_takes_weight(x, w) and _is_f32(norm_weight) and norm_weight.shape == x.shape[-1:]):
            return reference(inputs, ctx)
        return (backend.linear(_rms_compiled(x, norm_weight, op.eps), w),)
    return run


def _bind_matmul(backend: NumbaBackend, node: Node) -> BoundKernel:
    op, reference = node.op, backend.reference(node)

    def run(inputs, ctx):
        a, b = inputs
        if not (op.transpose_b and _takes_weight(a, b)):
            return reference(inputs, ctx)
        return (backend.linear(a, b),)
    return run


def _bind_lora(backend: NumbaBackend, node: Node) -> BoundKernel:
    """The base product and both low-rank ones compiled: a row's result stays batch-invariant."""
    op, reference = node.op, backend.reference(node)

    def run(inputs, ctx):
        x, w, a, b = inputs
        if not (_takes_weight(x, w) and _takes_weight(x, a) and _is_f32(b) and b.ndim == 2
                and b.shape[1] == a.shape[0] and b.shape[0] == w.shape[0]):
            return reference(inputs, ctx)
        y = backend.linear(x, w)
        low = backend.linear(backend.linear(x, a), np.ascontiguousarray(b))
        low *= np.float32(op.scale)
        y += low
        return (y,)
    return run


def _bind_rope(backend: NumbaBackend, node: Node) -> BoundKernel:
    op, reference = node.op, backend.reference(node)

    def run(inputs, ctx):
        x, pos = inputs
        if not (_is_f32(x) and x.ndim == 2 and op.head_dim and x.shape[1] % op.head_dim == 0
                and op.rope_dim <= op.head_dim):
            return reference(inputs, ctx)
        cos, sin = _cos_sin(position("Rope", pos), x.shape[0], op.rope_dim, float(op.base))
        out = np.empty(x.shape, F32)
        _rope_rows(_rows(x), cos, sin, op.head_dim, op.rope_dim, out)
        return (out,)
    return run


def _bind_attention(backend: NumbaBackend, node: Node) -> BoundKernel:
    op, reference = node.op, backend.reference(node)
    window = op.window if isinstance(op, SdpaWindow) else 0
    widths = (op.num_heads * op.head_dim, op.kv_heads * op.head_dim)

    def run(inputs, ctx):
        q, k, v = inputs
        if not (_is_f32(q, k, v) and q.ndim == k.ndim == v.ndim == 2
                and (backend.invariant or small_attention(q.shape[0], k.shape[0]))
                and k.shape[0] == v.shape[0]
                and (q.shape[1], k.shape[1]) == widths and v.shape[1] == widths[1]
                and not (op.causal and q.shape[0] > k.shape[0])):
            return reference(inputs, ctx)
        out = np.empty(q.shape, F32)
        _attention_rows(_rows(q), _rows(k), _rows(v), op.num_heads, op.kv_heads,
                        op.head_dim, bool(op.causal), window, out)
        return (out,)
    return run


# -- what it takes at plan time (F32 inputs already checked) -----------------------------------------
def _rows_of_last_dim(op: OpPayload, input_specs: Sequence[TensorSpec]) -> bool:
    return len(input_specs[0].shape) >= 1


def _rope_rows_2d(op: Rope, input_specs: Sequence[TensorSpec]) -> bool:
    return len(input_specs[0].shape) == 2 and op.rope_dim % 2 == 0


def _attention_2d(op: Sdpa | SdpaWindow, input_specs: Sequence[TensorSpec]) -> bool:
    """No mask input, 2-D queries, keys and values, and a windowed op with a window."""
    return (len(input_specs) == 3 and all(len(s.shape) == 2 for s in input_specs) and op.kv_heads > 0
            and (op.window > 0 if isinstance(op, SdpaWindow) else True))


class NumbaBackend(TableBackend):
    """The small ops of a decode step, compiled (see the module docstring)."""

    name = "numba"
    dtypes = frozenset({DType.F32})
    ops = {
        RmsNorm: OpEntry(_rows_of_last_dim, _bind_rms_norm),
        FusedSkipNorm: OpEntry(_rows_of_last_dim, _bind_skip_norm),
        Rope: OpEntry(_rope_rows_2d, _bind_rope),
        Sdpa: OpEntry(_attention_2d, _bind_attention),
        SdpaWindow: OpEntry(_attention_2d, _bind_attention),
        FusedSwiGlu: OpEntry(matmul_family_supports, _bind_swiglu),
        FusedNormMatmul: OpEntry(matmul_family_supports, _bind_norm_matmul),
        Matmul: OpEntry(matmul_family_supports, _bind_matmul),
        LoraApply: OpEntry(matmul_family_supports, _bind_lora),
    }

    def __init__(self, hint: BackendHint = BackendHint.NUMBA, *, activations: str = "f32",
                 invariant: bool = False) -> None:
        if activations not in compiled.ACTIVATIONS:
            raise ValueError(f"activations must be one of {compiled.ACTIVATIONS}, got {activations!r}")
        self.hint = BackendHint(hint)
        self.activations = activations
        # invariant: every row computed as it would be alone (passes mixing sessions' rows, a
        # prompt fed in chunks): the compiled products and attention always.  Otherwise an F32
        # product of BLAS_ROWS rows or more (one session's long prefill) goes to BLAS.
        self.invariant = invariant
        self.name = "numba" if activations == "f32" else "numba-q8"
        self._cpu = CpuBackend()

    def supports(self, op: OpPayload, input_specs: Sequence[TensorSpec]) -> bool:
        """F32 everywhere, except the weights of the matmul family: any type a compiled product
        reads (F32, F16, BF16, GGML blocks)."""
        entry = self.ops.get(type(op))
        if entry is None or not entry.supports(op, input_specs):
            return False
        weights = WEIGHT_SLOTS.get(type(op), ())
        return all(s.dtype in (compiled.KERNELS if i in weights else self.dtypes)
                   for i, s in enumerate(input_specs))

    def detail(self, op: OpPayload, input_specs: Sequence[TensorSpec]) -> str | None:
        """How a product runs (``inspect --plan``): the compiled path and its activations."""
        if type(op) not in WEIGHT_SLOTS:
            return None
        types = sorted({input_specs[i].dtype.name for i in WEIGHT_SLOTS[type(op)] if i < len(input_specs)})
        if types == ["F32"] and not self.invariant:
            return (f"F32 product compiled below {BLAS_ROWS} rows, on BLAS from {BLAS_ROWS} (one session per pass: "
                    f"no batch invariance needed; {compiled.threads.REASON})")
        return (f"compiled {'/'.join(types)} product ({compiled.cpu.REASON}; {compiled.threads.REASON}), "
                f"{self.activations} activations")

    def linear(self, x: np.ndarray, w: Array) -> np.ndarray:
        """``x [..., K] @ W[N, K]^T`` in F32: the compiled product (batch-invariant), or BLAS for
        an F32 weight and at least :data:`BLAS_ROWS` rows unless :attr:`invariant`."""
        x2 = x.reshape(-1, x.shape[-1])
        if not self.invariant and x2.shape[0] >= BLAS_ROWS and isinstance(w, np.ndarray) and w.dtype == F32:
            y = x2 @ w.T
        else:
            y = compiled.linear(x2, w, activations=self.activations)
        return y.reshape(*x.shape[:-1], w.shape[0])

    def reference(self, node: Node) -> BoundKernel:
        """The CPU library's kernel for ``node``: what runs off the fast path."""
        return self._cpu.bind(node)

    def quant_matmul(self, x: np.ndarray, w: Array) -> np.ndarray:
        return self._cpu.quant_matmul(x, w)


register_backend("numba", NumbaBackend)
# llama.cpp's numerics: activations quantized to Q8_0 per block before integer dot products.
register_backend("numba-q8", lambda: NumbaBackend(activations="q8_0"))
