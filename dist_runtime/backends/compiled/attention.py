"""Attention of a few query rows over their keys, compiled: a decode step's (one row per session)
and a prefill chunk's when rows must be batch-invariant.  ``attention_rows`` is the entry; the
numba backend (``backends/numba.py``) binds Sdpa and SdpaWindow to it.

For the usual head sizes (:data:`HEAD_DIMS`, a compile-time choice with the path: :data:`SPECS`)
two vector cores do the work, each over all the heads of a block of 8 key (value) rows before the
next block, so that the rows stream from memory once, whole, in order, and stay in L1 while every
head uses them:

- :func:`scores`: a head's query stays in ``head_dim / 8`` vector registers; each key's 8 lanes
  are multiplied and added over ``head_dim`` in order, and the 8 keys' lanes are summed by one
  transposing tree that adds each key's lanes in exactly :func:`.simd.hsum`'s order
  (``((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))``), the order the last ``n mod 8`` keys use: a key's
  score is the same bits wherever it falls;
- :func:`weighted`: each head's ``head_dim`` sums, the value rows added in order.

numba's loops over a head's 64 elements (the other sizes': :func:`_attend_row`) pay a loop's
setup and a reduction per key and head and reload the accumulators for every value row: one query
row of 12 heads over 1024 keys takes 149-176 us in cache against 86-110 here.

A query row's keys are cut into pieces of :data:`SPLIT_KEYS`; each piece is attended alone (its
own softmax) and the pieces are merged by the sums of their exps (:func:`_merge`, as split-K
decoding does), so that threads share one row's keys while each reads whole K/V rows.  The pieces
are fixed by the row's keys alone, never by the threads; each head is one fixed sequence of
operations whatever the other rows or the threads: batch-invariant.  A row of at most
SPLIT_KEYS keys is one piece, whose values keep their bits through the merge.

A prompt's rows attend in groups (:data:`GROUP_ROWS`, one task per piece index: :func:`_tasks`):
the cores take several query rows, each block's K (V) rows widened from F16 or Q8_0 once into a
stack block that every head and row of its kv head reads (a decode step's one row reads them in
place: they stream from memory), each row's scores, softmax and sums its own
(:func:`_attend_task`).

numba's on-disk cache checks only the file of each jitted function: the drivers live here, beside
the intrinsics whose code they inline (a change to ``simd.py`` names a new cache: :mod:`.cache`).
"""

from __future__ import annotations

import functools
import math

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ...attention_pieces import GROUP_ROWS, PIECES, SPLIT_KEYS
from ...dtypes import DType
from ...kernels.quant import dequantize
from ...tensor import QuantizedArray
from . import ahead, cpu, launch, simd, spin
from .cache import jit

# Reassociation lets the reductions vectorise; no "nnan"/"ninf", so NaN and inf propagate as in
# numpy.  The numpy error model makes x / 0 an inf, not a ZeroDivisionError.
_jit = jit(nogil=True, boundscheck=False, error_model="numpy",
                  fastmath={"reassoc", "contract", "nsz", "arcp"})

#: Lanes of one vector (8 f32: one AVX2 register).
LANES = 8
#: The head sizes with compiled cores (each its own code); other sizes take numba's loops.
HEAD_DIMS = (8, 16, 24, 32, 40, 48, 64, 80, 96, 112, 128, 160, 192, 256)
#: The compile-time choice: (path, head_dim).
SPECS = simd.Choice((path, hd) for path in ("avx2", "portable") for hd in HEAD_DIMS)
_I64 = ir.IntType(64)


def _slice(context, builder, ty, array, row, offset):
    """A pointer to element ``offset`` of row ``row`` of the C-contiguous 2-D f32 ``array``."""
    arr = context.make_array(ty)(context, builder, array)
    width = cgutils.unpack_tuple(builder, arr.shape, 2)[1]
    return builder.gep(arr.data, [builder.add(builder.mul(row, width), offset)])


def _prefetch(builder, ptr, span):
    """A hint for each 64-byte line of the ``span`` bytes (a runtime value) at ``ptr``."""
    with cgutils.for_range_slice(builder, _I64(0), span, _I64(64)) as (at, _):
        simd.prefetch(builder, ptr, at, 3)


def _dot_lanes(builder, path, piece, qv):
    """The 8 lanes of ``row . q`` (lane j: the products of elements j, j + 8, ... added in order;
    ``piece(p)``: the row's elements ``8p ..``, widened exactly: :func:`_head`)."""
    acc = None
    for p, q in enumerate(qv):
        kv = piece(p)
        acc = builder.fmul(kv, q) if acc is None else simd.fma(builder, kv, q, acc, path)
    return acc


