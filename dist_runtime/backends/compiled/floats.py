"""The F32, F16, BF16 (and Q8_0, f32 activations) kernels: ``x [M, K] @ W[N, K]^T`` read from the
stored weight in place.  A Q8_0 element, ``code * d``, is exact in f32, so its products are F32's
on the dequantized weight, bit for bit (:func:`_weight_access`).

The work is cut into tiles of ``rows`` rows of ``x`` by ``cols`` rows of ``W``: a tile loads each
8-element piece of its weight rows once, widens it to f32 in registers (F16, BF16) and multiplies
it into the ``rows x cols`` vector accumulators.  Threads take chunks of :data:`CHUNK` weight rows;
a chunk walks ``K`` in spans of :data:`SPAN` and, within a span, takes :data:`ROWS` rows of ``x``
at a time (8 where the CPU has 32 vector registers, else 4, by :data:`COLS` weight rows, or the
format's own :data:`TILES`; then a half tile, then one: :func:`_shape`) against
all its weight rows, so the span of its weight rows stays in L1 while every row of ``x`` uses it:
the weight comes from memory once per call whatever ``M``, and each row of ``x`` from L2 once per
chunk.  Between spans the accumulators wait in a scratch array.  When ``x`` takes at most two tiles
of rows (a step of 8 rows is one) the chunk walks all of ``K`` at once.  Each tile prefetches its
weight rows ahead of its loads, into L1 and, further ahead, into L2 (:data:`.simd.PREFETCH_NEAR`,
:data:`.simd.PREFETCH_FAR`), or, after a chunk's first pass over them, the next chunk's rows
(:data:`_TILE_AHEAD`), except a lone row of ``x`` on F32, which takes the far hint alone
and only on rows of 16 KB or more, else leaves it to the hardware (:data:`LONE_FAR_K`; measured in
the notes on the prefetch below); where the CPU has 16 vector registers, a lone F32 row takes four
weight rows at a time with no hint (:data:`LONE_COLS`).

Batch invariance: every output ``(m, n)`` is the same sequence of operations in every tile shape,
span, thread and position: 8 lanes, lane ``j`` a chain of multiply-adds over ``k = j, j + 8, ...``
in order (stored and reloaded exactly between spans), the lanes summed pairwise
(:func:`simd.hsum`), then the last ``K mod 8`` products in order.  Tiles differ only in how many
independent chains run side by side; the prefetches are hints, and the loop over a line's pieces
runs them in the same order as one at a time.
"""

from __future__ import annotations

import functools

import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ...dtypes import DType
from . import cpu, simd
from .cache import jit
from .registry import FLOATS, Drivers, Route, joint_slots, run, serial

