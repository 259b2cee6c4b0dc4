"""The compiled program's loop: every instruction of a pass in order, in one launch of numba's pool.

:func:`execute` plans the call's stages (:func:`_stages`), then launches :func:`_work` on every
thread.  The instructions become stages of tasks: a product's contiguous runs of weight-row chunks,
one a thread (a thread's rows one stream, as numba's ``prange`` hands them out); the attention's
segments, then the pieces of the keys of the segments too long for one thread, then their merges;
every other instruction one task.  A thread takes tickets in order from an atomic counter and
starts a task once every task of the stages before it is done (:mod:`..compiled.spin`).  One
launch a pass rather than one a product: the pool's idle threads sleep, and waking one after the
serial work between two products (a norm, the attention of a short context) costs 2-15 us each
time.  Each task calls the very compiled functions the steps call alone, in the same order: the
same bits.

An instruction's fields are read by name (:mod:`.instructions`).  The weight table holds one row a
weight: ``[address, elements, format code]`` for a float-tile weight (the code a
:data:`..compiled.floats.FORMATS` index, so that one compile serves every float format) or a norm's
F32 vector, ``[address, rows, row bytes]`` for block weights (K-quants, legacy blocks).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic, overload

from ..compiled import attention as compiled_attention
from ..compiled import ahead, cpu, floats, kquants, launch, legacy, spin
from ..compiled.cache import jit
from ..compiled.registry import SERIAL_BYTES, block_sums, joint_chunks, joint_part
from ..compiled.kv_q8 import row_elements
from ..compiled.rows import element_at, f32_at, rms_rows, rope_append_attend, silu_mul, skip_rms_rows
from .instructions import (ADD, ADD_A, ADD_B, ADD_OUT, ATT_CACHE, ATT_CAUSAL, ATT_HEAD_DIM, ATT_HEADS, ATT_K,
                           ATT_K_ROT, ATT_KV_HEADS, ATT_OUT, ATT_Q, ATT_Q_ROT, ATT_ROPE_DIM, ATT_ROPE_HEAD_DIM, ATT_V,
                           ATT_WINDOW, ATTENTION, BLOCKS_KIND0, BLOCKS_KIND1, BLOCKS_KIND2, BLOCKS_Q8, JOINT, K_BLOCKS,
                           L_BLOCKS, MANY_COUNT, MANY_OUT0, MANY_OUT1, MANY_OUT2, MANY_W0, MANY_W1, MANY_W2, MANY_X,
                           PRODUCT, PRODUCT_OUT, PRODUCT_W, PRODUCT_X, RMS, RMS_EPS, RMS_OUT, RMS_SCALE, RMS_X, SILU,
                           SILU_GATE, SILU_UP, SKIP, SKIP_EPS, SKIP_OUT, SKIP_RESIDUAL, SKIP_SCALE, SKIP_TOTAL, SKIP_X)

#: The float formats' codes in the weight table, and each one's compile-time choice: a product
#: branches on its weight's code, so that one compile of the program serves every float format.
F32_CODE, F16_CODE, BF16_CODE, Q8_0_CODE = (floats.FORMATS.index(f) for f in ("f32", "f16", "bf16", "q8_0"))
_F32, _F16, _BF16, _Q8_0 = (floats.SPECS((fmt, cpu.PATH)) for fmt in ("f32", "f16", "bf16", "q8_0"))

#: The kernels a program may call, each compiled into it only where the program's weights need it:
#: a program's ``kernels`` tuple holds :data:`ON` at a kernel's place when it does, :data:`OFF`
#: where it does not (their types differ), and :func:`_gated7` / :func:`_gated10` calls compile to nothing for OFF.  So a model of F32 weights compiles
#: the F32 tiles alone, not every family's code (the K-quant and legacy drivers were most of a
#: cold first ``generate``'s compile); each set of kernels compiles, and is cached, once.
KERNELS = ("f32", "f16", "bf16", "q8_0", "kquants_f32", "kquants_q8", "legacy_f32", "legacy_q8")
(TILES_F32, TILES_F16, TILES_BF16, TILES_Q8_0, KQUANT_F32, KQUANT_Q8, LEGACY_F32, LEGACY_Q8) = range(len(KERNELS))
#: A kernel's mark in ``kernels``: arrays (numba's parallel launch passes them through, where it
#: refuses None) told apart by their number of dims, a type-level fact.
ON, OFF = np.zeros(0, np.int8), np.zeros((0, 0), np.int8)


# ``call(on, ...)``: ``fn(...)`` where ``on`` is ON, compiled to nothing where it is OFF.  numba
# types an overload, and calls a closure, only with its arguments spelled out (no ``*args``), so
# there is one maker per arity.
def _gated7(fn):
    def call(on, a0, a1, a2, a3, a4, a5, a6):
        raise NotImplementedError("only in compiled code")

    def typed(on, a0, a1, a2, a3, a4, a5, a6):
        if on.ndim == 1:
            return lambda on, a0, a1, a2, a3, a4, a5, a6: fn(a0, a1, a2, a3, a4, a5, a6)
        return lambda on, a0, a1, a2, a3, a4, a5, a6: None
    overload(call)(typed)
    return call


def _gated10(fn):
    def call(on, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9):
        raise NotImplementedError("only in compiled code")

    def typed(on, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9):
        if on.ndim == 1:
            return lambda on, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9: fn(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9)
        return lambda on, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9: None
    overload(call)(typed)
    return call


@jit(nogil=True)
def _flat(arena, slots, s, m):
    """Value ``s``'s rows in the arena, flat (``slots[s]``: offset per row, width)."""
    return arena[slots[s, 0] * m:(slots[s, 0] + slots[s, 1]) * m]


