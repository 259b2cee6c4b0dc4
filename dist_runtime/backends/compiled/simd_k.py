"""LLVM vector IR for the K-quant kernels' AVX2 path (:mod:`.kquants`).

Written as ``numba.extending.intrinsic`` so that the vector shape is what we say, not what LLVM's
vectorizer makes of a loop (it vectorizes differently for different trip counts, which would make
results depend on ``M``).  Only generic LLVM intrinsics (``llvm.fma``) are used: the IR compiles
on any CPU, though it is fast only with AVX2 and FMA.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

F32 = ir.FloatType()
I8 = ir.IntType(8)
I32 = ir.IntType(32)
V8F = ir.VectorType(F32, 8)
V8I8 = ir.VectorType(I8, 8)
V8I = ir.VectorType(I32, 8)


def _data(context, builder, ty, value):
    return context.make_array(ty)(context, builder, value).data


def _vec_ptr(builder, base, at, vt):
    return builder.bitcast(builder.gep(base, [at]), vt.as_pointer())


def _splat(builder, scalar, vt):
    one = builder.insert_element(ir.Constant(vt, ir.Undefined), scalar, ir.Constant(I32, 0))
    return builder.shuffle_vector(one, ir.Constant(vt, ir.Undefined), ir.Constant(ir.VectorType(I32, vt.count), [0] * vt.count))


@intrinsic
def fma_lanes_avx2(typingctx, acc, a, x, at, n):
    """``acc[l] = fma(a[i + l], x[at + i + l], acc[l])`` for the 32 lanes, ``i`` in steps of 32
    below ``n``: four ``<8 x float>`` accumulators, so four independent fma chains."""
    def codegen(context, builder, sig, args):
        acc_v, a_v, x_v, at_v, n_v = args
        intp = context.get_value_type(types.intp)
        accp = _data(context, builder, sig.args[0], acc_v)
        ap = _data(context, builder, sig.args[1], a_v)
        xp = builder.gep(_data(context, builder, sig.args[2], x_v), [context.cast(builder, at_v, sig.args[3], types.intp)])
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V8F, [V8F] * 3), "llvm.fma.v8f32")
        slots = []
        for v in range(4):
            slot = cgutils.alloca_once(builder, V8F)
            builder.store(builder.load(_vec_ptr(builder, accp, ir.Constant(intp, 8 * v), V8F), align=4), slot)
            slots.append(slot)
        stop = context.cast(builder, n_v, sig.args[4], types.intp)
        with cgutils.for_range_slice(builder, ir.Constant(intp, 0), stop, ir.Constant(intp, 32), intp) as (i, _):
            for v, slot in enumerate(slots):
                at = builder.add(i, ir.Constant(intp, 8 * v))
                av = builder.load(_vec_ptr(builder, ap, at, V8F), align=4)
                xv = builder.load(_vec_ptr(builder, xp, at, V8F), align=4)
                builder.store(builder.call(fma, [av, xv, builder.load(slot)]), slot)
        for v, slot in enumerate(slots):
            builder.store(builder.load(slot), _vec_ptr(builder, accp, ir.Constant(intp, 8 * v), V8F), align=4)
        return context.get_dummy_value()

    return types.void(acc, a, x, at, n), codegen


@intrinsic
def decode_q4_k_avx2(typingctx, row, qs, ds, dm, buf):
    """The 256 values of a Q4_K super-block whose nibbles start at ``row[qs]`` into ``buf``:
    element ``64 c + 32 s + l`` is ``ds[2c + s] * (nibble s of row[qs + 32 c + l]) - dm[2c + s]``
    (the products of ``kernels.quant._decode_q4_k``, so the same f32 bits)."""
    def codegen(context, builder, sig, args):
        row_v, qs_v, ds_v, dm_v, buf_v = args
        intp = context.get_value_type(types.intp)
        q = builder.gep(_data(context, builder, sig.args[0], row_v), [context.cast(builder, qs_v, sig.args[1], types.intp)])
        dsp = _data(context, builder, sig.args[2], ds_v)
        dmp = _data(context, builder, sig.args[3], dm_v)
        out = _data(context, builder, sig.args[4], buf_v)
        low = ir.Constant(V8I, [15] * 8)
        four = ir.Constant(V8I, [4] * 8)
        for c in range(4):
            codes = [builder.zext(builder.load(_vec_ptr(builder, q, ir.Constant(intp, 32 * c + 8 * g), V8I8), align=1), V8I)
                     for g in range(4)]
            for s in range(2):
                j = ir.Constant(intp, 2 * c + s)
                scale = _splat(builder, builder.load(builder.gep(dsp, [j])), V8F)
                shift = _splat(builder, builder.load(builder.gep(dmp, [j])), V8F)
                for g, code in enumerate(codes):
                    nib = builder.and_(builder.lshr(code, four) if s else code, low)
                    val = builder.fsub(builder.fmul(scale, builder.sitofp(nib, V8F)), shift)
                    builder.store(val, _vec_ptr(builder, out, ir.Constant(intp, 64 * c + 32 * s + 8 * g), V8F), align=4)
        return context.get_dummy_value()

    return types.void(row, qs, ds, dm, buf), codegen