#: Lanes of one multiply-add (8 f32 = one AVX2 register).
LANES = 8
#: Rows of ``x`` and of ``W`` per tile.  With 16 vector registers (AVX2), 4 x 3 accumulators, the
#: 3 loaded weight pieces and one piece of ``x`` fill them (measured 12-15% faster than 4 x 2 at
#: M = 4..64).  With 32 (AVX-512VL), 8 x 3: a step of 8 rows is one tile, every weight piece loaded
#: once for all 8 (the 125M model's products at M = 8, 2 threads, with the prefetch below: 39.6 ms
#: against 42.3 for 4 x 3 and 42.3 for 8 x 2, in one run on the busy machine).
ROWS, COLS = (8, 3) if cpu.REGISTERS >= 32 else (4, 3)
#: A format's tile, ``(rows, cols)``, where it is not ``(ROWS, COLS)``.  Q8_0 on 16 registers:
#: 4 x 2.  A 4 x 3 tile keeps three broadcast scales ``d`` and three decoded pieces beside the 12
#: accumulators, 19 registers, and LLVM spills accumulators to the stack inside the loop; 4 x 2
#: needs 13.  AMD EPYC (Zen 3, AVX2), the 125M model's products (chains of its Q8_0 weights from
#: memory, two threads, medians of 15 interleaved rounds) against 8 x 1 (8 accumulators, each
#: piece decoded once for 8 rows): 4 x 2 0.84x / 0.90x / 0.92x the time at M = 4 / 8 / 16, 4 x 3
#: 1.10x / 1.14x / 1.18x.
TILES = {"q8_0": (4, 2)} if cpu.REGISTERS < 32 else {}
#: Weight rows a lone row of ``x`` (``M`` = 1, and the last ``M mod ROWS``) takes at a time, per
#: stored format: F32 one, so that each thread reads its weight as one sequential stream; F16 and
#: BF16 two, whose two chains of multiply-adds keep pace with half the bytes a piece.  Several
#: weight rows read as many streams a few KB apart, which an AMD EPYC (Zen 4, AVX-512, 2 threads)
#: fetches slower: in a C test of plain 8-lane chains, 2048 x 768 f32 weights from memory, 1 row
#: at a time 25-35 GB/s, 2 rows 16, 4-6 rows 18-20.  Here, in one process, from memory: F32 one
#: row against 2 or 3 takes 0.93-0.95x the time at 2048 x 768, no different at 4096 x 4096 (against
#: 6, the 125M model's f32 decode step 0.89-0.91x).  F16 / BF16 two rows against one: 0.78-0.79x
#: / 0.67-0.70x at 4096 x 4096, 0.78x / 0.95x at 2048 x 768 (one row is a single chain, 4 cycles a
#: piece: 16 bytes of F16, half F32's).  Q8_0 four: a piece's decoding (widen, convert, scale) and
#: multiply-add sit on one chain, so one row at a time leaves a lone row compute-bound (in cache,
#: 768 x 2048, two threads: four rows 0.81x the time of the per-block formula, :mod:`.legacy`'s;
#: two rows no faster than it).  Where the CPU has 16 vector registers, F32 takes four too, with
#: no prefetch hint: on an AMD EPYC (Zen 3, AVX2), two threads, chains of weights from memory,
#: medians of 11 interleaved rounds, four rows against one: 4096 x 4096 0.84-0.86x the time (24-26
#: GB/s against 30-31), the 125M model's products 0.98-1.02x; two rows 0.86x / 1.08-1.10x; four
#: with both prefetch hints 0.86x / 1.06x.
LONE_COLS = {"f32": 1 if cpu.REGISTERS >= 32 else 4, "f16": 2, "bf16": 2, "q8_0": 4}
#: Weight rows per thread task: a multiple of ``COLS`` and of :data:`LONE_COLS`.
CHUNK = 12
#: Elements of ``K`` per span when ``M`` > ``ROWS`` (one span, all of ``K``, when a single tile of
#: rows covers ``x``: nothing to reuse): the span of a chunk's weight rows (12 KB in f32) and of a
#: tile's rows of ``x`` stay in L1 while every row of ``x`` passes.
SPAN = 256
#: A tile prefetches each of its weight rows (``llvm.prefetch``, once per 64-byte line)
#: :data:`.simd.PREFETCH_NEAR` bytes ahead into L1 and :data:`.simd.PREFETCH_FAR` into L2: the
#: hardware prefetcher alone leaves the multiply-adds waiting on memory once ``M`` > 1.  The 125M
#: model's products (2 threads, medians of 9-11 interleaved rounds, M = 1 / M = 8 in ms): both
#: hints once per line 15.62 / 17.29, against 16.74 / 25.68 with none, 16.94 / 22.06 with the near
#: one alone, and 16.42 / 17.85 hinting once per 8-element piece (which costs an L1-resident M = 1
#: product 20%, once per line 4-12%); in another run, far alone 18.51 at M = 8 against 18.11 for
#: both.  A lone row of ``x`` on F32, one sequential stream (:data:`LONE_COLS`), takes neither on
#: rows under 16 KB (:data:`LONE_FAR_K`: on longer rows the far one alone), as llama.cpp's
#: ``ggml_vec_dot_f32`` does: without the near one the 125M model's f32 decode step takes
#: 0.94-0.96x the time (one process, 14-20 rounds alternating which goes first; the products of a
#: chain of weights back to back, no small ops between, 0.99x: the hint costs in the step's
#: context).  F16 and BF16, whose chains take longer a byte, keep both (without the far one, in
#: pairs of rows: 1.4-1.9x the time).


#: A lone F32 row of ``x`` prefetches its weight rows :data:`.simd.PREFETCH_FAR` ahead (into L2,
#: no near hint) where a weight row holds at least that many bytes (``K`` >= 4096), so that the
#: hint lands in the row being read or the next; on shorter rows it leaves the prefetch to the
#: hardware.  Chains of distinct weights from memory, two threads, far hint against none (time,
#: two runs of 10 interleaved rounds): 4096 x 4096 0.96x / 0.96x, Llama-7B's MLP pair 11008 x 4096
#: and 4096 x 11008 0.90x / 0.94x, while the 125M model's 2048 x 768 and 768 x 2048 take 1.10x /
#: 1.08x (hints 16 KB ahead there land 5-20 rows on, past a chunk's end).
LONE_FAR_K = simd.PREFETCH_FAR // 4