@jit(nogil=True)
def _rows2d(arena, slots, s, m):
    return _flat(arena, slots, s, m).reshape((m, slots[s, 1]))


@jit(nogil=True)
def _weight(weights, i):
    """F32 vector ``i`` of the weight table (a norm's scale)."""
    return numba.carray(f32_at(weights[i, 0]), weights[i, 1])


@intrinsic
def _stored_at(typingctx, spec, address):
    """The pointer at ``address`` to a product weight's elements as ``spec``'s format stores
    them: f32, the u16 of F16 / BF16, or Q8_0's bytes."""
    element = {"f32": types.float32, "q8_0": types.uint8}.get(floats.SPECS.of(spec)[0], types.uint16)

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[1], context.get_value_type(sig.return_type))
    return types.CPointer(element)(spec, types.int64), codegen


@intrinsic
def _bytes_at(typingctx, address):
    """The u8 pointer at ``address`` (a K-quant weight's blocks)."""
    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_value_type(sig.return_type))
    return types.CPointer(types.uint8)(types.int64), codegen


@jit(nogil=True)
def _blocks(weights, i):
    """Block weight ``i`` of the weight table (a K-quant or legacy one): its rows of blocks."""
    return numba.carray(_bytes_at(weights[i, 0]), (weights[i, 1], weights[i, 2]))


@jit(nogil=True)
def _joint_blocks(c, slots, weights, arena, m):
    """A K_BLOCKS or L_BLOCKS instruction's weights, outputs and kinds (formats), the missing
    second and third as empty (no chunks) with the first's kind."""
    w0, o0 = _blocks(weights, c[MANY_W0]), _rows2d(arena, slots, c[MANY_OUT0], m)
    w1, o1, w2, o2 = w0[:0], o0[:, :0], w0[:0], o0[:, :0]
    if c[MANY_COUNT] >= 2:
        w1, o1 = _blocks(weights, c[MANY_W1]), _rows2d(arena, slots, c[MANY_OUT1], m)
    if c[MANY_COUNT] == 3:
        w2, o2 = _blocks(weights, c[MANY_W2]), _rows2d(arena, slots, c[MANY_OUT2], m)
    return w0, o0, c[BLOCKS_KIND0], w1, o1, c[BLOCKS_KIND1], w2, o2, c[BLOCKS_KIND2]


