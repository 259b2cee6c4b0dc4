"""LLVM vector IR for the K-quant kernels' AVX2 path (:mod:`.kquants`).

Written as ``numba.extending.intrinsic`` so that the vector shape is what we say, not what LLVM's
vectorizer makes of a loop (it vectorizes differently for different trip counts, which would make
results depend on ``M``).  The IR compiles on any CPU (the portable path is compiled beside it in
the same functions): generic LLVM operations and ``llvm.fma``, plus ``pmaddubsw``/``pmaddwd`` only
when the CPU has AVX2 (the same sums in generic IR otherwise).

f32 activations (``q4_k_avx2``, ``q5_k_avx2``, ``q6_k_avx2``): one call takes one weight row to
every row of ``x``, :data:`TILE` rows of ``x`` at a time (then one at a time), each row's 8 lanes
held in a register over the whole row of ``W`` (Q6_K: two sums of 8 lanes, by sub-block parity,
added at the end).  Per super-block and sub-block, the codes are
widened to ``<8 x float>`` once for the tile; for each row their products with ``x`` are summed in
8 lanes (``fmul`` then ``fma`` in element order) and added to the lanes times the sub-block's
scale (one ``fma``); for Q4_K/Q5_K the mins then come off as ``lanes -= dm * xsum`` (one ``fma``,
lane ``j`` = sub-block ``j``).  Every row sees the same
operations in the same order in a tile or alone: the result is batch-invariant.

Q8_K activations (``q4_k_q8``, ``q5_k_q8``, ``q6_k_q8``): one call takes one weight row to every
row of quantized activations, :data:`TILE` rows at a time (the codes decoded once for them), then
one at a time.  Per super-block each row's exact integer sums (llama.cpp's
``vec_dot_q*_K_q8_K``) stay in 8 lanes, as llama.cpp's AVX2 kernels keep them, and are scaled
into 8 f32 lanes held in a register over the whole row: no horizontal sum and no return to the
driver per super-block (1024 x 4096, one thread, in cache, against kernels that do both: M = 1
Q4_K 0.83-0.88x the time, Q5_K 0.90-0.99x, Q6_K 0.76-0.81x; M = 8 0.74-0.80x; from memory, 24
weights of 4096 x 4096 in a chain, two threads: Q4_K 19.8 GB/s against 15.6).

numba's on-disk cache keys :mod:`.kquants`'s drivers by their own file only: the kernels' cache
directory is named by a digest of every source, this one included (:mod:`.cache`).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ...dtypes import DType
from . import cpu, simd

#: F16C's conversion of the f16 scales, where the CPU has it (decided by the CPU itself, as
#: :data:`_X86_AVX2`, because numba's cache is keyed by the CPU).
_F16C = "f16c" in cpu.FEATURES
#: Rows of ``x`` that share each decoded sub-block (4 rows x 2 vectors + 4 codes: 12 of 16 ymm).
TILE = 4
#: Elements of a super-block.
QK_K = 256

F32 = ir.FloatType()
I8 = ir.IntType(8)
I32 = ir.IntType(32)
V8F = ir.VectorType(F32, 8)
V8I8 = ir.VectorType(I8, 8)
V8I = ir.VectorType(I32, 8)
ARGS = ("row", "size", "blocks", "scales", "dm", "x", "k", "xsum", "nsub", "acc", "m_rows")


def _i32s(value):
    return ir.Constant(V8I, [value] * 8)


class _Row:
    """One call's arguments (array data pointers, ``intp`` integers) and the IR helpers the
    element types' emitters share."""

    def __init__(self, context, builder, sig, args, names=ARGS):
        self.builder = builder
        self.intp = context.get_value_type(types.intp)
        self.fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V8F, [V8F] * 3), "llvm.fma.v8f32")
        self.accumulators = 1
        self.block_at = self.const(0)
        for name, ty, value in zip(names, sig.args, args):
            if isinstance(ty, types.Array):
                value = context.make_array(ty)(context, builder, value).data
            else:
                value = context.cast(builder, value, ty, types.intp)
            setattr(self, name, value)

    def const(self, v):
        return ir.Constant(self.intp, v)

    def at(self, *terms):
        """The sum of ``terms`` (ints or ``intp`` values)."""
        total = self.const(0)
        for t in terms:
            total = self.builder.add(total, self.const(t) if isinstance(t, int) else t)
        return total

    def load(self, base, at, vt, align=4):
        b = self.builder
        return b.load(b.bitcast(b.gep(base, [at]), vt.as_pointer()), align=align)

    def codes8(self, byte_at):
        """8 bytes of the current super-block from ``byte_at``, widened to i32."""
        return self.builder.zext(self.load(self.row, self.at(self.block_at, byte_at), V8I8, 1), V8I)

    def splat(self, value, n=8):
        b = self.builder
        vt = ir.VectorType(value.type, n)
        one = b.insert_element(ir.Constant(vt, ir.Undefined), value, ir.Constant(I32, 0))
        return b.shuffle_vector(one, ir.Constant(vt, ir.Undefined), ir.Constant(ir.VectorType(I32, n), [0] * n))

    def half(self, byte_at):
        """The f16 at ``byte_at`` of the current super-block as f32: one ``vcvtph2ps`` where the
        CPU has F16C; elsewhere (this IR must compile on any CPU) integer operations and one
        exact multiply: the f16's exponent and mantissa placed in an f32's low bits times
        ``2 ** 112`` is its value (subnormals too), and 65536 or more means inf or NaN."""
        b = self.builder
        at = b.gep(self.row, [self.at(self.block_at, byte_at)])
        if _F16C:
            return b.fpext(b.load(b.bitcast(at, ir.HalfType().as_pointer()), align=1), F32)
        h = b.zext(b.load(b.bitcast(at, ir.IntType(16).as_pointer()), align=1), I32)
        f = b.fmul(b.bitcast(b.shl(b.and_(h, ir.Constant(I32, 0x7FFF)), ir.Constant(I32, 13)), F32), ir.Constant(F32, 2.0 ** 112))
        bits = b.bitcast(f, I32)
        bits = b.select(b.fcmp_ordered(">=", f, ir.Constant(F32, 65536.0)), b.or_(bits, ir.Constant(I32, 0x7F800000)), bits)
        return b.bitcast(b.or_(bits, b.shl(b.and_(h, ir.Constant(I32, 0x8000)), ir.Constant(I32, 16))), F32)

    def scale_codes_q45_k(self):
        """The super-block's 6-bit scales and mins (``get_scale_min_k4``) as two ``<8 x i32>``,
        decoded as llama.cpp's AVX2 kernels do, on 32-bit words in the integer registers: bytes
        0-3 hold scales 0-3 and the top bits of scales 4-7, bytes 4-7 the same for the mins, bytes
        8-11 the rest of scales and mins 4-7.  Decoded on vectors instead (byte shuffles and
        shifts, 22 vector instructions a super-block against 14), the same bits took the Q4_K /
        Q5_K products with Q8_K activations at M = 1 1.03-1.06x the time (one thread, in cache,
        K = 768 and 4096; f32 activations and M = 8 no different): the vector pipes are what
        these kernels wait on."""
        b = self.builder
        q0, q1, q2 = (self.load(self.row, self.at(self.block_at, 4 + 4 * i), I32, 1) for i in range(3))

        def masked(v, shift, mask):
            return b.and_(b.lshr(v, ir.Constant(I32, shift)) if shift else v, ir.Constant(I32, mask))

        def top(v):  # the top 2 bits of each byte of ``v`` as bits 4-5
            return b.shl(masked(v, 6, 0x03030303), ir.Constant(I32, 4))

        def lanes(low, high):  # the 8 bytes of two words as i32 lanes
            i64 = ir.IntType(64)
            word = b.or_(b.zext(low, i64), b.shl(b.zext(high, i64), ir.Constant(i64, 32)))
            return b.zext(b.bitcast(word, V8I8), V8I)

        sc = lanes(masked(q0, 0, 0x3F3F3F3F), b.or_(masked(q2, 0, 0x0F0F0F0F), top(q0)))
        mn = lanes(masked(q1, 0, 0x3F3F3F3F), b.or_(masked(q2, 4, 0x0F0F0F0F), top(q1)))
        return sc, mn

    def scales_q45_k(self):
        """The super-block's ``d * scale`` and ``dmin * min`` into ``scales[16 block:]`` and
        ``dm[8 block:]``."""
        b = self.builder
        sc, mn = self.scale_codes_q45_k()
        for value, half, dest, width in ((sc, 0, self.scales, 16), (mn, 2, self.dm, 8)):
            out = b.fmul(self.splat(self.half(half)), b.sitofp(value, V8F))
            b.store(out, b.bitcast(b.gep(dest, [b.mul(self.block, self.const(width))]), V8F.as_pointer()), align=4)

    def scales_q6_k(self):
        """The super-block's ``d * scale`` (16 int8 scales) into ``scales[16 block:]``."""
        b = self.builder
        v16f = ir.VectorType(F32, 16)
        codes = b.sitofp(self.load(self.row, self.at(self.block_at, 192), ir.VectorType(I8, 16), 1), v16f)
        out = b.fmul(self.splat(self.half(208), 16), codes)
        b.store(out, b.bitcast(b.gep(self.scales, [b.mul(self.block, self.const(16))]), v16f.as_pointer()), align=4)

    def each_block(self, emit):
        """``emit(self)`` for each super-block of the row (``block``, ``block_at``, ``scale_at`` set)."""
        b = self.builder
        with cgutils.for_range(b, self.blocks, intp=self.intp) as loop:
            self.block = loop.index
            self.block_at = b.mul(loop.index, self.size)
            self.scale_at = b.mul(loop.index, self.const(16))
            emit(self)

    def scale(self, j):
        """Sub-block ``j``'s scale of the current super-block on all 8 lanes."""
        b = self.builder
        return self.splat(b.load(b.gep(self.scales, [self.at(self.scale_at, j)])))

    def subblock(self, codes, first, scale, j):
        """Each row's lanes (its accumulator ``j % accumulators``) += ``scale * sum_g(codes[g] *
        x[row, first + 8 g:])`` for sub-block ``j``."""
        b = self.builder
        codes = [b.sitofp(c, V8F) for c in codes]
        for r, slots in enumerate(self.slots):
            xat = self.at(self.x_at[r], first)
            part = b.fmul(codes[0], self.load(self.x, xat, V8F))
            for g in range(1, len(codes)):
                part = b.call(self.fma, [codes[g], self.load(self.x, self.at(xat, 8 * g), V8F), part])
            slot = slots[j % len(slots)]
            b.store(b.call(self.fma, [scale, part, b.load(slot)]), slot)

    def mins(self):
        """Each row's lanes -= ``dm * xsum`` (the current super-block's 8 mins and sub-block sums)."""
        b = self.builder
        dm = b.fneg(self.load(self.dm, b.mul(self.block, self.const(8)), V8F))
        for r, (slot, *_) in enumerate(self.slots):
            xs = self.load(self.xsum, self.at(self.xsum_at[r], b.mul(self.block, self.const(8))), V8F)
            b.store(b.call(self.fma, [dm, xs, b.load(slot)]), slot)

    def rows(self, first, count, block):
        """The lanes of rows ``first .. first + count`` over the whole weight row, into ``acc``:
        ``block(self, ms)`` for each super-block (``ms``: the rows' indices) adds into
        :attr:`slots`, :attr:`accumulators` 8-lane accumulators a row, added pairwise in order
        at the end."""
        b = self.builder
        self.slots = [[cgutils.alloca_once(b, V8F) for _ in range(self.accumulators)] for _ in range(count)]
        for slot in (s for slots in self.slots for s in slots):
            b.store(ir.Constant(V8F, [0.0] * 8), slot)
        ms = [self.at(first, r) for r in range(count)]
        self.each_block(lambda blk: block(blk, ms))
        for m, slots in zip(ms, self.slots):
            lanes = simd.pairwise(b, [b.load(slot) for slot in slots])
            b.store(lanes, b.bitcast(b.gep(self.acc, [b.mul(m, self.const(8))]), V8F.as_pointer()), align=4)

    def tiles(self, block):
        """:meth:`rows` over every row of ``x``: :data:`TILE` rows at a time, then one at a time."""
        b, one = self.builder, self.const(1)
        tiled = b.mul(b.sdiv(self.m_rows, self.const(TILE)), self.const(TILE))
        with cgutils.for_range_slice(b, self.const(0), tiled, self.const(TILE), self.intp) as (m, _):
            self.rows(m, TILE, block)
        with cgutils.for_range_slice(b, tiled, self.m_rows, one, self.intp) as (m, _):
            self.rows(m, 1, block)