#: The kernels' compile-time choice: (weight format, path) -- each pair its own compiled code.
SPECS = simd.Choice((fmt, path) for fmt in ("f32", "f16", "bf16", "q8_0") for path in ("avx2", "portable"))

#: Q8_0's block: an f16 scale ``d`` and 32 int8 codes (34 bytes); an element is ``code * d``.
Q8_BLOCK, Q8_BYTES = 32, 34


def _shape(fmt: str) -> tuple[int, int, int]:
    """``(rows, cols, half)`` of ``fmt``'s tiles (:data:`ROWS` x :data:`COLS` or its :data:`TILES`),
    ``half`` the rows of ``x`` in the tile for a remainder of ``M mod rows`` >= ``half``: tiles of 8
    rows have one of 4, so that M = 4..7 still share each weight piece among 4 rows; tiles of 4
    none (0)."""
    rows, cols = TILES.get(fmt, (ROWS, COLS))
    return rows, cols, rows // 2 if rows >= 8 else 0


def _tile(rows: int | str, cols: int | str, far_only: bool = False, ahead: bool = False):
    """The intrinsic ``tile(spec, x, w, out, acc, m0, n0, lo, n, k, k0, k1)`` for the products of
    rows ``m0 + r`` of ``x`` and ``n0 + c`` of ``W`` (``r < rows``, ``c < cols``, each a number or
    the format's own: ``"rows"`` / ``"half"`` / ``"cols"``, :func:`_shape`; arrays flat,
    ``spec`` :data:`SPECS`'s argument for (weight format, :data:`cpu.PATH`)): their lanes, kept in
    ``acc[m, n - lo]`` (``[M, CHUNK, LANES]``), take ``k0 <= k < k1``; once ``k1`` is the last
    multiple of 8, the lanes are summed, the ``K mod 8`` last products added and ``out`` written.
    One intrinsic per shape: numba keys an intrinsic's code by its argument types, which a shape
    passed as an argument would not change.  ``far_only``: a lone F32 row of ``x`` that prefetches
    its weight row far ahead (:data:`LONE_FAR_K`), not near.  ``ahead``: instead of its own rows'
    lines, each loop turn hints the same line of the rows :data:`CHUNK` further on (the next
    chunk's) into L2 (:data:`_TILE_AHEAD`)."""
    @intrinsic
    def tile(typingctx, spec, x, w, out, acc, m0, n0, lo, n, k, k0, k1):
        fmt, path = SPECS.of(spec)
        full, wide, half = _shape(fmt)
        shape = {"rows": full, "half": max(half, 1)}.get(rows, rows), wide if cols == "cols" else cols
        return (types.void(spec, x, w, out, acc, *[types.intp] * 7),
                functools.partial(_codegen, fmt, path, *shape, far_only, ahead))
    return tile