@jit(nogil=True)
def _matrix(spec, weights, i):
    """Product weight ``i`` of the weight table, flat, as its kernel reads it."""
    return numba.carray(_stored_at(spec, weights[i, 0]), weights[i, 1])


@jit(nogil=True, inline="always")
def _tiles(spec, x, weights, i, out, m, n, k, lo, hi):
    floats._rows(spec, x, _matrix(spec, weights, i), out, m, n, k, lo, hi)


_tiles_if = _gated10(_tiles)


@jit(nogil=True, inline="always")
def _float_rows(kernels, x, weights, i, out, m, n, k, lo, hi):
    """:func:`..compiled.floats._rows` of float product weight ``i``, in its format (rows ``lo``
    to ``hi``: whole chunks, a task's run of them in this weight)."""
    code = weights[i, 2]
    if code == F32_CODE:
        _tiles_if(kernels[TILES_F32], _F32, x, weights, i, out, m, n, k, lo, hi)
    elif code == F16_CODE:
        _tiles_if(kernels[TILES_F16], _F16, x, weights, i, out, m, n, k, lo, hi)
    elif code == BF16_CODE:
        _tiles_if(kernels[TILES_BF16], _BF16, x, weights, i, out, m, n, k, lo, hi)
    else:
        _tiles_if(kernels[TILES_Q8_0], _Q8_0, x, weights, i, out, m, n, k, lo, hi)


@jit(nogil=True, inline="always")
def _slot(joint, at):
    """Weight ``at`` of :func:`_joint_blocks`' tuple: its blocks, its output and its kind."""
    if at == 0:
        return joint[0], joint[1], joint[2]
    if at == 1:
        return joint[3], joint[4], joint[5]
    return joint[6], joint[7], joint[8]


