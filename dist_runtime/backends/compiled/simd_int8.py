"""LLVM vector IR (AVX2, FMA, F16C) for the legacy block products: one call runs a whole weight
row against a tile of rows of ``x``, each block decoded once for the tile.

Two intrinsics, each built for a tile height ``rows`` and every legacy format (the format is a
run-time code; the block loop of each format is emitted once, behind a switch outside the loop):

- :func:`f32_rows`: each block's 32 codes become their dequantized f32 values, rounded as
  ``dequantize`` rounds them (``d * (q - c)``, ``d * q + m``), in four 8-lane vectors,
  and every row of the tile keeps four 8-lane accumulators, ``acc_j = fma(w_j, x_j, acc_j)``;
  at the end of the row they are summed in one fixed tree.
- :func:`q8_rows`: llama.cpp's integer products on Q8_0/Q8_1-quantized activations.  Per block,
  ``pmaddubsw`` (unsigned x signed bytes -> i16 pairs) then ``pmaddwd`` by ones (-> 8 x i32)
  and an exact integer sum: the block's ``sumi``.  Q8_0's signed codes go through the
  ``|w|, sign(x, w)`` trick (``psignb``) as in ``ggml_vec_dot_q8_0_q8_0``; the nibble formats use their
  unsigned codes and subtract ``c * sum(x codes)`` (Q4_0's c = 8, Q5_0's 16): the same integer.
  Where a call's group holds an even number of blocks (``M`` = 1: two), the nibble formats decode
  two adjacent blocks at once (:func:`_nibble_pair`: one ``and`` and one shift for 64 codes, x's
  halves swapped to match), exactly the same integers: Q4_0 at ``M`` = 1 (1024 x 4096, one
  thread, in cache) 188-196 -> 150-155 us, Q4_1 208-212 -> 178-186.  Then in
  f32, block after block: ``acc += sumi * (d_w * d_x)`` (``+ m_w * s_x`` for Q4_1/Q5_1).  That
  serial f32 sum (one ``addss`` latency a block) is the scalar reference's numerics and bounds a
  row: everything else runs 8 (block, row) pairs at a time beside it (:func:`q8_rows`).

Every row of ``x`` goes through the same instructions whatever the tile and its place in it,
so results are batch-invariant; nothing here carries fast-math flags, so LLVM may not reorder.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ...dtypes import DType
from ...kernels.quant import QK, _LEGACY
from . import cpu, simd

I8, I16, I32, I64, F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
V8F, V8I, V32B = ir.VectorType(F32, 8), ir.VectorType(I32, 8), ir.VectorType(I8, 32)
V16B, V16S = ir.VectorType(I8, 16), ir.VectorType(I16, 16)

#: (block, row) pairs whose integer sums :func:`q8_rows` folds together: one <8 x i32>.
GROUP = 8
#: format code (the run-time argument of the intrinsics) -> element type.
FORMATS = {0: DType.Q8_0, 1: DType.Q4_0, 2: DType.Q4_1, 3: DType.Q5_0, 4: DType.Q5_1}


def centre(fmt) -> int:
    """What a symmetric format subtracts from its unsigned codes (Q8_0's are signed; the affine
    formats' stay unsigned, their min ``m`` does the shifting)."""
    return 0 if fmt.affine or fmt.bits == 8 else fmt.offset


def _i(v, ty=I64):
    return ir.Constant(ty, v)


def _vec(ty, values):
    return ir.Constant(ty, [ir.Constant(ty.element, v) for v in values])


def _splat(builder, value, ty):
    one = builder.insert_element(ir.Constant(ir.VectorType(value.type, 1), ir.Undefined), value, _i(0, I32))
    return builder.shuffle_vector(one, one, _vec(ir.VectorType(I32, ty.count), [0] * ty.count))


def _load(builder, base, offset, ty, align=1):
    """The ``ty`` at byte ``offset`` of ``base`` (an i8*)."""
    return builder.load(builder.bitcast(builder.gep(base, [offset]), ty.as_pointer()), align=align)


def _f16(builder, blk, at):
    return _load(builder, blk, _i(at), ir.HalfType())


def _half(builder, blk, at):
    return builder.fpext(_f16(builder, blk, at), F32)


def _call(builder, name, ret, *args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def _codes(builder, blk, fmt) -> ir.Value:
    """The block's 32 codes as bytes: signed for Q8_0, unsigned (with the fifth bit) otherwise."""
    body = fmt.scales + fmt.high_bits
    if fmt.bits == 8:
        return _load(builder, blk, _i(body), V32B)
    packed = _load(builder, blk, _i(body), V16B)
    low = builder.and_(packed, _vec(V16B, [15] * 16))
    high = builder.lshr(packed, _vec(V16B, [4] * 16))
    q = builder.shuffle_vector(low, high, _vec(ir.VectorType(I32, 32), range(32)))
    if fmt.bits == 5:  # bit j of the little-endian qh (bit j % 8 of its byte j // 8): element j's 16
        qh = _load(builder, blk, _i(fmt.scales), ir.VectorType(I8, 4))
        spread = builder.shuffle_vector(qh, qh, _vec(ir.VectorType(I32, 32), [j // 8 for j in range(32)]))
        bit = builder.and_(spread, _vec(V32B, [((1 << j % 8) ^ 0x80) - 0x80 for j in range(32)]))
        none = ir.Constant(V32B, None)
        q = builder.or_(q, builder.select(builder.icmp_unsigned("!=", bit, none), _vec(V32B, [16] * 32), none))
    return q


def _values(builder, blk, fmt) -> list[ir.Value]:
    """The block's 32 dequantized values as four <8 x float>, rounded as ``dequantize`` rounds."""
    q = _codes(builder, blk, fmt)
    d = _splat(builder, _half(builder, blk, 0), V8F)
    if fmt.affine:
        m = _splat(builder, _half(builder, blk, 2), V8F)
    elif centre(fmt):  # d * (q - c) as fma(q, d, -c * d): -c * d is exact (c = 8 or 16), so is
        # q * d - c * d before fma's one rounding: dequantize's rounding, one op fewer
        shift = _splat(builder, builder.fmul(_half(builder, blk, 0), ir.Constant(F32, -centre(fmt))), V8F)
    out = []
    for j in range(4):
        part = builder.shuffle_vector(q, q, _vec(ir.VectorType(I32, 8), range(8 * j, 8 * j + 8)))
        code = builder.sitofp(builder.sext(part, V8I) if fmt.bits == 8 else builder.zext(part, V8I), V8F)
        if fmt.affine:  # two roundings, as dequantize's d * q + m
            out.append(builder.fadd(builder.fmul(code, d), m))
        elif centre(fmt):
            out.append(_call(builder, "llvm.fma.v8f32", V8F, code, d, shift))
        else:
            out.append(builder.fmul(code, d))
    return out


def dot_u8_s8(builder, u, s) -> ir.Value:
    """The <8 x i32> sums of 4 adjacent products of unsigned bytes ``u`` and signed ``s`` (32 each):
    ``vpdpbusd`` where the CPU has VNNI, else ``pmaddubsw`` then ``pmaddwd`` by ones.  Equal: the
    16-bit pair sums of ``pmaddubsw`` never saturate here (|codes| <= 128 times |x codes| <= 127)."""
    if cpu.VNNI:
        fn = "llvm.x86.avx512.vpdpbusd.256"
        return _call(builder, fn, V8I, ir.Constant(V8I, None), builder.bitcast(u, V8I), builder.bitcast(s, V8I))
    pairs = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", V16S, u, s)
    return _call(builder, "llvm.x86.avx2.pmadd.wd", V8I, pairs, _vec(V16S, [1] * 16))


def dot_add_u8_s8(builder, acc, u, s) -> ir.Value:
    """``acc`` plus :func:`dot_u8_s8` of ``u`` and ``s``: one ``vpdpbusd`` (its accumulator) with VNNI."""
    if cpu.VNNI:
        fn = "llvm.x86.avx512.vpdpbusd.256"
        return _call(builder, fn, V8I, acc, builder.bitcast(u, V8I), builder.bitcast(s, V8I))
    return builder.add(acc, dot_u8_s8(builder, u, s))


def _nibble_pair(builder, blk0, blk1, fmt):
    """Two adjacent blocks' codes (unsigned; the fifth bit too) as two <32 x i8>: their first 16
    elements side by side (block 0's, then block 1's), and their last 16 likewise.  Each half is
    one 32-byte load's worth of nibbles, so one ``and`` / shift decodes 64 codes, where one block
    at a time needs a shuffle to put its low and high nibbles together (:func:`_codes`)."""
    body = fmt.scales + fmt.high_bits
    packed = _concat(builder, [_load(builder, blk, _i(body), V16B) for blk in (blk0, blk1)])
    low = builder.and_(packed, _vec(V32B, [15] * 32))
    high = builder.and_(builder.lshr(packed, _vec(V32B, [4] * 32)), _vec(V32B, [15] * 32))
    if fmt.bits == 5:  # element e of half h: bit 16 h + e of its block's little-endian qh
        qh = _concat(builder, [_load(builder, blk, _i(fmt.scales), ir.VectorType(I8, 4)) for blk in (blk0, blk1)])
        none, five = ir.Constant(V32B, None), _vec(V32B, [16] * 32)
        bit = _vec(V32B, [((1 << e % 8) ^ 0x80) - 0x80 for e in range(16)] * 2)
        halves = []
        for h, codes in enumerate((low, high)):
            spread = builder.shuffle_vector(qh, qh, _vec(ir.VectorType(I32, 32), [4 * (j // 16) + 2 * h + j % 16 // 8
                                                                                  for j in range(32)]))
            hit = builder.icmp_unsigned("!=", builder.and_(spread, bit), none)
            halves.append(builder.or_(codes, builder.select(hit, five, none)))
        low, high = halves
    return low, high


def _x_pair(builder, xrow, at):
    """The x codes of two adjacent blocks at byte ``at`` of ``xrow`` in :func:`_nibble_pair`'s order."""
    x0, x1 = _load(builder, xrow, at, V32B), _load(builder, xrow, builder.add(at, _i(QK)), V32B)
    mask = ir.VectorType(I32, 32)
    return (builder.shuffle_vector(x0, x1, _vec(mask, [*range(16), *range(32, 48)])),
            builder.shuffle_vector(x0, x1, _vec(mask, [*range(16, 32), *range(48, 64)])))


def _pair_row_sums(builder, pairs, order):
    """Lane sums of four <8 x i32>, each two 4-lane sums (lanes 0-3 and 4-7), as one <8 x i32>:
    two levels of ``phaddd`` leave [every vector's first sum | every vector's second], then lane
    ``i`` of the result is lane ``order[i]`` of that (exact: integers)."""
    hadd = "llvm.x86.avx2.phadd.d"
    low, high = (_call(builder, hadd, V8I, pairs[i], pairs[i + 1]) for i in (0, 2))
    sums = _call(builder, hadd, V8I, low, high)
    if list(order) == list(range(8)):
        return sums
    return builder.shuffle_vector(sums, sums, _vec(ir.VectorType(I32, 8), order))


def _array(context, builder, ty, value):
    a = context.make_array(ty)(context, builder, value)
    return a, cgutils.unpack_tuple(builder, a.shape, ty.ndim), cgutils.unpack_tuple(builder, a.strides, ty.ndim)


def _by_format(builder, code, body):
    """Emit ``body(fmt)`` once per format, each behind ``code == its number``."""
    for number, dtype in FORMATS.items():
        with builder.if_then(builder.icmp_signed("==", code, _i(number))):
            body(_LEGACY[dtype], dtype.block_bytes)


def _hsum(builder, accs):
    """Four <8 x float> summed in one fixed order: vectors pairwise, then lanes pairwise."""
    v = builder.fadd(builder.fadd(accs[0], accs[1]), builder.fadd(accs[2], accs[3]))
    lanes = [builder.extract_element(v, _i(i, I32)) for i in range(8)]
    while len(lanes) > 1:
        lanes = [builder.fadd(lanes[i], lanes[i + 1]) for i in range(0, len(lanes), 2)]
    return lanes[0]


def f32_rows(rows: int):
    """``f32_rows(w, x, out, n, m, nb, fmt)``: ``out[m + r, n] = x[m + r] . W[n]`` for r < rows."""

    @intrinsic
    def run(typingctx, w, x, out, n, m, nb, fmt):
        def codegen(context, builder, sig, args):
            (wa, _, wst), (xa, (_, k), _), (oa, (_, ncols), _) = (
                _array(context, builder, t, v) for t, v in zip(sig.args[:3], args[:3]))
            n_, m_, nb_, code = args[3:]
            row = builder.gep(builder.bitcast(wa.data, I8.as_pointer()), [builder.mul(n_, wst[0])])
            xs = [builder.bitcast(builder.gep(xa.data, [builder.mul(builder.add(m_, _i(r)), k)]), I8.as_pointer())
                  for r in range(rows)]
            accs = [[cgutils.alloca_once_value(builder, ir.Constant(V8F, None)) for _ in range(4)]
                    for _ in range(rows)]

            def loop(fmt, bb):
                with cgutils.for_range(builder, nb_) as blocks:
                    b = blocks.index
                    simd.prefetch_ahead(builder, row, builder.mul(b, _i(bb)), bb)
                    w = _values(builder, builder.gep(row, [builder.mul(b, _i(bb))]), fmt)
                    at = builder.mul(b, _i(4 * QK))
                    for r in range(rows):
                        for j in range(4):
                            xv = _load(builder, xs[r], builder.add(at, _i(32 * j)), V8F, 4)
                            acc = builder.load(accs[r][j])
                            builder.store(_call(builder, "llvm.fma.v8f32", V8F, w[j], xv, acc), accs[r][j])

            _by_format(builder, code, loop)
            for r in range(rows):
                where = builder.add(builder.mul(builder.add(m_, _i(r)), ncols), n_)
                builder.store(_hsum(builder, [builder.load(a) for a in accs[r]]), builder.gep(oa.data, [where]))
            return context.get_dummy_value()

        return types.void(w, x, out, n, m, nb, fmt), codegen

    return run


def _concat(builder, parts):
    """Equal-length vectors (a power of two of them) as one, in order."""
    while len(parts) > 1:
        n = parts[0].type.count
        mask = _vec(ir.VectorType(I32, 2 * n), range(2 * n))
        parts = [builder.shuffle_vector(parts[i], parts[i + 1], mask) for i in range(0, len(parts), 2)]
    return parts[0]


def _spread(builder, halves, rows):
    """f16 scalars, each on ``rows`` lanes in order, as one f32 vector (one conversion for all)."""
    v = ir.Constant(ir.VectorType(ir.HalfType(), len(halves)), ir.Undefined)
    for g, value in enumerate(halves):
        v = builder.insert_element(v, value, _i(g, I32))
    spread = _vec(ir.VectorType(I32, len(halves) * rows), [g for g in range(len(halves)) for _ in range(rows)])
    return builder.fpext(builder.shuffle_vector(v, v, spread), ir.VectorType(F32, len(halves) * rows))


def _pair_sums(builder, a, b):
    """<8 x i32> whose lanes 0-3 are the sums of a's lane pairs and 4-7 of b's."""
    mask = ir.VectorType(I32, 8)
    even = builder.shuffle_vector(a, b, _vec(mask, range(0, 16, 2)))
    return builder.add(even, builder.shuffle_vector(a, b, _vec(mask, range(1, 16, 2))))


def _row_sums(builder, quads):
    """The lane sums of each <8 x i32> in ``quads`` (1, 2, 4 or 8 of them) as one <rows x i32>,
    in order: pairwise folds that keep every row's partial sums together (exact: integers)."""
    rows = len(quads)
    if rows == 8:  # phaddd within 128-bit halves, the halves added once at the end: 9 ops, not 14
        sums = [_call(builder, "llvm.x86.avx2.phadd.d", V8I, quads[i], quads[i + 1]) for i in range(0, 8, 2)]
        sums = [_call(builder, "llvm.x86.avx2.phadd.d", V8I, sums[i], sums[i + 1]) for i in (0, 2)]
        mask = ir.VectorType(I32, 8)
        halves = [builder.shuffle_vector(*sums, _vec(mask, [*range(h, h + 4), *range(h + 8, h + 12)])) for h in (0, 4)]
        return builder.add(*halves)
    while len(quads) > 1:
        quads = [_pair_sums(builder, quads[i], quads[i + 1]) for i in range(0, len(quads), 2)]
    v = quads[0]
    for _ in range(3 - rows.bit_length() + 1):  # until one lane per row: log2(8 / rows) folds
        v = _pair_sums(builder, v, v)
    return builder.shuffle_vector(v, v, _vec(ir.VectorType(I32, rows), range(rows)))


def q8_rows(rows: int, wrows: int = 1):
    """``q8_rows(w, xq, xd, xs, xsum, out, n, m, fmt)``: ``out[m + r, n + j] = x[m + r] . W[n + j]``
    for ``r < rows``, ``j < wrows``, on activations quantized per block: codes ``xq`` int8 [M, K];
    per block and row (transposed, so a tile's rows are adjacent), scales ``xd`` and sums ``xs``
    (Q8_1's ``s``) f32 [nb, M], code sums ``xsum`` int32 [nb, M].

    Blocks go ``GROUP // (rows * wrows)`` at a time: the integer sums of their 8 (block, weight
    row, row) triples are folded together into one <8 x i32> and their f32 products
    ``sumi * (d_w * d_x)`` run as one <8 x float>; then each block's lanes are added to the
    <wrows * rows x float> accumulator, block after block.  Each lane does exactly what a lone
    (row, weight row) does, in the same order.  Several weight rows (``wrows``) at ``M`` = 1 give
    the serial f32 sums independent chains to overlap: one chain is one ``addss`` latency a block."""
    tile_n = rows * wrows
    vec_f = ir.VectorType(F32, tile_n)
    group = GROUP // tile_n

    @intrinsic
    def run(typingctx, w, xq, xd, xs, xsum, out, n, m, fmt):
        def codegen(context, builder, sig, args):
            arrays = [_array(context, builder, t, v) for t, v in zip(sig.args[:6], args[:6])]
            (wa, _, wst), (qa, (_, k), _), (da, (nb, mt), _), (sa, _, _), (ca, _, _), (oa, (_, ncols), _) = arrays
            n_, m_, code = args[6:]
            base = builder.bitcast(wa.data, I8.as_pointer())
            wrow = [builder.gep(base, [builder.mul(builder.add(n_, _i(j)), wst[0])]) for j in range(wrows)]
            ahead = builder.mul(_i(wrows), wst[0])
            xrows = [builder.gep(qa.data, [builder.mul(builder.add(m_, _i(r)), k)]) for r in range(rows)]
            acc = cgutils.alloca_once_value(builder, ir.Constant(vec_f, None))

            def tile(ptr, at, ty):
                return builder.load(builder.bitcast(builder.gep(ptr, [at]), ty.as_pointer()), align=4)

            def blocks(fmt, bb, first, count):
                """Blocks ``first .. first + count`` (count * tile_n = 1..8 lanes) into ``acc``."""
                lanes = count * tile_n
                vf, vi = ir.VectorType(F32, lanes), ir.VectorType(I32, lanes)
                quads, dw, mw = [], [], []
                if wrows == 1:  # a row read in order: its blocks ahead (several rows: the next tile's, below)
                    simd.prefetch_ahead(builder, wrow[0], builder.mul(first, _i(bb)), count * bb)
                paired = fmt.bits != 8 and count == GROUP // tile_n and count % 2 == 0
                for g in range(count if not paired else 0):
                    b = builder.add(first, _i(g))
                    for j in range(wrows):
                        blk = builder.gep(wrow[j], [builder.mul(b, _i(bb))])
                        if wrows > 1:  # the next tile's block: interleaved rows defeat the hardware's prefetcher
                            simd.prefetch(builder, blk, ahead, 3)
                        q = _codes(builder, blk, fmt)
                        if fmt.bits == 8:  # |w| unsigned, x carrying w's sign: pmaddubsw's operands
                            signs, q = q, _call(builder, "llvm.x86.avx2.psign.b", V32B, q, q)
                        for r in range(rows):
                            xv = _load(builder, xrows[r], builder.mul(b, _i(QK)), V32B)
                            if fmt.bits == 8:
                                xv = _call(builder, "llvm.x86.avx2.psign.b", V32B, xv, signs)
                            quads.append(dot_u8_s8(builder, q, xv))
                        dw.append(_f16(builder, blk, 0))
                        if fmt.affine:
                            mw.append(_f16(builder, blk, 2))

                for p in range(count // 2 if paired else 0):  # blocks 2p, 2p + 1 of the group together
                    b = builder.add(first, _i(2 * p))
                    for j in range(wrows):
                        blks = [builder.gep(wrow[j], [builder.mul(builder.add(b, _i(s)), _i(bb))]) for s in (0, 1)]
                        if wrows > 1:
                            for blk in blks:
                                simd.prefetch(builder, blk, ahead, 3)
                        low, high = _nibble_pair(builder, *blks, fmt)
                        for r in range(rows):
                            xlo, xhi = _x_pair(builder, xrows[r], builder.mul(b, _i(QK)))
                            quads.append(dot_add_u8_s8(builder, dot_u8_s8(builder, low, xlo), high, xhi))
                    for s in (0, 1):  # the scales in lane order: block, then weight row
                        for j in range(wrows):
                            blk = builder.gep(wrow[j], [builder.mul(builder.add(b, _i(s)), _i(bb))])
                            dw.append(_f16(builder, blk, 0))
                            if fmt.affine:
                                mw.append(_f16(builder, blk, 2))

                def per_row(ptr, ty):  # the [nb, M] entries of the tile's rows, in lane order
                    at = [builder.add(builder.mul(builder.add(first, _i(g)), mt), m_) for g in range(count)]
                    return _concat(builder, [tile(ptr, a, ir.VectorType(ty, rows)) for a in at for _ in range(wrows)])

                if paired:  # quads[(p * wrows + j) * rows + r] holds lanes (2p, j, r) and (2p + 1, j, r)
                    lane = {}
                    for t in range(len(quads)):
                        p, i = divmod(t, tile_n)
                        lane[(2 * p) * tile_n + i], lane[(2 * p + 1) * tile_n + i] = t, 4 + t
                    sumi = _pair_row_sums(builder, quads, [lane[i] for i in range(8)])
                else:
                    sumi = _row_sums(builder, quads)
                if centre(fmt):
                    sumi = builder.sub(sumi, builder.mul(per_row(ca.data, I32), _vec(vi, [centre(fmt)] * lanes)))
                scale = builder.fmul(_spread(builder, dw, rows), per_row(da.data, F32))
                t = builder.fmul(builder.sitofp(sumi, vf), scale)
                if fmt.affine:
                    t = builder.fadd(t, builder.fmul(_spread(builder, mw, rows), per_row(sa.data, F32)))
                for g in range(count):
                    lanes_g = _vec(ir.VectorType(I32, tile_n), range(g * tile_n, (g + 1) * tile_n))
                    part = builder.shuffle_vector(t, t, lanes_g)
                    builder.store(builder.fadd(builder.load(acc), part), acc)

            def loop(fmt, bb):
                grouped = builder.mul(builder.sdiv(nb, _i(group)), _i(group))
                with cgutils.for_range_slice(builder, _i(0), grouped, _i(group)) as (b, _):
                    blocks(fmt, bb, b, group)
                with cgutils.for_range_slice(builder, grouped, nb, _i(1)) as (b, _):
                    blocks(fmt, bb, b, 1)

            _by_format(builder, code, loop)
            total = builder.load(acc)
            for j in range(wrows):
                for r in range(rows):
                    where = builder.add(builder.mul(builder.add(m_, _i(r)), ncols), builder.add(n_, _i(j)))
                    builder.store(builder.extract_element(total, _i(j * rows + r, I32)), builder.gep(oa.data, [where]))
            return context.get_dummy_value()

        return types.void(w, xq, xd, xs, xsum, out, n, m, fmt), codegen

    return run