def _codegen(fmt, path, rows, cols, far_only, ahead, context, builder, sig, args):
    """The IR of one tile (see :func:`_tile`)."""
    x, w, out, acc = (context.make_array(t)(context, builder, a).data for t, a in zip(sig.args[1:5], args[1:5]))
    m0, n0, lo, n, k, k0, k1 = args[5:12]
    i64 = ir.IntType(64)

    def at(ptr, row, col, stride=k):
        return builder.gep(ptr, [builder.add(builder.mul(row, stride), col)])

    turn, load_w, where = _weight_access(builder, fmt, path, w, k)
    xrows = [builder.add(m0, i64(r)) for r in range(rows)]
    wrows = [builder.add(n0, i64(c)) for c in range(cols)]
    vec = simd.vector(simd.F32, LANES).as_pointer()
    slots = [[builder.bitcast(at(acc, row, builder.mul(builder.sub(col, lo), i64(LANES)), i64(CHUNK * LANES)), vec)
              for col in wrows] for row in xrows]
    lanes = [[cgutils.alloca_once_value(builder, builder.load(slot, align=4)) for slot in line] for line in slots]
    # Pieces a loop turn: one prefetch each, a 64-byte line of F32 / F16 / BF16, a block of Q8_0.
    unroll = Q8_BLOCK // LANES if fmt == "q8_0" else 64 // (LANES * (4 if fmt == "f32" else 2))

    def piece(i, ws):
        for r, row in enumerate(xrows):
            xs = simd.load(builder, at(x, row, i), "f32", LANES, path)
            for c, wv in enumerate(ws):
                builder.store(simd.fma(builder, wv, xs, builder.load(lanes[r][c]), path), lanes[r][c])

    step = i64(LANES * unroll)
    lined = builder.add(k0, builder.mul(builder.sdiv(builder.sub(k1, k0), step), step))
    hinted = rows > 1 or fmt != "f32" or far_only  # a lone row of x on F32: see LONE_FAR_K
    with cgutils.for_range_slice(builder, k0, lined, step) as (i, _):
        turns = [turn(row, i) for row in wrows]
        for row in wrows if ahead else ():  # a hint, never a fault past the end: the next chunk's line
            simd.prefetch(builder, where(builder.add(row, i64(CHUNK)), i), 0, 2)
        for ptr, _ in turns if hinted and not ahead else ():  # this turn's line, ahead
            simd.prefetch_ahead(builder, ptr, 0, 64, near=not far_only)
        for u in range(unroll):  # the same pieces in the same order as one at a time
            piece(builder.add(i, i64(u * LANES)), [load_w(t, u * LANES, LANES) for t in turns])
    with cgutils.for_range_slice(builder, lined, k1, i64(LANES)) as (i, _):
        piece(i, [load_w(turn(row, i), 0, LANES) for row in wrows])
    whole = builder.and_(k, i64(-LANES))
    with builder.if_else(builder.icmp_signed("==", k1, whole)) as (last, more):
        with last:
            sums = [[cgutils.alloca_once_value(builder, simd.hsum(builder, builder.load(a))) for a in line]
                    for line in lanes]
            with cgutils.for_range_slice(builder, whole, k, i64(1)) as (i, _):
                ws = [builder.extract_element(load_w(turn(row, i), 0, 1), i64(0)) for row in wrows]
                for r, row in enumerate(xrows):
                    xv = builder.load(at(x, row, i))
                    for c, wv in enumerate(ws):
                        builder.store(simd.fma(builder, wv, xv, builder.load(sums[r][c]), path), sums[r][c])
            for r, row in enumerate(xrows):
                for c, col in enumerate(wrows):
                    builder.store(builder.load(sums[r][c]), at(out, row, col, n))
        with more:
            for r in range(rows):
                for c in range(cols):
                    builder.store(builder.load(lanes[r][c]), slots[r][c], align=4)
    return context.get_dummy_value()


def _weight_access(builder, fmt, path, w, k):
    """``(turn(row, i), load(turned, offset, lanes), where(row, i))`` for the weight ``w`` (flat,
    its element pointer): ``turn`` what a loop turn over elements ``i ..`` of weight row ``row``
    needs (a pointer to element ``i`` first, the one to prefetch ahead of), ``load`` elements
    ``i + offset ..`` (``offset`` a constant within the turn's Q8_0 block) as ``<lanes x float>``,
    ``where`` the pointer alone, no load (a hint's address, which may lie past the weight).  A Q8_0
    element is its code times its block's ``d``, exactly (a 7-bit code times an 11-bit f16
    significand fits f32's 24 bits): the products then run as on F32 weights; its turn reads
    ``d`` once for the block's four pieces (``K`` a multiple of 32: the ``K mod 8`` tail never
    runs)."""
    i64 = ir.IntType(64)
    if fmt != "q8_0":
        def where(row, i):
            return builder.gep(w, [builder.add(builder.mul(row, k), i)])
        return (lambda row, i: (where(row, i), None),
                lambda turned, offset, lanes: simd.load(builder, builder.gep(turned[0], [i64(offset)]), fmt, lanes, path),
                where)

    row_bytes = builder.mul(builder.lshr(k, i64(5)), i64(Q8_BYTES))

    def block_of(row, i):  # i >= 0: shifts, not signed division
        return builder.gep(w, [builder.add(builder.mul(row, row_bytes), builder.mul(builder.lshr(i, i64(5)), i64(Q8_BYTES)))])

    def where(row, i):
        return builder.gep(block_of(row, i), [builder.add(i64(2), builder.and_(i, i64(Q8_BLOCK - 1)))])

    def turn(row, i):
        return where(row, i), simd.load(builder, block_of(row, i), "f16", 1, path)

    def load(turned, offset, lanes):
        codes, d = turned
        vec = builder.load(builder.bitcast(builder.gep(codes, [i64(offset)]), simd.vector(ir.IntType(8), lanes).as_pointer()), align=1)
        floats = builder.sitofp(builder.sext(vec, simd.vector(simd.I32, lanes)), simd.vector(simd.F32, lanes))
        return builder.fmul(floats, builder.shuffle_vector(d, d, ir.Constant(simd.vector(simd.I32, lanes), [0] * lanes)))
    return turn, load, where