# Parts ``first..last`` of a K_BLOCKS or L_BLOCKS instruction (the drivers of kquants.py and
# legacy.py: ``_k_threaded_joint``, ``_f32_joint`` and their q8 twins), ``x`` prepared once for
# them all: its block sums, or quantized (Q8_K; Q8_0 with each weight's lane sums scaled by its
# centre).
@jit(nogil=True)
def _k_f32_parts(x, joint, first, last, c0, c1, c2):
    n0, n1, n2 = joint[0].shape[0], joint[3].shape[0], joint[6].shape[0]
    xsum = block_sums(x, x.shape[1] // 32)
    for part in range(first, last):
        at, lo, hi = joint_part(part, c0, c1, c2, n0, n1, n2)
        w, out, kind = _slot(joint, at)
        kquants._k_rows(x, w, out, kind, cpu.AVX2, xsum, lo, hi)


@jit(nogil=True)
def _k_q8_parts(x, joint, first, last, c0, c1, c2):
    n0, n1, n2 = joint[0].shape[0], joint[3].shape[0], joint[6].shape[0]
    q, dx, sums32, sums16 = kquants._quantize_q8_k(x)
    for part in range(first, last):
        at, lo, hi = joint_part(part, c0, c1, c2, n0, n1, n2)
        w, out, kind = _slot(joint, at)
        kquants._k_q8_rows(x, w, out, kind, cpu.AVX2, q, dx, sums16 if kind == 6 else sums32, lo, hi)


@jit(nogil=True)
def _legacy_f32_parts(x, joint, first, last, c0, c1, c2):
    n0, n1, n2 = joint[0].shape[0], joint[3].shape[0], joint[6].shape[0]
    xsum = block_sums(x, x.shape[1] // legacy.QK)
    for part in range(first, last):
        at, lo, hi = joint_part(part, c0, c1, c2, n0, n1, n2)
        w, out, fmt = _slot(joint, at)
        legacy._f32_rows(x, xsum, w, out, fmt, legacy.QK, lo, hi)


@jit(nogil=True)
def _legacy_q8_parts(x, joint, first, last, c0, c1, c2):
    n0, n1, n2 = joint[0].shape[0], joint[3].shape[0], joint[6].shape[0]
    xp, xn0, xn1, xn2, xd, xs = legacy._quantized_for(x, legacy.QK, joint[2], joint[5], joint[8])
    for part in range(first, last):
        at, lo, hi = joint_part(part, c0, c1, c2, n0, n1, n2)
        w, out, fmt = _slot(joint, at)
        legacy._q8_rows(xp, xn0 if at == 0 else xn1 if at == 1 else xn2, xd, xs, w, out, fmt, legacy.QK, lo, hi)


_k_f32_if, _k_q8_if = _gated7(_k_f32_parts), _gated7(_k_q8_parts)
_legacy_f32_if, _legacy_q8_if = _gated7(_legacy_f32_parts), _gated7(_legacy_q8_parts)


@jit(nogil=True, inline="always")
def _rope_append(spec, c, slots, kv, kv_like, cos, sin, arena, m, starts, positions, g, attend):
    """The attention chain's compiled call (:class:`..numba.AttentionChain`, which stores rows as
    the caches keep them: :func:`..compiled.kv_q8.stored_rows`) for segment ``g``
    (rows ``starts[g]:starts[g + 1]``, at ``positions[g]``) on its KV cache ``kv[c[ATT_CACHE], g]``,
    attending too if ``attend`` (:func:`_attends`; else the pieces' stages do, over the threads:
    the same bits)."""
    lo, hi, pos = starts[g], starts[g + 1], positions[g]
    k_buf, v_buf = _cache(c, slots, kv, kv_like, g)
    rope_append_attend(spec, _rows2d(arena, slots, c[ATT_Q], m)[lo:hi], _rows2d(arena, slots, c[ATT_K], m)[lo:hi],
                       _rows2d(arena, slots, c[ATT_V], m)[lo:hi], cos[lo:hi], sin[lo:hi], c[ATT_ROPE_HEAD_DIM],
                       c[ATT_ROPE_DIM], k_buf, v_buf, pos, c[ATT_HEADS], c[ATT_KV_HEADS], c[ATT_HEAD_DIM],
                       c[ATT_CAUSAL] != 0, c[ATT_WINDOW], attend, _rows2d(arena, slots, c[ATT_Q_ROT], m)[lo:hi],
                       _rows2d(arena, slots, c[ATT_K_ROT], m)[lo:hi], _rows2d(arena, slots, c[ATT_OUT], m)[lo:hi])


@jit(nogil=True)
def _cache(c, slots, kv, kv_like, g):
    """Segment ``g``'s K and V buffers of an ATTENTION instruction's cache (every row they hold).
    ``kv``: the caches' table (``[cache, segment]``: K address, V address, rows); ``kv_like``: an
    empty array of the element type they keep (F32, F16 as uint16 bits, or Q8_0 as its blocks'
    bytes, rows of ``width / 32 * 34``: a program per type)."""
    width, rows = row_elements(kv_like, slots[c[ATT_K], 1]), kv[c[ATT_CACHE], g, 2]
    return (numba.carray(element_at(kv_like, kv[c[ATT_CACHE], g, 0]), (rows, width)),
            numba.carray(element_at(kv_like, kv[c[ATT_CACHE], g, 1]), (rows, width)))


@jit(nogil=True)
def _attends(c, slots, starts, positions, g, threads):
    """Whether segment ``g`` of an ATTENTION instruction attends in its chain's call, on one
    thread (:func:`.compiled.attention.serial_on`), rather than in pieces over the threads."""
    rows = starts[g + 1] - starts[g]
    stop = positions[g] + rows
    return compiled_attention.serial_on(rows, stop, stop * slots[c[ATT_K], 1] * 4, threads)


@jit(nogil=True)
def _segment_pieces(c, starts, positions, g):
    """Segment ``g``'s pieces (:func:`.compiled.attention._pieces`): where each query row's start."""
    rows = starts[g + 1] - starts[g]
    return compiled_attention._pieces(rows, positions[g] + rows, c[ATT_CAUSAL] != 0, c[ATT_WINDOW])


@jit(nogil=True)
def _stored_bytes(weights, i, op):
    """Product weight ``i``'s work in bytes (of instruction ``op``): what it stores, times
    :data:`.kquants.COST` for a K-quant's (decoding its blocks costs more a byte)."""
    if op == K_BLOCKS:
        return weights[i, 1] * weights[i, 2] * kquants.COST
    if op == L_BLOCKS:
        return weights[i, 1] * weights[i, 2]
    code = weights[i, 2]
    return weights[i, 1] * (4 if code == F32_CODE else 1 if code == Q8_0_CODE else 2)


@jit(nogil=True)
def _product_parts(work_bytes, threads):
    """A product's tasks: one on a thread (:func:`.compiled.registry.serial`'s rule: the same
    bits either way, only the speed differs), else one a thread, each a contiguous run of its
    chunks (a thread's weight rows one stream, as numba's ``prange`` hands them out).  Four a
    thread, which a late thread would leave fewer of to wait on, measured 0.97-1.00x the time of
    the 125M f32 decode step and 1.07x (twice) of its Q4_K_M one; two a thread 0.99-1.00x f32."""
    return 1 if work_bytes < SERIAL_BYTES or threads == 1 else threads


@jit(nogil=True, inline="always")
def _stage(stages, s, i, phase, tasks):
    """Row ``s`` of the plan (:func:`_stages`), by element: assigning a row from a tuple or an
    array compiles numba's shape-error message, ~5 s of a cold compile."""
    stages[s, 0], stages[s, 1], stages[s, 2] = i, phase, tasks


@jit(nogil=True)
def _stages(code, slots, weights, m, starts, positions, threads):
    """The call's stages in order, each ``(instruction, phase, tasks)``, every task of one done
    before any of the next starts; ``pieces[i, 0, g]``: where segment ``g``'s attention tasks
    (:func:`.compiled.attention._tasks`) start among ATTENTION instruction ``i``'s
    (``pieces[i, 0, -1]`` in all; none where it attends whole), ``pieces[i, 1, g]`` where its
    pieces do (each task's results go to its rows' pieces)."""
    segments = positions.shape[0]
    stages = np.zeros((3 * code.shape[0], 3), np.int64)
    pieces = np.zeros((code.shape[0], 2, segments + 1), np.int64)
    s = 0
    for i in range(code.shape[0]):
        c = code[i]
        op, tasks = c[0], 1
        if op == PRODUCT:
            tasks = _product_parts(_stored_bytes(weights, c[PRODUCT_W], op) * m, threads)
        elif op == JOINT or op == K_BLOCKS or op == L_BLOCKS:
            nbytes = 0
            for j in range(c[MANY_COUNT]):
                nbytes += _stored_bytes(weights, c[MANY_W0 + 2 * j], op)
            tasks = _product_parts(nbytes * m, threads)
        elif op == ATTENTION:
            tasks = segments
            for g in range(segments):
                count, made = 0, 0
                if not _attends(c, slots, starts, positions, g, threads):
                    mine = _segment_pieces(c, starts, positions, g)
                    count, made = compiled_attention._tasks(mine).shape[0], mine[-1]
                pieces[i, 0, g + 1] = pieces[i, 0, g] + count
                pieces[i, 1, g + 1] = pieces[i, 1, g] + made
            if pieces[i, 0, -1]:
                _stage(stages, s, i, 0, tasks)
                _stage(stages, s + 1, i, 1, pieces[i, 0, -1])
                s += 2  # then phase 2, the merges: one task a segment
        _stage(stages, s, i, 2 if op == ATTENTION and pieces[i, 0, -1] else 0, tasks)
        s += 1
    return stages[:s], pieces


# Inlined into _work, the one function that calls it: compiled once, in _work's code.
@jit(nogil=True, inline="always")
def _task(c, phase, task, tasks, slots, weights, eps, kv, kv_like, cos, sin, arena, m, starts, positions, attention_spec,
          pieces, sums, stats, kernels):
    """Task ``task`` of ``tasks`` of instruction ``c``'s stage ``phase`` (:func:`_stages`)."""
    op = c[0]
    if op == RMS:
        rms_rows(_rows2d(arena, slots, c[RMS_X], m), _weight(weights, c[RMS_SCALE]), eps[c[RMS_EPS]],
                 _rows2d(arena, slots, c[RMS_OUT], m))
    elif op == SKIP:
        skip_rms_rows(_rows2d(arena, slots, c[SKIP_X], m), _rows2d(arena, slots, c[SKIP_RESIDUAL], m),
                      _weight(weights, c[SKIP_SCALE]), eps[c[SKIP_EPS]], _rows2d(arena, slots, c[SKIP_TOTAL], m),
                      _rows2d(arena, slots, c[SKIP_OUT], m))
    elif op == PRODUCT:
        n, k = slots[c[PRODUCT_OUT], 1], slots[c[PRODUCT_X], 1]
        chunks = (n + floats.CHUNK - 1) // floats.CHUNK
        _float_rows(kernels, _flat(arena, slots, c[PRODUCT_X], m), weights, c[PRODUCT_W], _flat(arena, slots, c[PRODUCT_OUT], m),
                    m, n, k, task * chunks // tasks * floats.CHUNK, min(n, (task + 1) * chunks // tasks * floats.CHUNK))
    elif op == JOINT:  # the weights' chunks in order, each in its weight's format (a missing third: none)
        x, k = _flat(arena, slots, c[MANY_X], m), slots[c[MANY_X], 1]
        n0, n1 = slots[c[MANY_OUT0], 1], slots[c[MANY_OUT1], 1]
        n2 = slots[c[MANY_OUT2], 1] if c[MANY_COUNT] == 3 else 0
        t0, t1 = (n0 + floats.CHUNK - 1) // floats.CHUNK, (n1 + floats.CHUNK - 1) // floats.CHUNK
        chunks = t0 + t1 + (n2 + floats.CHUNK - 1) // floats.CHUNK
        bounds = (0, t0, t0 + t1, chunks)
        first, last = task * chunks // tasks, (task + 1) * chunks // tasks
        for at in range(c[MANY_COUNT]):  # each weight's run of this task's chunks in one call: it hints a chunk's successor
            lo, hi = max(first, bounds[at]), min(last, bounds[at + 1])
            if lo < hi:
                n = slots[c[MANY_OUT0 + 2 * at], 1]
                _float_rows(kernels, x, weights, c[MANY_W0 + 2 * at], _flat(arena, slots, c[MANY_OUT0 + 2 * at], m), m, n, k,
                            (lo - bounds[at]) * floats.CHUNK, min(n, (hi - bounds[at]) * floats.CHUNK))
    elif op == K_BLOCKS or op == L_BLOCKS:  # kquants' and legacy's drivers: the weights' parts in order
        x = _rows2d(arena, slots, c[MANY_X], m)
        joint = _joint_blocks(c, slots, weights, arena, m)
        c0, c1, c2 = joint_chunks(joint[0].shape[0], joint[3].shape[0], joint[6].shape[0])
        first, last = task * (c0 + c1 + c2) // tasks, (task + 1) * (c0 + c1 + c2) // tasks
        q8 = c[BLOCKS_Q8] != 0
        if op == K_BLOCKS and q8:
            _k_q8_if(kernels[KQUANT_Q8], x, joint, first, last, c0, c1, c2)
        elif op == K_BLOCKS:
            _k_f32_if(kernels[KQUANT_F32], x, joint, first, last, c0, c1, c2)
        elif q8:
            _legacy_q8_if(kernels[LEGACY_Q8], x, joint, first, last, c0, c1, c2)
        else:
            _legacy_f32_if(kernels[LEGACY_F32], x, joint, first, last, c0, c1, c2)
    elif op == SILU:
        silu_mul(_flat(arena, slots, c[SILU_GATE], m), _flat(arena, slots, c[SILU_UP], m))
    elif op == ADD:
        a, b = _flat(arena, slots, c[ADD_A], m), _flat(arena, slots, c[ADD_B], m)
        out = _flat(arena, slots, c[ADD_OUT], m)
        for j in range(out.shape[0]):
            out[j] = a[j] + b[j]
    elif phase == 0:  # ATTENTION: segment ``task``'s rotations and cache rows, and its attention if whole
        _rope_append(attention_spec, c, slots, kv, kv_like, cos, sin, arena, m, starts, positions, task,
                     pieces[0, task + 1] == pieces[0, task])
    else:  # ATTENTION: one task of a segment's pieces (phase 1) or a segment's merge (phase 2)
        tasks_at, pieces_at = pieces[0], pieces[1]
        g = task if phase == 2 else np.searchsorted(tasks_at, task, side="right") - 1
        if tasks_at[g + 1] == tasks_at[g]:
            return
        lo, hi = starts[g], starts[g + 1]
        k_buf, v_buf = _cache(c, slots, kv, kv_like, g)
        at, stop, total = pieces_at[g], positions[g] + hi - lo, pieces_at[-1]
        heads, head_dim = c[ATT_HEADS], c[ATT_HEAD_DIM]
        mine = _segment_pieces(c, starts, positions, g)
        sums_g = sums[:total * heads * head_dim].reshape((total, heads * head_dim))[at:pieces_at[g + 1]]
        stats_g = stats[:total * 2 * heads].reshape((total, 2, heads))[at:pieces_at[g + 1]]
        if phase == 1:
            compiled_attention._attend_task(attention_spec, _rows2d(arena, slots, c[ATT_Q_ROT], m)[lo:hi],
                                            k_buf[:stop], v_buf[:stop], heads, c[ATT_KV_HEADS], head_dim,
                                            c[ATT_CAUSAL] != 0, c[ATT_WINDOW], mine, compiled_attention._tasks(mine),
                                            task - tasks_at[g], sums_g, stats_g)
        else:
            compiled_attention._merge(mine, sums_g, stats_g, heads, head_dim,
                                      _rows2d(arena, slots, c[ATT_OUT], m)[lo:hi])


#: :func:`execute`'s counters: tickets handed out, tasks finished (a cache line apart).
_CLAIMED, _DONE = 0, 8


@jit(nogil=True)
def _work(stages, counters, code, slots, weights, eps, kv, kv_like, cos, sin, arena, m, starts, positions,
          attention_spec, pieces, sums, stats, k0, k1, k2, k3, k4, k5, k6, k7):
    """One thread's share of a call: it takes the next ticket (a task, the stages' in order)
    until none is left, each once every task of the stages before it is done.  Tickets are
    taken in order, so the earliest unfinished one's thread never waits: no deadlock, whichever
    threads turn up (one thread alone does every task)."""
    kernels = (k0, k1, k2, k3, k4, k5, k6, k7)  # apart in the arguments: a parallel launch takes no nested tuple
    total = stages[-1, 2] + stages[-1, 3]
    s = 0
    while True:
        ticket = spin.fetch_add(counters, _CLAIMED)
        if ticket >= total:
            return
        while stages[s, 3] + stages[s, 2] <= ticket:
            s += 1
        spin.wait_until(counters, _DONE, stages[s, 3])
        i = stages[s, 0]
        _task(code[i], stages[s, 1], ticket - stages[s, 3], stages[s, 2], slots, weights, eps, kv, kv_like, cos, sin, arena,
              m, starts, positions, attention_spec, pieces[i], sums, stats, kernels)
        spin.fetch_add(counters, _DONE)


@jit(nogil=True)
def _prepare(code, slots, weights, m, starts, positions, threads):
    """A call's stages (:func:`_stages`, each with its first ticket), its attention pieces,
    their scratch and the counters, made before any thread starts."""
    planned, pieces = _stages(code, slots, weights, m, starts, positions, threads)
    stages = np.empty((planned.shape[0], 4), np.int64)  # (instruction, phase, tasks, first ticket)
    for s in range(stages.shape[0]):
        _stage(stages, s, planned[s, 0], planned[s, 1], planned[s, 2])
    stages[0, 3] = 0
    for s in range(1, stages.shape[0]):
        stages[s, 3] = stages[s - 1, 3] + stages[s - 1, 2]
    most = 1
    for i in range(code.shape[0]):
        if code[i, 0] == ATTENTION:
            most = max(most, pieces[i, 1, -1] * slots[code[i, ATT_Q_ROT], 1])
    return stages, pieces, np.empty(most, np.float32), np.empty(2 * most, np.float32), np.zeros(16, np.int64)


def execute(code, slots, weights, eps, kv, kv_like, cos, sin, arena, m, starts, positions, threads, attention_spec, kernels):
    """Every instruction of ``code`` in order (:class:`.runtime.Program` builds them), on ``threads`` threads that
    stay from the first task to the last (:func:`_work`), spinning between stages rather than
    going back to numba's pool: one launch a call, not one a product, and no sleeping thread to
    wake after each stretch of serial work (~2-15 us each: :mod:`.compiled.threads`); :func:`_work`
    called by its address (:mod:`..compiled.launch`), so that its code compiles once, not once
    more in each of the parallel launch's wrappers.  ``kernels``: the product kernels the code
    calls (:data:`KERNELS`)."""
    stages, pieces, sums, stats, counters = _prepare(code, slots, weights, m, starts, positions, threads)
    args = (stages, counters, code, slots, weights, eps, kv, kv_like, cos, sin, arena, m, starts, positions, attention_spec,
            pieces, sums, stats, *kernels)
    launch.run(_work, args, threads)


def ready(code, slots, weights, eps, kv, kv_like, cos, sin, arena, m, starts, positions, threads, attention_spec, kernels):
    """Whether :func:`execute` runs these arguments now without compiling here: its code loaded
    or in the cache, or compiling ahead not enabled (it then compiles on the call).  Else a child
    compiles it (:mod:`.compiled.ahead`), and False until the child ends."""
    if not ahead.enabled():
        return True
    given = tuple(numba.typeof(a) for a in (code, slots, weights, eps, kv, kv_like, cos, sin, arena, m, starts, positions,
                                            threads, attention_spec, *kernels))
    return _loaded(given) or not ahead.running(__name__, [ahead.describe(t) for t in given])


def compile_ahead(described: list) -> None:
    """The child's part (:func:`.compiled.ahead.main`): :func:`execute`'s code for the described
    argument types, compiled into the cache."""
    given = tuple(ahead.rebuild(t) for t in described)
    prepare = _prepare_types(given)
    _prepare.compile(prepare)
    work, launched = _signatures(given, _prepare.overloads[prepare].signature.return_type)
    _work.compile(work)
    launch._launch.compile(launched)


def _loaded(given: tuple) -> bool:
    """Whether :func:`execute`'s three functions for ``given`` argument types are loaded (from
    this process or the cache; never compiled here)."""
    prepared = ahead.load(_prepare, _prepare_types(given))
    if prepared is None:
        return False
    work, launched = _signatures(given, prepared.signature.return_type)
    return ahead.load(_work, work) is not None and ahead.load(launch._launch, launched) is not None


def _prepare_types(given: tuple) -> tuple:
    code, slots, weights, _, _, _, _, _, _, m, starts, positions, threads = given[:13]
    return code, slots, weights, m, starts, positions, threads


def _signatures(given: tuple, prepared) -> tuple:
    """:func:`_work`'s and :func:`_launch`'s argument types, as :func:`execute` calls them, from
    its own argument types and :func:`_prepare`'s return type."""
    code, slots, weights, eps, kv, kv_like, cos, sin, arena, m, starts, positions, threads, spec, *kernels = given
    stages, pieces, sums, stats, counters = prepared.types
    work = (stages, counters, code, slots, weights, eps, kv, kv_like, cos, sin, arena, m, starts, positions, spec, pieces,
            sums, stats, *kernels)
    return work, launch.signature(work, threads)