def _emit_q45_k(blk, high):
    """Q4_K (``high`` False) or Q5_K: sub-block ``j = 2c + s``, elements ``32 j + l``: nibble
    ``s`` of ``qs[32 c + l]`` (and bit ``j`` of ``qh[l]`` as the fifth bit)."""
    b = blk.builder
    if high:  # the fifth bits on bytes, 32 codes at a time (:func:`_widened`)
        highs = _bytes(blk, blk.row, [16])
        for c in range(4):
            packed = _bytes(blk, blk.row, [48 + 32 * c])
            for s in range(2):
                j = 2 * c + s
                q = b.or_(_bits(b, packed, [4 * s], 15), b.shl(_bits(b, highs, [j], 1), _per_piece([4])))
                blk.subblock(_widened(b, q, signed=False), 32 * j, blk.scale(j), j)
        blk.mins()
        return
    for c in range(4):  # Q4_K: one operation on 8 codes either way, so on i32 lanes
        packed = [blk.codes8(16 + 32 * c + 8 * g) for g in range(4)]
        for s in range(2):
            j = 2 * c + s
            codes = [b.and_(b.lshr(p, _i32s(4)) if s else p, _i32s(15)) for p in packed]
            blk.subblock(codes, 32 * j, blk.scale(j), j)
    blk.mins()