#: A full tile, a half tile, and one weight row (the last of a chunk) for each of them, in the
#: format's shape (:func:`_shape`); one row of ``x`` against four, two or one weight rows (the
#: lone rows of ``x``: :data:`LONE_COLS`).
_TILE, _HALF, _PAIR, _QUAD = _tile("rows", "cols"), _tile("half", "cols"), _tile(1, 2), _tile(1, 4)
_COLUMN, _HALF_COLUMN, _ONE = _tile("rows", 1), _tile("half", 1), _tile(1, 1)
_ONE_FAR = _tile(1, 1, far_only=True)
#: A full tile of rows after a chunk's first pass over its weight rows (its rows then in cache):
#: each loop turn hints the same line of the next chunk's rows into L2, so that the next chunk's
#: first pass finds them there, in place of the hints on its own rows.  Where ``x`` takes two
#: passes or more (M = 8 on 16 registers: two tiles of 4), the later passes compute from cache with
#: no weight streaming from memory beside them: without this hint a product from memory takes its
#: one-row time plus about half its in-cache time.  The 125M model's 84 layer products from memory,
#: two threads, 15 interleaved rounds in one process, against no hint ahead: M = 8 0.92-0.94x the
#: time (three runs), M = 16 0.96-0.98x, M = 1 no different; its 8-row step in the compiled program
#: (whose JOINT launches pass each weight's run of a task's chunks in one call), three alternating
#: runs: 19.2-20.7 ms against 20.9-23.5, 1.44-1.51x its one-row step against 1.58-1.75x.  Hinting
#: the chunk after next instead, or keeping the own rows' hints beside, does no better
#: (0.92-0.95x).  Q8_0 gains nothing: its tiles wait on arithmetic.
_TILE_AHEAD = _tile("rows", "cols", ahead=True)


@intrinsic
def _lone_cols(typingctx, spec):
    """:data:`LONE_COLS` of ``spec``'s weight format, a constant of its compiled code."""
    cols = LONE_COLS[SPECS.of(spec)[0]]
    return types.intp(spec), lambda context, builder, sig, args: context.get_constant(types.intp, cols)


@intrinsic
def _tile_shape(typingctx, spec):
    """:func:`_shape` of ``spec``'s weight format, constants of its compiled code."""
    shape = _shape(SPECS.of(spec)[0])

    def codegen(context, builder, sig, args):
        return context.make_tuple(builder, sig.return_type, [context.get_constant(types.intp, v) for v in shape])
    return types.UniTuple(types.intp, 3)(spec), codegen


@jit(nogil=True)
def _chunk(spec, x, w, out, m, n, k, task, ahead):
    """Weight rows ``task * CHUNK`` up to the next chunk, span by span (all of ``K`` at once when
    ``x`` takes at most two tiles of rows, which have little to reuse); within a span, the
    format's tile of rows of ``x`` at a time (then a half one, then one) against every weight row
    of the chunk.  ``ahead``: the next chunk, in the same weight, is most likely the calling
    thread's next (a thread takes a contiguous run of chunks, as numba's ``prange`` hands them
    out): the passes after the first hint its lines (:data:`_TILE_AHEAD`)."""
    rows, cols, half = _tile_shape(spec)
    lo = task * CHUNK
    end = min(n, lo + CHUNK)
    whole = k // LANES * LANES
    rest = m % rows
    passes = m // rows + (rest // half + rest % half if half else rest)
    span = max(whole, LANES) if passes <= 2 else SPAN
    acc = np.zeros(m * CHUNK * LANES, np.float32)
    k0 = 0
    while True:  # at least once: K < 8 still has its products to finish
        k1 = min(whole, k0 + span)
        i = 0
        while i + rows <= m:
            j = lo
            while j + cols <= end:
                if ahead and i > 0:
                    _TILE_AHEAD(spec, x, w, out, acc, i, j, lo, n, k, k0, k1)
                else:
                    _TILE(spec, x, w, out, acc, i, j, lo, n, k, k0, k1)
                j += cols
            while j < end:
                _COLUMN(spec, x, w, out, acc, i, j, lo, n, k, k0, k1)
                j += 1
            i += rows
        if half and i + half <= m:
            j = lo
            while j + cols <= end:
                _HALF(spec, x, w, out, acc, i, j, lo, n, k, k0, k1)
                j += cols
            while j < end:
                _HALF_COLUMN(spec, x, w, out, acc, i, j, lo, n, k, k0, k1)
                j += 1
            i += half
        while i < m:
            j = lo
            if _lone_cols(spec) == 2:
                while j + 2 <= end:
                    _PAIR(spec, x, w, out, acc, i, j, lo, n, k, k0, k1)
                    j += 2
            if _lone_cols(spec) == 4:
                while j + 4 <= end:
                    _QUAD(spec, x, w, out, acc, i, j, lo, n, k, k0, k1)
                    j += 4
            far = _lone_cols(spec) == 1 and k >= LONE_FAR_K
            while j < end:
                if far:
                    _ONE_FAR(spec, x, w, out, acc, i, j, lo, n, k, k0, k1)
                else:
                    _ONE(spec, x, w, out, acc, i, j, lo, n, k, k0, k1)
                j += 1
            i += 1
        if k1 == whole:
            break
        k0 = k1