def _transpose_sum(builder, vectors):
    """Lane j of the result: the sum of ``vectors[j]``'s 8 lanes in :func:`.simd.hsum`'s order."""
    def pairs(vs, low, high):
        out = []
        for a, b in zip(vs[::2], vs[1::2]):
            mask = [ir.Constant(simd.vector(simd.I32, LANES), m) for m in (low, high)]
            out.append(builder.fadd(builder.shuffle_vector(a, b, mask[0]), builder.shuffle_vector(a, b, mask[1])))
        return out
    # Fed in the order 0 2 1 3 4 6 5 7, the three levels leave key j in lane j.
    vs = [vectors[i] for i in (0, 2, 1, 3, 4, 6, 5, 7)]
    vs = pairs(vs, [0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15])  # l_i + l_{i+4}
    vs = pairs(vs, [0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15])  # + the pair 2 apart
    return pairs(vs, [0, 2, 4, 6, 8, 10, 12, 14], [1, 3, 5, 7, 9, 11, 13, 15])[0]  # + the neighbour


def _blocks(builder, lo, hi):
    """The end of the whole blocks of 8 rows from ``lo`` (the rest, up to ``hi``, one by one)."""
    return builder.add(lo, builder.mul(builder.sdiv(builder.sub(hi, lo), _I64(LANES)), _I64(LANES)))


def _stored(ty) -> str:
    """The element format of a K or V array type: F32 rows, F16 ones (a KV cache kept in F16,
    passed as their uint16 bits) or Q8_0 ones (a KV cache kept in Q8_0, passed as their blocks'
    bytes, uint8 ``[T, W / 32 * 34]``)."""
    return {types.uint16: "f16", types.uint8: "q8_0"}.get(ty.dtype, "f32")


#: Q8_0's block: 32 values, an f16 ``d`` and 32 int8 codes (34 bytes).
Q8_BLOCK, Q8_BYTES = 32, 34


def _row_bytes(builder, fmt, kv_heads, hd):
    """Bytes of a K or V row of ``kv_heads`` heads of ``hd`` values stored as ``fmt``."""
    values = builder.mul(kv_heads, _I64(hd))
    if fmt == "q8_0":
        return builder.mul(builder.lshr(values, _I64(5)), _I64(Q8_BYTES))
    return builder.mul(values, _I64(4 if fmt == "f32" else 2))