def _widened(builder, q, signed: bool):
    """32 codes computed on bytes as four ``<8 x i32>``.  Decoding on bytes, 32 at a time, takes a
    quarter of the integer operations of i32 lanes 8 at a time where a code needs several (Q5_K's
    fifth bit, Q6_K's two high bits): the same codes, the same bits after (M = 1, 1024 x 4096, one
    thread, in alternate runs: Q6_K 505-511 us against 546-573 on i32 lanes, Q5_K 417-507 against
    485-558)."""
    widen = builder.sext if signed else builder.zext
    return [widen(builder.shuffle_vector(q, q, ir.Constant(V8I, list(range(8 * v, 8 * v + 8)))), V8I)
            for v in range(4)]


def _emit_q6_k(blk):
    """Q6_K: elements ``128 h + 32 g + l``: nibble ``g // 2`` of ``ql[64 h + 32 (g % 2) + l]``,
    bits ``2g`` of ``qh[32 h + l]``, minus 32; sub-blocks of 16 (scale ``8 h + 2 g + l // 16``)."""
    b = blk.builder
    for h in range(2):
        highs = _bytes(blk, blk.row, [128 + 32 * h])
        for g in range(4):  # on bytes, 32 codes at a time (:func:`_widened`)
            low = _bits(b, _bytes(blk, blk.row, [64 * h + 32 * (g % 2)]), [4 * (g // 2)], 15)
            q = b.sub(b.or_(low, b.shl(_bits(b, highs, [2 * g], 3), _per_piece([4]))), _per_piece([32]))
            codes = _widened(b, q, signed=True)
            for half in range(2):
                j = 8 * h + 2 * g + half
                blk.subblock(codes[2 * half:2 * half + 2], 128 * h + 32 * g + 16 * half, blk.scale(j), j)


def _row_kernel(emit_scales, emit, span, accumulators=1):
    """The f32-activation intrinsic of ``emit`` for super-blocks of ``span`` bytes;
    ``accumulators`` 8-lane sums a row (sub-block ``j`` into sum ``j % accumulators``)."""
    @intrinsic
    def row_kernel(typingctx, row, size, blocks, scales, dm, x, k, xsum, nsub, acc, m_rows):
        def codegen(context, builder, sig, args):
            blk = _Row(context, builder, sig, args)
            blk.accumulators = accumulators

            # The first pass over the row (its scales) brings the row into the caches, every line
            # of each super-block prefetched far ahead.  Against one line a super-block (the rest
            # left to the hardware, which the scales' stride of one line in 3-4 misleads),
            # products from memory (chains of distinct weights, two threads, M = 1 / 8) take Q4_K
            # 2048 x 768 0.89 / 0.96x the time, Q6_K 768 x 2048 0.54 / 0.84x, Q6_K 32000 x 768
            # 0.85 / 0.79x, and the Q4_K_M decode step 0.89-0.93x (4 A/Bs of 5; in cache
            # 1.00-1.03x).  Far only: the near (L1) hint as well measures no faster on the Q4_K_M
            # step (0.99-1.03x).  The Q8_K-activation kernels keep both: without the near hint
            # they measure 0.97-1.01x, without either 1.15x.
            def scales(blk):
                simd.prefetch_ahead(builder, blk.row, blk.block_at, span, near=False)
                emit_scales(blk)
            blk.each_block(scales)

            def block(blk, ms):
                blk.x_at = [blk.at(builder.mul(m, blk.k), builder.mul(blk.block, blk.const(QK_K))) for m in ms]
                blk.xsum_at = [builder.mul(m, blk.nsub) for m in ms]
                emit(blk)
            blk.tiles(block)
            return context.get_dummy_value()

        return types.void(row, size, blocks, scales, dm, x, k, xsum, nsub, acc, m_rows), codegen

    return row_kernel


#: ``f(row, size, blocks, scales, dm, x, k, xsum, nsub, acc, m_rows)``: the weight row ``row``
#: (``blocks`` super-blocks of ``size`` bytes) against every row of ``x`` (flat, ``k`` per row);
#: row ``m``'s 8 lanes go to ``acc[8 m:]``.  ``scales``: each super-block's 16 sub-block scales
#: (f32, d * scale; Q4_K/Q5_K use the first 8); ``dm``: its 8 mins (d_min * min) and ``xsum``
#: (flat, ``nsub`` per row): each 32-element sub-block's sum of ``x`` (both unused by Q6_K).
q4_k_avx2 = _row_kernel(_Row.scales_q45_k, lambda blk: _emit_q45_k(blk, False), DType.Q4_K.block_bytes)
q5_k_avx2 = _row_kernel(_Row.scales_q45_k, lambda blk: _emit_q45_k(blk, True), DType.Q5_K.block_bytes)
#: Q6_K's 16 sub-blocks a super-block go into two sums a row, by parity: against one chain of 16
#: multiply-adds a super-block, 0.92-0.94x the time at M = 1 and 8, K = 768 and 2048, one thread,
#: in cache; Q4_K measures no faster with 2 or 4 (0.99-1.08x), so keeps one.
q6_k_avx2 = _row_kernel(_Row.scales_q6_k, _emit_q6_k, DType.Q6_K.block_bytes, accumulators=2)


# -- Q8_K activations: integer dot products (llama.cpp's vec_dot_q*_K_q8_K) -----------------------
V32I8 = ir.VectorType(I8, 32)
V16I16 = ir.VectorType(ir.IntType(16), 16)
#: ``pmaddubsw``/``pmaddwd`` where the hardware has them (decided by the CPU itself, not by
#: DIST_RUNTIME_PORTABLE, because numba's cache is keyed by the CPU); elsewhere the same sums in
#: generic IR (equal here: the products never saturate 16 bits).
_X86_AVX2 = "avx2" in cpu.FEATURES
#: 32-code pieces of a super-block per integer operation where a call computes one row of
#: activations: two (512-bit ``zmm``) with AVX-512BW, else one; tiles of rows keep one.  The sums
#: are exact integers either way: the same bits.  Measured on an AMD EPYC with AVX-512 (1024 x
#: 4096, one thread, in cache, as a fraction of the time of kernels that return to the driver per
#: super-block): Q4_K M = 1 0.78-0.88x with two pieces, 0.93x with one; Q5_K 0.81-0.99x, 0.92x; at
#: M = 8 one piece does 5-10% better, and Q6_K's tiles no different either way.
WIDE = 2 if {"avx512f", "avx512bw"} <= cpu.FEATURES else 1


def _width(rows: int) -> int:
    """32-code pieces per integer operation for a call over ``rows`` rows (:data:`WIDE`)."""
    return WIDE if rows == 1 else 1


_INTRINSICS = {(32, "ubs"): "llvm.x86.avx2.pmadd.ub.sw", (64, "ubs"): "llvm.x86.avx512.pmaddubs.w.512",
               (16, "wd"): "llvm.x86.avx2.pmadd.wd", (32, "wd"): "llvm.x86.avx512.pmaddw.d.512"}


def _pairs(builder, wide, vt):
    """Adjacent lanes of ``wide`` added: ``[w0 + w1, w2 + w3, ...]``."""
    n = vt.count
    even = builder.shuffle_vector(wide, ir.Constant(wide.type, ir.Undefined), ir.Constant(ir.VectorType(I32, n), list(range(0, 2 * n, 2))))
    odd = builder.shuffle_vector(wide, ir.Constant(wide.type, ir.Undefined), ir.Constant(ir.VectorType(I32, n), list(range(1, 2 * n, 2))))
    return builder.add(even, odd)


def _madd(builder, a, b, kind):
    """``pmaddubsw`` (``kind`` "ubs": unsigned bytes ``a`` times signed ``b``) or ``pmaddwd``
    ("wd": i16 times i16) on any width: products, adjacent pairs added, into lanes twice as wide."""
    n = a.type.count
    narrow, wide = (I8, ir.IntType(16)) if kind == "ubs" else (ir.IntType(16), I32)
    out = ir.VectorType(wide, n // 2)
    if _X86_AVX2 and (n, kind) in _INTRINSICS:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(out, [a.type, b.type]), _INTRINSICS[n, kind])
        return builder.call(fn, [a, b])
    vt = ir.VectorType(wide, n)
    first = builder.zext(a, vt) if kind == "ubs" else builder.sext(a, vt)
    return _pairs(builder, builder.mul(first, builder.sext(b, vt)), out)


def _q8_rows(blk, rows):
    """Where each of ``rows`` rows of Q8_K activations starts: its codes, its code sums' index."""
    b = blk.builder
    return ([b.gep(blk.q8, [blk.at(blk.q8at, b.mul(blk.const(r), blk.q8step))]) for r in range(rows)],
            [blk.at(blk.bsat, b.mul(blk.const(r), blk.bstep)) for r in range(rows)])


def _bytes(blk, base, offsets):
    """The 32 bytes at each of ``offsets`` (of ``base``, past the block start for the weight row)
    side by side: one load when they follow each other, one load and a copy when they repeat."""
    b = blk.builder
    n = 32 * len(offsets)
    at = blk.at(blk.block_at, offsets[0]) if base is blk.row else blk.const(offsets[0])
    if offsets == [offsets[0] + 32 * i for i in range(len(offsets))]:
        return blk.load(base, at, ir.VectorType(I8, n), 1)
    if len(set(offsets)) == 1:
        one = blk.load(base, at, V32I8, 1)
        return b.shuffle_vector(one, one, ir.Constant(ir.VectorType(I32, n), [i % 32 for i in range(n)]))
    raise ValueError(f"pieces at {offsets} are neither adjacent nor equal")


def _per_piece(values, width=32, ty=I8):
    """A constant vector: ``values[p]`` on the ``width`` lanes of piece ``p``."""
    return ir.Constant(ir.VectorType(ty, width * len(values)), [v for v in values for _ in range(width)])


def _bits(builder, v, shifts, mask):
    """``(v >> shifts[p]) & mask`` on the bytes of each piece ``p``.  Shifts that differ between
    pieces go by 16-bit lanes (one ``vpsrlvw``; LLVM makes a per-byte variable shift of 7
    operations), which is exact here: the bits a byte gets from its neighbour are above ``mask``."""
    n = v.type.count
    if len(set(shifts)) == 1:
        shifted = builder.lshr(v, _per_piece(shifts)) if shifts[0] else v
    else:
        words = ir.VectorType(ir.IntType(16), n // 2)
        shifted = builder.bitcast(builder.lshr(builder.bitcast(v, words), _per_piece(shifts, 16, ir.IntType(16))), v.type)
    return builder.and_(shifted, _per_piece([mask] * len(shifts)))


def _dot_pieces(blk, rows, pieces, codes_of, scales, scale_lanes, width):
    """Per row, the <8 or 16 x i32> sums of ``scale * (codes . q8)`` over ``pieces`` (each a dict
    with the 32 codes' ``y`` offset in the row of Q8_K codes), ``width`` at a time:
    ``codes_of(group)`` gives a group's codes as one byte vector, ``scale_lanes(piece)`` the 16
    indices into the i16 vector ``scales`` of its 16 pair sums' scales."""
    b = blk.builder
    q8s, _ = _q8_rows(blk, rows)
    totals = [None] * rows
    for first in range(0, len(pieces), width):
        group = pieces[first:first + width]
        codes = codes_of(group)
        lanes = [i for p in group for i in scale_lanes(p)]
        if len(set(lanes)) == 1:  # a broadcast (as a shuffle LLVM makes it a permute, 5-9% slower)
            scale = blk.splat(b.extract_element(scales, ir.Constant(I32, lanes[0])), len(lanes))
        else:
            scale = b.shuffle_vector(scales, ir.Constant(scales.type, ir.Undefined), ir.Constant(ir.VectorType(I32, len(lanes)), lanes))
        for r, q8 in enumerate(q8s):
            pairs = _madd(b, codes, _bytes(blk, q8, [p["y"] for p in group]), "ubs")
            if totals[r] is not None and cpu.VNNI:
                totals[r] = _dot_add(b, totals[r], pairs, scale)
            else:
                part = _madd(b, pairs, scale, "wd")
                totals[r] = part if totals[r] is None else b.add(totals[r], part)
    return totals


def _dot_add(builder, total, pairs, scale):
    """``total + pmaddwd(pairs, scale)`` as one ``vpdpwssd`` (VNNI): the same exact i32 sums."""
    n = total.type.count
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(total.type, [total.type] * 3),
                                        f"llvm.x86.avx512.vpdpwssd.{32 * n}")
    return builder.call(fn, [total, builder.bitcast(pairs, total.type), builder.bitcast(scale, total.type)])


def _emit_q45_k_q8(blk, rows, high):
    """Per row the lanes of ``sum_j scale_j * sum_l q_l * q8_l`` and of ``min_j * bsum_j`` (lane
    ``j``), and ``d``, ``dmin``, of one Q4_K/Q5_K super-block against 256 Q8_K codes of each row
    (``bsums``: sums of 32 codes); the codes decoded once for all rows.  Sub-block ``j``: nibble
    ``j % 2`` of ``qs[32 (j // 2):]`` (and bit ``j`` of ``qh`` as the fifth bit)."""
    b = blk.builder
    sc, mn = blk.scale_codes_q45_k()
    _, bsat = _q8_rows(blk, rows)
    qs = 48 if high else 16
    pieces = [{"j": j, "at": qs + 32 * (j // 2), "y": 32 * j} for j in range(8)]

    def codes_of(group):
        packed = _bytes(blk, blk.row, [p["at"] for p in group])
        codes = _bits(b, packed, [4 * (p["j"] % 2) for p in group], 15)
        if high:
            highs = _bytes(blk, blk.row, [16] * len(group))
            codes = b.or_(codes, b.shl(_bits(b, highs, [p["j"] for p in group], 1), _per_piece([4] * len(group))))
        return codes

    scales = b.trunc(sc, ir.VectorType(ir.IntType(16), 8))
    totals = _dot_pieces(blk, rows, pieces, codes_of, scales, lambda p: [p["j"]] * 16, _width(rows))
    imins = [b.mul(mn, blk.load(blk.bsums, at, V8I)) for at in bsat]
    return [_fold(b, t) for t in totals], imins, blk.half(0), blk.half(2)


def _fold(builder, v):
    """A ``<16 x i32>``'s halves added (lane ``l`` + lane ``l + 8``); a ``<8 x i32>`` as it is."""
    if v.type.count == 8:
        return v
    low, high = (builder.shuffle_vector(v, v, ir.Constant(V8I, list(range(h, h + 8)))) for h in (0, 8))
    return builder.add(low, high)


def _emit_q6_k_q8(blk, rows):
    """Per row the lanes of ``sum_i scale_i * sum_l (q_l - 32) * q8_l`` (no mins: the codes are
    centred), ``d``, of one Q6_K super-block (16 sub-blocks of 16; ``bsums``: sums of 16 codes, for
    the ``- 32``: lane ``l`` takes sub-blocks ``2 l``, ``2 l + 1``'s).  Elements ``128 h + 32 g + l``:
    nibble ``g // 2`` of ``ql[64 h + 32 (g % 2) + l]``, bits ``2 g`` of ``qh[32 h + l]``."""
    b = blk.builder
    scales = b.sext(blk.load(blk.row, blk.at(blk.block_at, 192), ir.VectorType(I8, 16), 1), V16I16)
    _, bsat = _q8_rows(blk, rows)
    pieces = [{"h": h, "g": g, "at": 64 * h + 32 * (g % 2), "y": 128 * h + 32 * g} for h in range(2) for g in range(4)]

    def codes_of(group):
        low = _bits(b, _bytes(blk, blk.row, [p["at"] for p in group]), [4 * (p["g"] // 2) for p in group], 15)
        high = _bits(b, _bytes(blk, blk.row, [128 + 32 * p["h"] for p in group]), [2 * p["g"] for p in group], 3)
        return b.or_(low, b.shl(high, _per_piece([4] * len(group))))

    def scale_lanes(p):
        i = 8 * p["h"] + 2 * p["g"]
        return [i] * 8 + [i + 1] * 8

    totals = _dot_pieces(blk, rows, pieces, codes_of, scales, scale_lanes, _width(rows))
    v16i32 = ir.VectorType(I32, 16)
    wide = b.sext(scales, v16i32)
    offsets = [_pairs(b, b.mul(wide, blk.load(blk.bsums, at, v16i32)), V8I) for at in bsat]
    lanes = [b.sub(_fold(b, t), b.shl(o, _i32s(5))) for t, o in zip(totals, offsets)]
    return lanes, None, blk.half(208), None


Q8_ROW_ARGS = ("row", "size", "blocks", "q8", "k", "dx", "bsums", "bstep", "acc", "m_rows")


def _q8_row_kernel(emit, span, per_block):
    """The intrinsic of ``emit`` over a whole weight row: :data:`TILE` rows of Q8_K activations at
    a time sharing each decoded super-block, then one at a time; each row's 8 f32 lanes held in a
    register over the row.  Per super-block and row, with ``s`` the row's Q8_K scale of the block:
    ``lanes += (d * s) * float(isum lanes)``, then ``lanes -= (dmin * s) * float(imin lanes)``
    (Q4_K/Q5_K), each a multiply then an add, as the portable path does them.  ``span``: the
    super-block's bytes, prefetched ahead (the weight row is the stream that waits on memory)."""
    @intrinsic
    def q8_row(typingctx, row, size, blocks, q8, k, dx, bsums, bstep, acc, m_rows):
        def codegen(context, builder, sig, args):
            blk = _Row(context, builder, sig, args, Q8_ROW_ARGS)
            blk.q8step = blk.k

            def block(blk, ms):
                b = builder
                simd.prefetch_ahead(b, blk.row, blk.block_at, span)
                blk.q8at = blk.at(b.mul(ms[0], blk.k), b.mul(blk.block, blk.const(QK_K)))
                blk.bsat = blk.at(b.mul(ms[0], blk.bstep), b.mul(blk.block, blk.const(per_block)))
                isums, imins, d, dmin = emit(blk, len(ms))
                for m, isum, imin, (slot,) in zip(ms, isums, imins or [None] * len(ms), blk.slots):
                    s = b.load(b.gep(blk.dx, [blk.at(b.mul(m, blk.blocks), blk.block)]))
                    lanes = b.fadd(b.load(slot), b.fmul(blk.splat(b.fmul(d, s)), b.sitofp(isum, V8F)))
                    if imins is not None:
                        lanes = b.fsub(lanes, b.fmul(blk.splat(b.fmul(dmin, s)), b.sitofp(imin, V8F)))
                    b.store(lanes, slot)
            blk.tiles(block)
            return context.get_dummy_value()

        return types.void(row, size, blocks, q8, k, dx, bsums, bstep, acc, m_rows), codegen

    return q8_row


#: ``f(row, size, blocks, q8, k, dx, bsums, bstep, acc, m_rows)``: the weight row ``row``
#: (``blocks`` super-blocks of ``size`` bytes) against every row of Q8_K activations: row ``m``'s
#: codes at ``q8[m k:]`` (int8), its scales at ``dx[m blocks:]``, its sums of 32 (Q4_K/Q5_K: 8 a
#: block) or 16 (Q6_K: 16) codes at ``bsums[m bstep:]``; row ``m``'s 8 lanes go to ``acc[8 m:]``.
#: Lane ``l`` of a super-block's integers (exact, llama.cpp's ``vec_dot_q*_K_q8_K``'s): the
#: elements ``32 p + 4 l .. + 3`` of each 32-code piece ``p`` times their sub-block's scale, and
#: (Q4_K/Q5_K) ``imin`` lane ``l``: sub-block ``l``'s ``min * bsum``; (Q6_K) less ``32 * (scale *
#: bsum)`` of sub-blocks ``2 l`` and ``2 l + 1``.
q4_k_q8 = _q8_row_kernel(lambda blk, rows: _emit_q45_k_q8(blk, rows, False), DType.Q4_K.block_bytes, 8)
q5_k_q8 = _q8_row_kernel(lambda blk, rows: _emit_q45_k_q8(blk, rows, True), DType.Q5_K.block_bytes, 8)
q6_k_q8 = _q8_row_kernel(_emit_q6_k_q8, DType.Q6_K.block_bytes, 16)