@jit(nogil=True, parallel=True)
def _threaded(spec, x, w, out, m, n, k):
    chunks = (n + CHUNK - 1) // CHUNK
    for task in prange(chunks):
        _chunk(spec, x, w, out, m, n, k, task, task + 1 < chunks)


@jit(nogil=True)
def _rows(spec, x, w, out, m, n, k, lo, hi):
    """The chunks holding weight rows ``lo`` up to ``hi``, on the calling thread (``lo`` a multiple
    of :data:`CHUNK`, or ``hi`` = ``n``: a chunk is never split)."""
    last = (hi + CHUNK - 1) // CHUNK
    for task in range(lo // CHUNK, last):
        _chunk(spec, x, w, out, m, n, k, task, task + 1 < last)


@jit(nogil=True, parallel=True)
def _threaded_joint(spec, x, m, k, w0, out0, n0, w1, out1, n1, w2, out2, n2):
    """Up to three weights' products with one ``x`` in one launch: their chunks in one range (a
    weight of ``n`` = 0 has none), so the threads never wait between products."""
    t0, t1, t2 = (n0 + CHUNK - 1) // CHUNK, (n1 + CHUNK - 1) // CHUNK, (n2 + CHUNK - 1) // CHUNK
    for task in prange(t0 + t1 + t2):
        if task < t0:
            _chunk(spec, x, w0, out0, m, n0, k, task, task + 1 < t0)
        elif task < t0 + t1:
            _chunk(spec, x, w1, out1, m, n1, k, task - t0, task + 1 < t0 + t1)
        else:
            _chunk(spec, x, w2, out2, m, n2, k, task - t0 - t1, task + 1 < t0 + t1 + t2)


_DRIVERS = Drivers(_rows, _threaded)


def _run(spec: np.ndarray, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
    m, n = out.shape
    run(_DRIVERS, w.nbytes * m, (spec, x.reshape(-1), w.reshape(-1), out.reshape(-1), m, n, x.shape[1]), n)


def _run_joint(spec: np.ndarray, x: np.ndarray, ws: list, outs: list, codes: list) -> None:
    m, k = x.shape
    if serial(sum(w.nbytes for w in ws) * m) or len(ws) > 3:
        for w, out in zip(ws, outs):
            _run(spec, x, w, out)
        return
    flat = joint_slots([w.reshape(-1) for w in ws], [o.reshape(-1) for o in outs], [w.shape[0] for w in ws], 0)
    _threaded_joint(spec, x.reshape(-1), m, k, *flat)


#: The formats of these tiles, in the order of their codes (a weight's code in the compiled
#: program's weight table, ``program/vm.py``).  Q8_0 here is Q8_0 weights with f32 activations.
FORMATS = ("f32", "f16", "bf16", "q8_0")


def _route(fmt: str) -> Route:
    spec = SPECS((fmt, cpu.PATH))
    rows, cols, _ = _shape(fmt)
    return Route(FLOATS, FORMATS.index(fmt), "f32", functools.partial(_run, spec), functools.partial(_run_joint, spec),
                 f"{fmt.upper()} tiles of {rows} x {cols} rows on the {cpu.PATH} path")


#: Each format's route (the product table's rows for the float types, and Q8_0's with f32 activations).
ROUTES = {fmt: _route(fmt) for fmt in FORMATS}