def _head(context, builder, path, ty, array, row, g, hd):
    """``piece(p)``: values ``8p .. 8p + 7`` of kv head ``g`` of row ``row`` of K or V as
    ``<8 x float>``, exactly: F32 as stored, F16 widened, Q8_0 a code times its block's ``d``
    (a 7-bit code times an 11-bit significand fits f32's 24: exact, so the cores' bits over Q8_0
    rows are their bits over the same rows decoded to F32).  A piece of 8 never straddles a block
    of 32; a head of a multiple of 32 values starts on a block (its pieces' offsets constants),
    another head size's pieces find their block at run time.  Each block's ``d`` is read once."""
    fmt = _stored(ty)
    if fmt != "q8_0":
        ptr = _slice(context, builder, ty, array, row, builder.mul(g, _I64(hd)))
        return lambda p: simd.load(builder, builder.gep(ptr, [_I64(p * LANES)]), fmt, LANES, path)
    base = _slice(context, builder, ty, array, row, _I64(0))  # the row's first byte
    scales = {}

    def block_of(p):  # (the block's byte offset in the row, the piece's codes' offset in the block, a key)
        if hd % Q8_BLOCK == 0:
            at = builder.add(builder.mul(g, _I64(hd // Q8_BLOCK * Q8_BYTES)), _I64(p * LANES // Q8_BLOCK * Q8_BYTES))
            return at, _I64(2 + p * LANES % Q8_BLOCK), p * LANES // Q8_BLOCK
        e = builder.add(builder.mul(g, _I64(hd)), _I64(p * LANES))  # >= 0: shifts, not signed division
        return (builder.mul(builder.lshr(e, _I64(5)), _I64(Q8_BYTES)),
                builder.add(_I64(2), builder.and_(e, _I64(Q8_BLOCK - 1))), p)

    def piece(p):
        at, within, key = block_of(p)
        if key not in scales:
            d = simd.load(builder, builder.gep(base, [at]), "f16", 1, path)
            scales[key] = builder.shuffle_vector(d, d, ir.Constant(simd.vector(simd.I32, LANES), [0] * LANES))
        codes = builder.load(builder.bitcast(builder.gep(base, [builder.add(at, within)]),
                                             simd.vector(ir.IntType(8), LANES).as_pointer()), align=1)
        # A flag of its own, one that permits nothing here (no division), so that numba's
        # fast-math pass, which flags every unflagged float operation of a fast-math caller with
        # "reassoc", leaves this product alone: (code * d) * q reassociated to code * (d * q)
        # would round differently from the F32 cores over the decoded rows.
        return builder.fmul(builder.sitofp(codes, simd.vector(simd.F32, LANES)), scales[key], flags=("arcp",))
    return piece


def _block_rows(context, builder, path, ty, array, first, g, hd, scratch):
    """``rows[j](p)``: values ``8p ..`` of kv head ``g`` of row ``first + j`` of K or V, for the
    block's 8 rows (:func:`_head`): F32 rows read in place; F16 and Q8_0 rows widened once into
    ``scratch`` (``8 * hd`` floats on the stack), shared by every head and query row of the kv
    head -- each value as :func:`_head` gives it, so the same bits as reading it there.  Without
    ``scratch`` (one query row: a decode step's, whose K/V stream from memory) read in place."""
    if scratch is None or _stored(ty) == "f32":
        return [_head(context, builder, path, ty, array, builder.add(first, _I64(j)), g, hd) for j in range(LANES)]
    vec = simd.vector(simd.F32, LANES)
    pieces = hd // LANES
    for j in range(LANES):
        piece = _head(context, builder, path, ty, array, builder.add(first, _I64(j)), g, hd)
        for p in range(pieces):
            builder.store(piece(p), builder.gep(scratch, [_I64(0), _I64(j * pieces + p)]), align=32)
    return [functools.partial(lambda j, p: builder.load(builder.gep(scratch, [_I64(0), _I64(j * pieces + p)]),
                                                         align=32), j) for j in range(LANES)]


def _scratch_block(builder, ty, hd):
    """A stack block of 8 rows of ``hd`` floats for :func:`_block_rows`, for a call over several
    query rows (``ty``: their array's); None for one."""
    return cgutils.alloca_once(builder, ir.ArrayType(simd.vector(simd.F32, LANES), hd)) if ty.ndim == 2 else None


def _each_kv_head(builder, kv_heads, groups, per_kv, per_head):
    """``per_kv(g)`` for each kv head ``g``, then ``per_head(g, h, made)`` for each of its query
    heads ``h`` (``made``: what ``per_kv`` returned)."""
    with cgutils.for_range(builder, kv_heads) as kv:
        g = kv.index
        made = per_kv(g)
        with cgutils.for_range(builder, groups) as j:
            per_head(g, builder.add(builder.mul(g, groups), j.index), made)


def _prefetch_rows(context, builder, ty, array, first, count, kv_heads, hd):
    """Prefetch the ``kv_heads`` heads of rows ``first .. first + count - 1``."""
    span = _row_bytes(builder, _stored(ty), kv_heads, hd)
    for j in range(count):
        _prefetch(builder, _slice(context, builder, ty, array, builder.add(first, _I64(j)), _I64(0)), span)


def _prefetch_share(context, builder, ty, array, first, h, heads, kv_heads, hd):
    """Head ``h``'s share of the ``LANES`` rows from ``first``: rows ``8 h // heads`` up to
    ``8 (h + 1) // heads``, so that the heads of a block prefetch the block ahead a row or so at a
    time, every row once, rather than all of it at the block's start (:data:`AHEAD_K`)."""
    lo = builder.sdiv(builder.mul(h, _I64(LANES)), heads)
    hi = builder.sdiv(builder.mul(builder.add(h, _I64(1)), _I64(LANES)), heads)
    with cgutils.for_range_slice(builder, lo, hi, _I64(1)) as (j, _):
        _prefetch_rows(context, builder, ty, array, builder.add(first, j), 1, kv_heads, hd)


def _each_head(builder, kv_heads, groups, body):
    """``body(g, h)`` for each kv head ``g`` and each of its query heads ``h``."""
    with cgutils.for_range(builder, kv_heads) as kv:
        g = kv.index
        with cgutils.for_range(builder, groups) as j:
            body(g, builder.add(builder.mul(g, groups), j.index))


def _splat(builder, value):
    vec = simd.vector(simd.F32, LANES)
    one = builder.insert_element(ir.Constant(vec, ir.Undefined), value, _I64(0))
    return builder.shuffle_vector(one, ir.Constant(vec, ir.Undefined), ir.Constant(simd.vector(simd.I32, LANES), [0] * LANES))


def _rows_of(context, builder, ty, value):
    """``(data, rows, width)`` of the query rows ``q`` (or the sums ``out``) of :func:`scores` and
    :func:`weighted`: a 1-D array is one row; a 2-D one C-contiguous rows."""
    arr = context.make_array(ty)(context, builder, value)
    if ty.ndim == 1:
        return arr.data, _I64(1), _I64(0)
    rows, width = cgutils.unpack_tuple(builder, arr.shape, 2)
    return arr.data, rows, width


def _each_row(builder, rows, body):
    with cgutils.for_range(builder, rows) as r:
        body(r.index)


@intrinsic
def scores(typingctx, spec, q, kv_heads, groups, k, lo, hi, scale, out, ahead):
    """``out[r * heads + h, t - lo] = scale * (q[r, h*hd:(h+1)*hd] . k[t, g*hd:(g+1)*hd])`` for
    every query row ``r``, head ``h`` (on kv head ``g = h // groups``) and ``lo <= t < hi`` (``q``
    f32, one row 1-D or C-contiguous rows 2-D; ``k``, ``out`` C-contiguous 2-D f32, or ``k`` the
    uint16 bits of F16 keys or the bytes of Q8_0 rows, read exactly (:func:`_head`); ``hd`` from
    ``spec``).  Blocks of 8 key rows in order, all heads and query rows on a block before the
    next: the rows stream from memory once, whole, in order, and stay in L1 while the heads and
    rows use them (rows of a prompt share each key row's trip from memory); each block's heads
    prefetch the rows ``ahead`` of it, a share each.  A score's bits are its row's, alone."""
    sig = types.void(spec, q, types.intp, types.intp, k, types.intp, types.intp, types.float32, out, types.intp)
    return sig, functools.partial(_scores_codegen, *SPECS.of(spec))


def _scores_codegen(path, hd, context, builder, sig, args):
    _, q, kv_heads, groups, k, lo, hi, scale, out, ahead = args
    qbase, nrows, width = _rows_of(context, builder, sig.args[1], q)
    kty, oty = sig.args[4], sig.args[8]
    scales = _splat(builder, scale)
    vec = simd.vector(simd.F32, LANES)
    heads = builder.mul(kv_heads, groups)

    def query(r, h):
        qp = builder.gep(qbase, [builder.add(builder.mul(r, width), builder.mul(h, _I64(hd)))])
        return [simd.load(builder, builder.gep(qp, [_I64(p * LANES)]), "f32", LANES, path) for p in range(hd // LANES)]

    def score_row(r, h):
        return builder.add(builder.mul(r, heads), h)

    blocked = _blocks(builder, lo, hi)
    scratch = _scratch_block(builder, sig.args[1], hd)
    with cgutils.for_range_slice(builder, lo, blocked, _I64(LANES)) as (t, _):
        def block(g, h, keys):
            _prefetch_share(context, builder, kty, k, builder.add(t, ahead), h, heads, kv_heads, hd)

            def row(r):
                qv = query(r, h)
                lanes = [_dot_lanes(builder, path, key, qv) for key in keys]
                dots = builder.fmul(_transpose_sum(builder, lanes), scales)
                at = _slice(context, builder, oty, out, score_row(r, h), builder.sub(t, lo))
                builder.store(dots, builder.bitcast(at, vec.as_pointer()), align=4)
            _each_row(builder, nrows, row)
        _each_kv_head(builder, kv_heads, groups, lambda g: _block_rows(context, builder, path, kty, k, t, g, hd, scratch),
                      block)
    with cgutils.for_range_slice(builder, blocked, hi, _I64(1)) as (t, _):
        def one(g, h):
            def row(r):
                key = _head(context, builder, path, kty, k, t, g, hd)
                dot = simd.hsum(builder, _dot_lanes(builder, path, key, query(r, h)))
                builder.store(builder.fmul(dot, scale),
                              _slice(context, builder, oty, out, score_row(r, h), builder.sub(t, lo)))
            _each_row(builder, nrows, row)
        _each_head(builder, kv_heads, groups, one)
    return context.get_dummy_value()


@intrinsic
def weighted(typingctx, spec, p, kv_heads, groups, v, base, lo, hi, out, ahead):
    """``out[r, h*hd:(h+1)*hd] += sum over lo <= t < hi, in order, of p[r * heads + h, t - base] *
    v[t, g*hd:(g+1)*hd]`` for every row ``r`` of ``out`` and head ``h`` (on kv head ``g = h //
    groups``; ``out`` f32, one row 1-D or C-contiguous rows 2-D, holding each head's sums so far;
    ``p``, ``v`` C-contiguous 2-D f32, or ``v`` the uint16 bits of F16 values or the bytes of Q8_0
    rows, read exactly (:func:`_head`); ``hd`` from ``spec``).  Blocks of 8 value rows in order,
    all heads and rows on a block before the next (as :func:`scores`); each head's sums wait in
    ``out`` between blocks, and between calls: a row's keys may come in several calls, in order,
    for the same bits as one."""
    sig = types.void(spec, p, types.intp, types.intp, v, types.intp, types.intp, types.intp, out, types.intp)
    return sig, functools.partial(_weighted_codegen, *SPECS.of(spec))


def _weighted_codegen(path, hd, context, builder, sig, args):
    _, p, kv_heads, groups, v, base, lo, hi, out, ahead = args
    pty, vty = sig.args[1], sig.args[4]
    obase, nrows, width = _rows_of(context, builder, sig.args[8], out)
    vec = simd.vector(simd.F32, LANES)
    pieces = hd // LANES
    heads = builder.mul(kv_heads, groups)

    def sums(r, h):
        at = builder.gep(obase, [builder.add(builder.mul(r, width), builder.mul(h, _I64(hd)))])
        return [builder.bitcast(builder.gep(at, [_I64(i * LANES)]), vec.as_pointer()) for i in range(pieces)]

    scratch = _scratch_block(builder, sig.args[8], hd)

    def rows(first, count):
        """Rows ``first .. first + count - 1`` (``count`` a constant) into every head's sums."""
        if count != LANES:
            _prefetch_rows(context, builder, vty, v, builder.add(first, ahead), count, kv_heads, hd)

        def values(g):
            if count == LANES:
                return _block_rows(context, builder, path, vty, v, first, g, hd, scratch)
            return [_head(context, builder, path, vty, v, builder.add(first, _I64(j)), g, hd) for j in range(count)]

        def head(g, h, rows_of_v):
            if count == LANES:
                _prefetch_share(context, builder, vty, v, builder.add(first, ahead), h, heads, kv_heads, hd)

            def row(r):
                ptrs = sums(r, h)
                accs = [builder.load(ptr, align=4) for ptr in ptrs]
                for j, piece in enumerate(rows_of_v):
                    t = builder.add(first, _I64(j))
                    w = _splat(builder, builder.load(_slice(context, builder, pty, p, builder.add(builder.mul(r, heads), h),
                                                            builder.sub(t, base))))
                    accs = [simd.fma(builder, piece(i), w, acc, path) for i, acc in enumerate(accs)]
                for ptr, acc in zip(ptrs, accs):
                    builder.store(acc, ptr, align=4)
            _each_row(builder, nrows, row)
        _each_kv_head(builder, kv_heads, groups, values, head)

    blocked = _blocks(builder, lo, hi)
    with cgutils.for_range_slice(builder, lo, blocked, _I64(LANES)) as (t, _):
        rows(t, LANES)
    with cgutils.for_range_slice(builder, blocked, hi, _I64(1)) as (t, _):
        rows(t, 1)
    return context.get_dummy_value()


# exp's argument reduction (x - n * ln2 in two parts) must not be reassociated: no fast-math
# beyond fusing a multiply-add, which keeps it one fixed sequence of operations.
_exact = jit(nogil=True, boundscheck=False, error_model="numpy", fastmath={"contract"})

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
#: walk rows of a few hundred bytes to a few KB, which the hardware prefetcher alone leaves waiting
#: on memory once the cache no longer holds all the layers' K and V.
AHEAD_ROWS = 4
#: Rows ahead of a block that the vector cores prefetch, whole (a block ahead; 0, 16, 32 and 64
#: measured no faster at 1024 keys, and 32-64 slower in cache).  Each head of a block prefetches
#: its share of those rows (:func:`_prefetch_share`): the whole block's 128 hints at its start leave
#: one query row over 1025 keys from memory (AMD EPYC, one process, interleaved) at 1.32-1.39x the
#: time, each pass reading ~6 GB/s a thread where a product streams 20-28; 16 rows ahead is no
#: different with the shares.
AHEAD_K = 8
#: Below this many K/V bytes read (times query rows), attention runs on the calling thread.
SERIAL_KV_BYTES = 1 << 18
# How a row's keys are cut into pieces (merged by :func:`_merge`) and what that takes in memory:
# dist_runtime/attention_pieces.py, which the partitioner's costs read too.


@_jit
def _attend_row(q, k, v, lo, hi, kv_heads, groups, head_dim, scale, scores, bits, out):
    """One query row ``q [heads * head_dim]`` (head ``h`` on kv head ``h // groups``):
    ``out[h] = softmax(K_h @ q[h] * scale) @ V_h`` over key rows ``[lo, hi)``, in numba's loops
    (a head size without compiled cores: :data:`HEAD_DIMS`).

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
    _softmax_rows(scores, 0, n, bits, np.empty((2, scores.shape[0]), np.float32))
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
def _above(x, m):
    return x if x > m else m


@_jit
def _max(s, n, lanes):
    """The largest of ``s[:n]`` (a NaN among them is passed over: it makes its own exp NaN, and so
    the whole softmax).  Over 8 lanes, then across them: a max is exact in any order, and the lanes
    vectorise where a running ``max()`` does not (2.5 us against 12.5 for 12 heads x 1024 keys)."""
    whole = n // LANES * LANES
    lanes[:] = -np.inf
    for t in range(0, whole, LANES):
        for j in range(LANES):
            lanes[j] = _above(s[t + j], lanes[j])
    m = np.float32(-np.inf)
    for j in range(LANES):
        m = _above(lanes[j], m)
    for t in range(whole, n):
        m = _above(s[t], m)
    return m


@_jit
def _softmax_rows(scores, off, n, bits, stats):
    """``scores[h, off:off + n]`` replaced by its softmax, for each head ``h``; its max and the sum
    of its exps go to ``stats[0, h]`` and ``stats[1, h]`` (what :func:`_merge` weighs by).  A row of
    a prompt's scores begins at its own ``off`` (:func:`_attend_task`); a C-contiguous slice each,
    compiled as one code whatever the offset: a row's bits as alone."""
    lanes = np.empty(LANES, np.float32)
    for h in range(scores.shape[0]):
        sh = scores[h][off:off + n]
        m = _max(sh, n, lanes)
        _exp_shifted(sh, m, n, bits)
        total = np.float32(0.0)
        for t in range(n):
            total += sh[t]
        inv = np.float32(1.0) / total
        for t in range(n):
            sh[t] *= inv
        stats[0, h], stats[1, h] = m, total


@_jit
def _row_keys(r, tq, tk, causal, window):
    """The keys ``[lo, hi)`` query row ``r`` sees (see :func:`_attention_rows`)."""
    at = r + tk - tq
    lo, hi = 0, tk
    if causal:
        hi = at + 1
    if window > 0:
        lo = max(0, at - window + 1)
        if not causal:
            hi = min(tk, at + window)
    return lo, hi


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
        lo, hi = _row_keys(r, tq, tk, causal, window)
        _attend_row(q[r], k, v, lo, hi, kv_heads, num_heads // kv_heads, head_dim, scale, scores, bits, out[r])


@_jit
def _pieces(tq, tk, causal, window):
    """Where each query row's pieces start among the tasks: row ``r`` has tasks ``starts[r] ..
    starts[r + 1] - 1``: one if it sees at most :data:`SPLIT_KEYS` keys, else a multiple of
    :data:`PIECES` of at most SPLIT_KEYS each, of equal sizes (to within one key)."""
    starts = np.empty(tq + 1, np.int64)
    starts[0] = 0
    for r in range(tq):
        lo, hi = _row_keys(r, tq, tk, causal, window)
        n = hi - lo
        # attention_pieces.pieces_of_row, compiled (tests/test_partitioner_graph.py checks they agree)
        starts[r + 1] = starts[r] + (1 if n <= SPLIT_KEYS else -(-n // (SPLIT_KEYS * PIECES)) * PIECES)
    return starts


@_jit
def _scratch(tq, tk, causal, window, num_heads, head_dim):
    """The pieces' starts (:func:`_pieces`) and what each piece leaves for :func:`_merge`."""
    starts = _pieces(tq, tk, causal, window)
    return (starts, np.empty((starts[-1], num_heads * head_dim), np.float32),
            np.empty((starts[-1], 2, num_heads), np.float32))


@_jit
def _tasks(starts):
    """The attention's tasks, ``(first row, rows, piece j)`` each: consecutive query rows with the
    same number of pieces (:func:`_pieces`) in groups of up to :data:`GROUP_ROWS`, each group once
    per piece index.  Fixed by the rows' keys: a row's bits do not depend on its group."""
    tq = starts.shape[0] - 1
    tasks = np.empty((starts[-1], 3), np.int64)  # at most one a piece
    n, r = 0, 0
    while r < tq:
        count = starts[r + 1] - starts[r]
        end = r + 1
        while end < tq and end - r < GROUP_ROWS and starts[end + 1] - starts[end] == count:
            end += 1
        for j in range(count):
            tasks[n, 0], tasks[n, 1], tasks[n, 2] = r, end - r, j
            n += 1
        r = end
    return tasks[:n]


@_jit
def _piece_keys(r, j, tq, tk, causal, window, starts):
    """Piece ``j`` of query row ``r``: its keys ``[a, b)``, equal parts of the row's."""
    lo, hi = _row_keys(r, tq, tk, causal, window)
    count = starts[r + 1] - starts[r]
    return lo + j * (hi - lo) // count, lo + (j + 1) * (hi - lo) // count


@_jit
def _attend_task(spec, q, k, v, num_heads, kv_heads, head_dim, causal, window, starts, tasks, task, sums, stats):
    """Task ``task`` (:func:`_tasks`): piece ``j`` of rows ``r0 ..`` on the compiled cores
    (``spec``: the head size's), every head: each row's softmax-weighted values into
    ``sums[its piece]``, each head's max and sum of exps into ``stats[its piece]``.  The rows'
    scores over the union of their keys in one pass; each row's softmax over its own; its
    weighted values over its own keys in order -- those of every row in one pass, the rest alone
    before and after (:func:`weighted` keeps the sums between calls): each row's bits as alone."""
    r0, rows, j = tasks[task, 0], tasks[task, 1], tasks[task, 2]
    tq, tk, groups = q.shape[0], k.shape[0], num_heads // kv_heads
    a, b = np.empty(rows, np.int64), np.empty(rows, np.int64)
    for i in range(rows):
        a[i], b[i] = _piece_keys(r0 + i, j, tq, tk, causal, window, starts)
    first, last = a.min(), b.max()
    scale = np.float32(1.0 / math.sqrt(head_dim))
    probs = np.empty((rows * num_heads, last - first), np.float32)  # the scores, then each row's softmax
    bits = np.empty(last - first, np.int32)
    if rows == 1:
        scores(spec, q[r0], kv_heads, groups, k, first, last, scale, probs, AHEAD_K)
    else:
        scores(spec, q[r0:r0 + rows], kv_heads, groups, k, first, last, scale, probs, AHEAD_K)
    for i in range(rows):
        _softmax_rows(probs[i * num_heads:(i + 1) * num_heads], a[i] - first, b[i] - a[i], bits,
                      stats[starts[r0 + i] + j])
    if rows == 1:  # a decode step's piece: straight into its sums
        out = sums[starts[r0] + j]
        out[:] = 0.0
        weighted(spec, probs, kv_heads, groups, v, first, a[0], b[0], out, AHEAD_K)
        return
    acc = np.zeros((rows, num_heads * head_dim), np.float32)
    shared_lo, shared_hi = a.max(), b.min()
    if shared_lo >= shared_hi:  # no key every row sees: each row alone
        shared_lo = shared_hi = last
    for i in range(rows):
        weighted(spec, probs[i * num_heads:(i + 1) * num_heads], kv_heads, groups, v, first, a[i],
                 min(shared_lo, b[i]), acc[i], AHEAD_K)
    weighted(spec, probs, kv_heads, groups, v, first, shared_lo, shared_hi, acc, AHEAD_K)
    for i in range(rows):
        weighted(spec, probs[i * num_heads:(i + 1) * num_heads], kv_heads, groups, v, first,
                 min(max(shared_hi, a[i]), b[i]), b[i], acc[i], AHEAD_K)
        sums[starts[r0 + i] + j] = acc[i]


@_exact  # no reciprocal approximation: a lone piece's share is exactly 1
def _merge(starts, sums, stats, num_heads, head_dim, out):
    """Each query row's pieces as one softmax over all its keys: piece ``p``'s weighted values
    times its share ``w_p / sum(w)`` of the exps, ``w_p = sum_p * exp(max_p - max)``, added in
    piece order.  A row of one piece keeps its values' bits (its share is exactly 1)."""
    weights = np.empty(starts[-1], np.float32)
    for r in range(len(starts) - 1):
        p0, p1 = starts[r], starts[r + 1]
        for h in range(num_heads):
            m = stats[p0, 0, h]
            for p in range(p0 + 1, p1):
                m = _above(stats[p, 0, h], m)
            total = np.float32(0.0)
            for p in range(p0, p1):
                weights[p] = stats[p, 1, h] * np.exp(stats[p, 0, h] - m)
                total += weights[p]
            o, at = out[r], h * head_dim
            share = weights[p0] / total
            for i in range(head_dim):
                o[at + i] = share * sums[p0, at + i]
            for p in range(p0 + 1, p1):
                share = weights[p] / total
                for i in range(head_dim):
                    o[at + i] += share * sums[p, at + i]


@_jit
def _attention_serial(spec, q, k, v, num_heads, kv_heads, head_dim, causal, window, out):
    starts, sums, stats = _scratch(q.shape[0], k.shape[0], causal, window, num_heads, head_dim)
    tasks = _tasks(starts)
    for task in range(tasks.shape[0]):
        _attend_task(spec, q, k, v, num_heads, kv_heads, head_dim, causal, window, starts, tasks, task, sums, stats)
    _merge(starts, sums, stats, num_heads, head_dim, out)


@_jit
def _attend_tasks(spec, q, k, v, num_heads, kv_heads, head_dim, causal, window, starts, tasks, sums, stats, counter,
                  threads):
    """One of ``threads`` threads' share of :func:`_attention_threaded`: a contiguous run of the
    tasks, the ``counter[0]``-th of ``threads`` (as ``prange`` hands them out: each thread reads
    its own stretch of the keys; each task writes its own pieces' results, the same bits on any
    thread)."""
    me, count = spin.fetch_add(counter, 0), tasks.shape[0]
    for task in range(me * count // threads, (me + 1) * count // threads):
        _attend_task(spec, q, k, v, num_heads, kv_heads, head_dim, causal, window, starts, tasks, task, sums, stats)


def _attention_threaded(spec, q, k, v, num_heads, kv_heads, head_dim, causal, window, out):
    """The pieces over the threads (:func:`_attend_tasks` on each, called by its address:
    :mod:`.launch`).  Pieces of keys, not parts of the kv heads: two threads reading alternate
    halves of each row of K read 9-15 GB/s here, against 27-30 for halves of the rows (each core's
    prefetcher fetches the other's lines too), and one row over 1024 keys split by kv heads takes
    146-151 us on two threads from memory, 157-185 on one; in pieces 90-97."""
    starts, sums, stats = _scratch(q.shape[0], k.shape[0], causal, window, num_heads, head_dim)
    tasks = _tasks(starts)
    threads = max(1, min(numba.get_num_threads(), tasks.shape[0]))
    args = (spec, q, k, v, num_heads, kv_heads, head_dim, causal, window, starts, tasks, sums, stats,
            np.zeros(1, np.int64), threads)
    launch.run(_attend_tasks, args, threads)
    _merge(starts, sums, stats, num_heads, head_dim, out)


def _compiled(given: tuple) -> list:
    """What :func:`attention_rows` runs for argument types ``given`` (those of
    :func:`_attention_serial`), as ``(dispatcher, signature)``: the serial driver, the threaded
    one's worker and its launch."""
    scratch = (types.int64[::1], types.int64[:, ::1], types.float32[:, ::1], types.float32[:, :, ::1], types.int64[::1],
               types.int64)
    worker = (*given[:9], *scratch)
    return [(_attention_serial, given), (_attend_tasks, worker), (launch._launch, launch.signature(worker, types.int64))]


_WARM: set[int] = set()


def warm(head_dim: int) -> None:
    """Compile (or load from numba's cache) both drivers of ``head_dim`` for a KV cache's read-only
    keys and values now, once a process.  The numba backend's attention kernels call it on their
    first call, so that the threaded driver, which first runs only when a context passes
    SERIAL_KV_BYTES, does not stall a stream for seconds mid-generation; a model whose attention
    the compiled program runs (its own pieces) never calls them and compiles neither.  Writable K/V
    (an encoder's, whole sequences in one call) compile on first use.  Where compiling ahead is
    enabled (:mod:`.ahead`), a child compiles them into the cache instead."""
    if head_dim in _WARM or head_dim not in HEAD_DIMS:
        return
    _WARM.add(head_dim)
    spec = SPECS((cpu.PATH, head_dim))
    q = np.zeros((1, head_dim), np.float32)
    out = np.empty_like(q)
    kv = q.copy()
    kv.flags.writeable = False  # as a KV cache hands them out: numba compiles read-only arrays apart
    args = (spec, q, kv, kv, 1, 1, head_dim, True, 0, out)
    if ahead.enabled():  # in a child, not holding up this process's first pass
        given = tuple(numba.typeof(a) for a in args)
        if not all(ahead.load(f, signature) is not None for f, signature in _compiled(given)):
            ahead.running(__name__, [ahead.describe(t) for t in given])
        return
    _attention_serial(*args)
    _attention_threaded(*args)


def compile_ahead(described: list) -> None:
    """The child's part of :func:`warm` (:func:`.ahead.main`)."""
    for f, signature in _compiled(tuple(ahead.rebuild(t) for t in described)):
        f.compile(signature)


def attention_rows(q, k, v, num_heads: int, kv_heads: int, head_dim: int, causal: bool, window: int,
                   out: np.ndarray) -> None:
    """Softmax attention of ``q [Tq, heads * head_dim]`` over ``k``, ``v [Tk, kv_heads *
    head_dim]`` into ``out`` (C-contiguous rows; ``q``, ``out`` f32, ``k``, ``v`` both f32 or both
    f16, a KV cache kept in F16): on the compiled cores for the head sizes that have them (their
    pieces threaded from :data:`SERIAL_KV_BYTES` of K/V reads; F16 rows widened exactly as they
    are read, so the result is the bits of the same keys and values given as F32), else numba's
    loops (F16 rows widened first).  ``k``, ``v`` may be Q8_0 :class:`QuantizedArray` s (a KV
    cache kept in Q8_0): the cores read their blocks in place, the bits of the same rows decoded
    (:func:`_head`); a head size without cores decodes them first (exactly)."""
    if isinstance(k, QuantizedArray):
        if head_dim in HEAD_DIMS and k.dtype == v.dtype == DType.Q8_0 and k.shape[-1] % Q8_BLOCK == 0:
            k, v = k.data, v.data
        else:
            k, v = dequantize(k), dequantize(v)
    half = k.dtype == np.float16
    if head_dim not in HEAD_DIMS:
        if half:
            k, v = k.astype(np.float32), v.astype(np.float32)
        _attention_rows(q, k, v, num_heads, kv_heads, head_dim, causal, window, out)
        return
    if half:
        k, v = k.view(np.uint16), v.view(np.uint16)
    spec = SPECS((cpu.PATH, head_dim))
    if serial(q.shape[0], k.shape[0], k.nbytes):
        _attention_serial(spec, q, k, v, num_heads, kv_heads, head_dim, causal, window, out)
    else:
        _attention_threaded(spec, q, k, v, num_heads, kv_heads, head_dim, causal, window, out)


def serial(query_rows: int, keys: int, k_bytes: int) -> bool:
    """Whether :func:`attention_rows` attends on the calling thread (:func:`attention_serial`):
    :func:`serial_on` with this thread's number of threads."""
    return serial_on(query_rows, keys, k_bytes, numba.get_num_threads())


@jit(nogil=True)
def serial_on(query_rows, keys, k_bytes, threads):
    """:func:`serial`'s rule, for compiled callers too (the executor's program: numba cannot
    cache compiled code that asks for the number of threads): one thread, a decode step's one
    piece, or under :data:`SERIAL_KV_BYTES` of K/V reads.  The same bits either way: only the
    speed depends on it."""
    return threads == 1 or (query_rows == 1 and keys <= SPLIT_KEYS) or query_rows * k_bytes * 2 < SERIAL_KV_BYTES


#: :func:`attention_rows`' serial driver, for compiled callers (the numba backend's attention
#: chain): ``attention_serial(SPECS((cpu.PATH, head_dim)), q, k, v, num_heads, kv_heads,
#: head_dim, causal, window, out)``, a head size of :data:`HEAD_DIMS`.
attention_serial = _attention_serial
