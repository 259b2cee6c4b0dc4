"""A run of a pass's steps as one compiled call: the executor's program.

A 125M Llama's f32 decode step is ~147 steps.  Its products, called back to back from Python
with no other work between them, took 11.8 ms (34 GB/s); the step took 14.2 (session 18, one
process, medians of 30): the other ~2.4 ms were Python -- the executor's loop, each kernel's
checks and allocations, the attention chain's position and KV cache bookkeeping -- whose code
and data come back cold after every product streams its weight through the caches (a line of
the attention chain's Python ~2-8 us there, against ~0.3 warm).  The program runs the longest
run of steps it knows as one call of :func:`_execute` (its plan, then one launch of :func:`_work`),
a loop over fixed instructions that calls the very compiled functions those steps call, in the
same order: the same bits.

Its threads stay for the whole call (:func:`_work`).  The instructions become stages of tasks
(:func:`_stages`): a product's contiguous runs of weight-row chunks, one a thread (a thread's
rows one stream, as numba's ``prange`` hands them out); the attention's segments, then the pieces
of the keys of the segments too long for one thread, then their merges; every other instruction
one task.  A thread takes tickets in order from an atomic counter and starts a task once every
task of the stages before it is done (:mod:`.compiled.spin`).  One launch of numba's pool a call
rather than one a product: the pool's idle threads sleep, and waking one after the serial work
between two products (a norm, the attention of a short context) cost 2-15 us each time.
Session 19, in one process, 40 rounds alternating with the one-launch-a-product loop it
replaced: the 125M f32 decode step 0.94x / 0.97x the time (invariant 0.99x), Q4_K_M 0.92x;
``bench_decode``'s 8-row f32 step 1.15-1.22x a 1-row one, against 1.45-1.60x before.

Which steps (:func:`build`): the numba backend's products of F32 activations and an F32, F16,
BF16 or Q8_0 weight (a program mixes them: each weight's format is a run-time code of the weight
table, so one compile of the program serves every format), a K-quant one (Q4_K, Q5_K, Q6_K) or
a legacy block one (Q4_0, Q4_1, Q5_0, Q5_1), and the numba-q8 backend's products with quantized
activations (K-quant and legacy block weights, Q8_0 among them: each task quantizes its ``x``
once itself, a few us, rather than in a stage of its own) (Matmul, the q/k/v shared
launch, FusedSwiGlu, FusedNormMatmul), RmsNorm, FusedSkipNorm, its attention chain (Rope, Rope, KvCache, Sdpa on the
vector cores), Add, and the pass-on steps of chains and shared launches, every value they make
F32 ``[T, width]``.  Their intermediates live in one arena per call, reused after each value's
last read.  A batched pass of several sessions runs once over every row, each segment attending
over its own session's cache (:meth:`Program.over_segments`).  Off its fast path (a pass of
:data:`~.numba.BLAS_ROWS` rows or more where the products go to BLAS, an input not as built
for, a KV cache that would refuse the write) the program runs its steps one by one, as without
it, each error naming its own node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numba
import numpy as np
from numba import prange, types
from numba._dispatcher import compute_fingerprint
from numba.core import cgutils
from numba.extending import intrinsic

from dist_runtime.kernels.attention import KvState
from dist_runtime.kernels.positions import cos_sin_rows
from dist_runtime.kernels.registry import KernelContext

from ..dtypes import DType
from ..tensor import QuantizedArray
from ..ir.tensor_spec import POS
from ..ir.ops import Add
from . import ChainedNodeError
from .compiled import attention as compiled_attention
from .compiled import cpu, floats, kquants, legacy, spin
from .compiled.registry import SERIAL_BYTES, block_sums, joint_chunks, joint_part
from .numba import BLAS_ROWS, _AttentionChain, _f32_at, _rms_rows, _rope_append_attend, _silu_mul_compiled, _skip_rms_rows

F32 = np.dtype(np.float32)
#: Product weights' numpy types, by the format name their kernels take (floats.SPECS).
_FORMATS = {F32: "f32", np.dtype(np.float16): "f16", DType.BF16.numpy: "bf16"}
#: The float formats' codes in the weight table (a float weight's third column) and their
#: compile-time choices: each product branches on its weight's code.  A choice a program was
#: compiled for, one compile a format (and a head size), cost ~50-80 s each on the 2-core test
#: machine, 11 of them over the test suite's models.
F32_CODE, F16_CODE, BF16_CODE, Q8_0_CODE = range(4)
_CODES = {"f32": F32_CODE, "f16": F16_CODE, "bf16": BF16_CODE, "q8_0": Q8_0_CODE}
_F32, _F16, _BF16, _Q8_0 = (floats.SPECS((fmt, cpu.PATH)) for fmt in _CODES)
#: K-quant product weights the program takes, by the kind their kernel takes.
_K_KINDS = {DType.Q4_K: 4, DType.Q5_K: 5, DType.Q6_K: 6}
#: Legacy block weights the program takes, by their format code in :mod:`.compiled.legacy` (Q8_0
#: too where the activations are quantized; with f32 ones it runs F32's tiles, a float format).
_LEGACY = dict(legacy._CODES)
_SHARED = "@shared"
#: Columns of one instruction in :func:`_execute`'s code: the opcode, then its operands.
WIDTH = 16
#: ``K_BLOCKS`` / ``L_BLOCKS``: the products of one to three K-quant / legacy block weights with one
#: ``x`` (one launch, as :func:`.compiled.linear_many`): one code path a family, since numba
#: compiles a kernel again into every function that calls it (each path cost ~25 s of compile).
RMS, SKIP, PRODUCT, JOINT, SILU, ADD, ATTENTION, K_BLOCKS, L_BLOCKS = range(1, 10)
#: The slot of a KvCache's outputs (views of the session's cache, read only inside the chain).
_KV_VIEW = -1


# -- the compiled loop -------------------------------------------------------------------------------
@numba.njit(nogil=True, cache=True)
def _flat(arena, slots, s, m):
    """Value ``s``'s rows in the arena, flat (``slots[s]``: offset per row, width)."""
    return arena[slots[s, 0] * m:(slots[s, 0] + slots[s, 1]) * m]


@numba.njit(nogil=True, cache=True)
def _rows2d(arena, slots, s, m):
    return _flat(arena, slots, s, m).reshape((m, slots[s, 1]))


@numba.njit(nogil=True, cache=True)
def _weight(weights, i):
    """F32 vector ``i`` of the weight table (a norm's scale)."""
    return numba.carray(_f32_at(weights[i, 0]), weights[i, 1])


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


@numba.njit(nogil=True, cache=True)
def _blocks(weights, i):
    """Block weight ``i`` of the weight table (a K-quant or legacy one): its rows of blocks."""
    return numba.carray(_bytes_at(weights[i, 0]), (weights[i, 1], weights[i, 2]))


@numba.njit(nogil=True, cache=True)
def _joint_blocks(c, slots, weights, arena, m):
    """A K_BLOCKS or L_BLOCKS instruction's weights, outputs and kinds (formats), the missing
    second and third as empty (no chunks) with the first's kind."""
    w0, o0 = _blocks(weights, c[3]), _rows2d(arena, slots, c[4], m)
    w1, o1, w2, o2 = w0[:0], o0[:, :0], w0[:0], o0[:, :0]
    if c[2] >= 2:
        w1, o1 = _blocks(weights, c[5]), _rows2d(arena, slots, c[6], m)
    if c[2] == 3:
        w2, o2 = _blocks(weights, c[7]), _rows2d(arena, slots, c[8], m)
    return w0, o0, c[9], w1, o1, c[10], w2, o2, c[11]


@numba.njit(nogil=True, cache=True)
def _matrix(spec, weights, i):
    """Product weight ``i`` of the weight table, flat, as its kernel reads it."""
    return numba.carray(_stored_at(spec, weights[i, 0]), weights[i, 1])


@numba.njit(nogil=True, cache=True, inline="always")
def _float_rows(x, weights, i, out, m, n, k, lo, hi):
    """:func:`.compiled.floats._rows` of float product weight ``i``, in its format (rows ``lo``
    to ``hi``: whole chunks, a task's run of them in this weight)."""
    code = weights[i, 2]
    if code == F32_CODE:
        floats._rows(_F32, x, _matrix(_F32, weights, i), out, m, n, k, lo, hi)
    elif code == F16_CODE:
        floats._rows(_F16, x, _matrix(_F16, weights, i), out, m, n, k, lo, hi)
    elif code == BF16_CODE:
        floats._rows(_BF16, x, _matrix(_BF16, weights, i), out, m, n, k, lo, hi)
    else:
        floats._rows(_Q8_0, x, _matrix(_Q8_0, weights, i), out, m, n, k, lo, hi)


@numba.njit(nogil=True, cache=True, inline="always")
def _slot(joint, at):
    """Weight ``at`` of :func:`_joint_blocks`' tuple: its blocks, its output and its kind."""
    if at == 0:
        return joint[0], joint[1], joint[2]
    if at == 1:
        return joint[3], joint[4], joint[5]
    return joint[6], joint[7], joint[8]


@numba.njit(nogil=True, cache=True, inline="always")
def _k_joint_parts(x, joint, q8, first, last, c0, c1, c2):
    """Parts ``first..last`` of a K_BLOCKS (:func:`.compiled.kquants._k_threaded_joint` and its q8
    twin), ``x`` prepared once for them all (its block sums, or its Q8_K quantization)."""
    n0, n1, n2 = joint[0].shape[0], joint[3].shape[0], joint[6].shape[0]
    if q8:
        q, dx, sums32, sums16 = kquants._quantize_q8_k(x)
        for part in range(first, last):
            at, lo, hi = joint_part(part, c0, c1, c2, n0, n1, n2)
            w, out, kind = _slot(joint, at)
            kquants._k_q8_rows(x, w, out, kind, cpu.AVX2, q, dx, sums16 if kind == 6 else sums32, lo, hi)
    else:
        xsum = block_sums(x, x.shape[1] // 32)
        for part in range(first, last):
            at, lo, hi = joint_part(part, c0, c1, c2, n0, n1, n2)
            w, out, kind = _slot(joint, at)
            kquants._k_rows(x, w, out, kind, cpu.AVX2, xsum, lo, hi)


@numba.njit(nogil=True, cache=True, inline="always")
def _legacy_joint_parts(x, joint, q8, first, last, c0, c1, c2):
    """Parts ``first..last`` of an L_BLOCKS (:func:`.compiled.legacy._f32_joint`, ``_q8_joint``),
    ``x`` prepared once for them all (its block sums, or quantized, each weight's lane sums scaled
    by its centre)."""
    n0, n1, n2 = joint[0].shape[0], joint[3].shape[0], joint[6].shape[0]
    if q8:
        xp, xn0, xn1, xn2, xd, xs = legacy._quantized_for(x, legacy.QK, joint[2], joint[5], joint[8])
        for part in range(first, last):
            at, lo, hi = joint_part(part, c0, c1, c2, n0, n1, n2)
            w, out, fmt = _slot(joint, at)
            legacy._q8_rows(xp, xn0 if at == 0 else xn1 if at == 1 else xn2, xd, xs, w, out, fmt, legacy.QK, lo, hi)
    else:
        xsum = block_sums(x, x.shape[1] // legacy.QK)
        for part in range(first, last):
            at, lo, hi = joint_part(part, c0, c1, c2, n0, n1, n2)
            w, out, fmt = _slot(joint, at)
            legacy._f32_rows(x, xsum, w, out, fmt, legacy.QK, lo, hi)


@numba.njit(nogil=True, cache=True, inline="always")
def _rope_append(spec, c, slots, kv, cos, sin, arena, m, starts, positions, g, attend):
    """The attention chain's compiled call (:class:`~.numba._AttentionChain`) for segment ``g``
    (rows ``starts[g]:starts[g + 1]``, at ``positions[g]``) on its KV cache ``kv[c[4], g]``,
    attending too if ``attend`` (:func:`_attends`; else the pieces' stages do, over the threads:
    the same bits)."""
    lo, hi, pos = starts[g], starts[g + 1], positions[g]
    k_buf, v_buf = _cache(c, slots, kv, g)
    _rope_append_attend(spec, _rows2d(arena, slots, c[1], m)[lo:hi], _rows2d(arena, slots, c[2], m)[lo:hi],
                        _rows2d(arena, slots, c[3], m)[lo:hi], cos[lo:hi], sin[lo:hi], c[13], c[14], k_buf, v_buf,
                        pos, c[8], c[9], c[10], c[11] != 0, c[12], attend, _rows2d(arena, slots, c[5], m)[lo:hi],
                        _rows2d(arena, slots, c[6], m)[lo:hi], _rows2d(arena, slots, c[7], m)[lo:hi])


@numba.njit(nogil=True, cache=True)
def _cache(c, slots, kv, g):
    """Segment ``g``'s K and V buffers of an ATTENTION instruction's cache (every row they hold)."""
    width, rows = slots[c[2], 1], kv[c[4], g, 2]
    return (numba.carray(_f32_at(kv[c[4], g, 0]), (rows, width)),
            numba.carray(_f32_at(kv[c[4], g, 1]), (rows, width)))


@numba.njit(nogil=True, cache=True)
def _attends(c, slots, starts, positions, g, threads):
    """Whether segment ``g`` of an ATTENTION instruction attends in its chain's call, on one
    thread (:func:`.compiled.attention.serial_on`), rather than in pieces over the threads."""
    rows = starts[g + 1] - starts[g]
    stop = positions[g] + rows
    return compiled_attention.serial_on(rows, stop, stop * slots[c[2], 1] * 4, threads)


@numba.njit(nogil=True, cache=True)
def _segment_pieces(c, starts, positions, g):
    """Segment ``g``'s pieces (:func:`.compiled.attention._pieces`): where each query row's start."""
    rows = starts[g + 1] - starts[g]
    return compiled_attention._pieces(rows, positions[g] + rows, c[11] != 0, c[12])


@numba.njit(nogil=True, cache=True)
def _stored_bytes(weights, i, op):
    """Product weight ``i``'s work in bytes (of instruction ``op``): what it stores, times
    :data:`.kquants.COST` for a K-quant's (decoding its blocks costs more a byte)."""
    if op == K_BLOCKS:
        return weights[i, 1] * weights[i, 2] * kquants.COST
    if op == L_BLOCKS:
        return weights[i, 1] * weights[i, 2]
    code = weights[i, 2]
    return weights[i, 1] * (4 if code == F32_CODE else 1 if code == Q8_0_CODE else 2)


@numba.njit(nogil=True, cache=True)
def _product_parts(work_bytes, threads):
    """A product's tasks: one on a thread (:func:`.compiled.registry.serial`'s rule: the same
    bits either way, only the speed differs), else one a thread, each a contiguous run of its
    chunks (a thread's weight rows one stream, as numba's ``prange`` hands them out).  Four a
    thread, which a late thread would leave fewer of to wait on, measured 0.97-1.00x the time of
    the 125M f32 decode step and 1.07x (twice) of its Q4_K_M one; two a thread 0.99-1.00x f32."""
    return 1 if work_bytes < SERIAL_BYTES or threads == 1 else threads


@numba.njit(nogil=True, cache=True, inline="always")
def _stage(stages, s, i, phase, tasks):
    """Row ``s`` of the plan (:func:`_stages`), by element: assigning a row from a tuple or an
    array compiles numba's shape-error message, ~5 s of a cold compile."""
    stages[s, 0], stages[s, 1], stages[s, 2] = i, phase, tasks


@numba.njit(nogil=True, cache=True)
def _stages(code, slots, weights, m, starts, positions, threads):
    """The call's stages in order, each ``(instruction, phase, tasks)``, every task of one done
    before any of the next starts; ``pieces[i, g]``: where segment ``g``'s attention pieces start
    among ATTENTION instruction ``i``'s (``pieces[i, -1]`` in all; none where it attends whole)."""
    segments = positions.shape[0]
    stages = np.zeros((3 * code.shape[0], 3), np.int64)
    pieces = np.zeros((code.shape[0], segments + 1), np.int64)
    s = 0
    for i in range(code.shape[0]):
        c = code[i]
        op, tasks = c[0], 1
        if op == PRODUCT:
            tasks = _product_parts(_stored_bytes(weights, c[2], op) * m, threads)
        elif op == JOINT or op == K_BLOCKS or op == L_BLOCKS:
            nbytes = 0
            for j in range(c[2]):
                nbytes += _stored_bytes(weights, c[3 + 2 * j], op)
            tasks = _product_parts(nbytes * m, threads)
        elif op == ATTENTION:
            tasks = segments
            for g in range(segments):
                count = 0 if _attends(c, slots, starts, positions, g, threads) else _segment_pieces(
                    c, starts, positions, g)[-1]
                pieces[i, g + 1] = pieces[i, g] + count
            if pieces[i, -1]:
                _stage(stages, s, i, 0, tasks)
                _stage(stages, s + 1, i, 1, pieces[i, -1])
                s += 2  # then phase 2, the merges: one task a segment
        _stage(stages, s, i, 2 if op == ATTENTION and pieces[i, -1] else 0, tasks)
        s += 1
    return stages[:s], pieces


# Inlined into _work, the one function that calls it: compiled once, in _work's code.
@numba.njit(nogil=True, cache=True, inline="always")
def _task(c, phase, task, tasks, slots, weights, eps, kv, cos, sin, arena, m, starts, positions, attention_spec,
          pieces, sums, stats):
    """Task ``task`` of ``tasks`` of instruction ``c``'s stage ``phase`` (:func:`_stages`)."""
    op = c[0]
    if op == RMS:
        _rms_rows(_rows2d(arena, slots, c[1], m), _weight(weights, c[2]), eps[c[3]], _rows2d(arena, slots, c[4], m))
    elif op == SKIP:
        _skip_rms_rows(_rows2d(arena, slots, c[1], m), _rows2d(arena, slots, c[2], m), _weight(weights, c[3]),
                       eps[c[4]], _rows2d(arena, slots, c[5], m), _rows2d(arena, slots, c[6], m))
    elif op == PRODUCT:
        n, k = slots[c[3], 1], slots[c[1], 1]
        chunks = (n + floats.CHUNK - 1) // floats.CHUNK
        _float_rows(_flat(arena, slots, c[1], m), weights, c[2], _flat(arena, slots, c[3], m), m, n, k,
                    task * chunks // tasks * floats.CHUNK, min(n, (task + 1) * chunks // tasks * floats.CHUNK))
    elif op == JOINT:  # the weights' chunks in order, each in its weight's format (a missing third: none)
        x, k = _flat(arena, slots, c[1], m), slots[c[1], 1]
        n0, n1 = slots[c[4], 1], slots[c[6], 1]
        n2 = slots[c[8], 1] if c[2] == 3 else 0
        t0, t1 = (n0 + floats.CHUNK - 1) // floats.CHUNK, (n1 + floats.CHUNK - 1) // floats.CHUNK
        chunks = t0 + t1 + (n2 + floats.CHUNK - 1) // floats.CHUNK
        bounds = (0, t0, t0 + t1, chunks)
        first, last = task * chunks // tasks, (task + 1) * chunks // tasks
        for at in range(c[2]):  # each weight's run of this task's chunks in one call: it hints a chunk's successor
            lo, hi = max(first, bounds[at]), min(last, bounds[at + 1])
            if lo < hi:
                n = slots[c[4 + 2 * at], 1]
                _float_rows(x, weights, c[3 + 2 * at], _flat(arena, slots, c[4 + 2 * at], m), m, n, k,
                            (lo - bounds[at]) * floats.CHUNK, min(n, (hi - bounds[at]) * floats.CHUNK))
    elif op == K_BLOCKS or op == L_BLOCKS:  # kquants' and legacy's drivers: the weights' parts in order
        x = _rows2d(arena, slots, c[1], m)
        joint = _joint_blocks(c, slots, weights, arena, m)
        c0, c1, c2 = joint_chunks(joint[0].shape[0], joint[3].shape[0], joint[6].shape[0])
        first, last = task * (c0 + c1 + c2) // tasks, (task + 1) * (c0 + c1 + c2) // tasks
        if op == K_BLOCKS:
            _k_joint_parts(x, joint, c[12] != 0, first, last, c0, c1, c2)
        else:
            _legacy_joint_parts(x, joint, c[12] != 0, first, last, c0, c1, c2)
    elif op == SILU:
        _silu_mul_compiled(_flat(arena, slots, c[1], m), _flat(arena, slots, c[2], m))
    elif op == ADD:
        a, b, out = _flat(arena, slots, c[1], m), _flat(arena, slots, c[2], m), _flat(arena, slots, c[3], m)
        for j in range(out.shape[0]):
            out[j] = a[j] + b[j]
    elif phase == 0:  # ATTENTION: segment ``task``'s rotations and cache rows, and its attention if whole
        _rope_append(attention_spec, c, slots, kv, cos, sin, arena, m, starts, positions, task,
                     pieces[task + 1] == pieces[task])
    else:  # ATTENTION: one piece of a segment's keys (phase 1) or a segment's merge (phase 2)
        g = task if phase == 2 else np.searchsorted(pieces, task, side="right") - 1
        if pieces[g + 1] == pieces[g]:
            return
        lo, hi = starts[g], starts[g + 1]
        k_buf, v_buf = _cache(c, slots, kv, g)
        at, stop = pieces[g], positions[g] + hi - lo
        heads, head_dim = c[8], c[10]
        mine = _segment_pieces(c, starts, positions, g)
        sums_g = sums[:(pieces[-1]) * heads * head_dim].reshape((pieces[-1], heads * head_dim))[at:pieces[g + 1]]
        stats_g = stats[:pieces[-1] * 2 * heads].reshape((pieces[-1], 2, heads))[at:pieces[g + 1]]
        if phase == 1:
            compiled_attention._attend_piece(attention_spec, _rows2d(arena, slots, c[5], m)[lo:hi], k_buf[:stop],
                                             v_buf[:stop], heads, c[9], head_dim, c[11] != 0, c[12], mine,
                                             task - at, sums_g, stats_g)
        else:
            compiled_attention._merge(mine, sums_g, stats_g, heads, head_dim, _rows2d(arena, slots, c[7], m)[lo:hi])


#: :func:`_execute`'s counters: tickets handed out, tasks finished (a cache line apart).
_CLAIMED, _DONE = 0, 8


@numba.njit(nogil=True, cache=True)
def _work(stages, counters, code, slots, weights, eps, kv, cos, sin, arena, m, starts, positions,
          attention_spec, pieces, sums, stats):
    """One thread's share of a call: it takes the next ticket (a task, the stages' in order)
    until none is left, each once every task of the stages before it is done.  Tickets are
    taken in order, so the earliest unfinished one's thread never waits: no deadlock, whichever
    threads turn up (one thread alone does every task)."""
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
        _task(code[i], stages[s, 1], ticket - stages[s, 3], stages[s, 2], slots, weights, eps, kv, cos, sin, arena,
              m, starts, positions, attention_spec, pieces[i], sums, stats)
        spin.fetch_add(counters, _DONE)


@numba.njit(nogil=True, cache=True)
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
            most = max(most, pieces[i, -1] * slots[code[i, 5], 1])
    return stages, pieces, np.empty(most, np.float32), np.empty(2 * most, np.float32), np.zeros(16, np.int64)


@intrinsic
def _call(typingctx, address, args):
    """Call the compiled function at ``address`` (numba's calling convention, returning None:
    :func:`_work_address`) with the tuple ``args``, its arguments in order; an exception it
    raises goes on up."""
    def codegen(context, builder, sig, llargs):
        fnty = context.call_conv.get_function_type(types.none, args.types)
        fn = builder.inttoptr(llargs[0], fnty.as_pointer())
        status, _ = context.call_conv.call_function(builder, fn, types.none, args.types,
                                                    cgutils.unpack_tuple(builder, llargs[1]))
        with cgutils.if_unlikely(builder, status.is_error):
            context.call_conv.return_status_propagate(builder, status)
        return context.get_dummy_value()
    return types.none(address, args), codegen


@numba.njit(nogil=True, cache=True, parallel=True)
def _launch(address, args, threads):
    """:func:`_work` (at ``address``) on ``threads`` threads of numba's pool, each with ``args``."""
    if threads == 1:
        _call(address, args)
    else:
        for _ in prange(threads):
            _call(address, args)


#: :func:`_work`'s compiled code for its arguments' types, by their numba fingerprints.
_WORK: dict[bytes, int] = {}


def _work_address(args: tuple) -> int:
    """The address of :func:`_work` compiled for ``args``' types (compiled, or loaded from numba's
    cache, on first use).  :func:`_launch` calls it through this address rather than by name: numba
    links a called function's code into its caller's and optimises it again there, and the
    parallel launch is four such callers deep (the loop, numba's gufunc and its two wrappers), so
    the program's whole code was optimised and compiled six times over, ~7 s each here (session
    23: a tiny model's first ``generate`` compiled for 87 s)."""
    key = compute_fingerprint(args)
    address = _WORK.get(key)
    if address is None:
        signature = numba.typeof(args).types
        _work.compile(signature)
        compiled = _work.overloads[signature]
        address = _WORK[key] = compiled.library.get_pointer_to_function(compiled.fndesc.llvm_func_name)
    return address


def _execute(code, slots, weights, eps, kv, cos, sin, arena, m, starts, positions, threads, attention_spec):
    """Every instruction of ``code`` in order (see :class:`Program`), on ``threads`` threads that
    stay from the first task to the last (:func:`_work`), spinning between stages rather than
    going back to numba's pool: one launch a call, not one a product, and no sleeping thread to
    wake after each stretch of serial work (~2-15 us each: :mod:`.compiled.threads`)."""
    stages, pieces, sums, stats, counters = _prepare(code, slots, weights, m, starts, positions, threads)
    args = (stages, counters, code, slots, weights, eps, kv, cos, sin, arena, m, starts, positions, attention_spec,
            pieces, sums, stats)
    _launch(_work_address(args), args, threads)


# -- building it --------------------------------------------------------------------------------------
@dataclass
class _Cache:
    """One attention chain's KV cache: the session's key for its state, and the op."""

    key: int
    op: object
    width: int


class _Builder:
    """Instructions, value slots and weights of a program, made step by step."""

    def __init__(self, specs: dict, constants: dict) -> None:
        self.specs, self.constants = specs, constants
        self.code: list[list[int]] = []
        self.values: dict[str, int] = {}  # value name (without @shared) -> slot
        self.widths: list[int] = []
        self.weights: list[np.ndarray] = []
        self.weight_ids: dict[str, int] = {}
        self.eps: list[float] = []
        self.caches: list[_Cache] = []
        self.rope: tuple | None = None  # (rope_dim, base, head_dim of attention) of every chain
        self.formats: dict[str, None] = {}  # of the product weights but K-quants, in order of first use
        self.by_rows: list[bool] = []  # each weight's layout in the table: rows of blocks, or flat
        self.q8 = False  # whether some product quantizes its activations

    def value(self, name: str) -> int:
        """The slot of value ``name`` (or of its ``@shared`` form), made on first use."""
        name = name.removesuffix(_SHARED)
        if self.values.get(name) == _KV_VIEW:
            raise _Unsupported(f"value {name!r}, a KV cache's rows, is read outside its attention chain")
        if name not in self.values:
            spec = self.specs.get(name)
            if spec is None or spec.dtype != DType.F32 or len(spec.shape) != 2:
                raise _Unsupported(f"value {name!r} is not F32 rows of the pass ({spec or 'rows fixed'})")
            self.values[name] = len(self.widths)
            self.widths.append(int(spec.shape[1]))
        return self.values[name]

    def alias(self, shared: str, name: str) -> None:
        """A pass-on step's value: the one its group's first step made (a KV view stays one)."""
        key = shared.removesuffix(_SHARED)
        self.values[name] = self.values[key] if self.values.get(key) == _KV_VIEW else self.value(shared)

    def scratch(self, width: int) -> int:
        self.widths.append(width)
        return len(self.widths) - 1

    def weight(self, name: str, matrix: bool, q8: bool = False) -> int:
        """Weight ``name``'s row in the weight table: a norm's F32 vector, a product's matrix stored
        as F32, F16, BF16 or Q8_0 (its format's code in the table, :data:`F32_CODE` ...; Q8_0 on
        F32's tiles), or as rows of blocks: a K-quant, a legacy block type, or Q8_0 where the
        product quantizes its activations (``q8``)."""
        w = self.constants.get(name)
        if matrix and isinstance(w, QuantizedArray) and (w.dtype in _K_KINDS or w.dtype in _LEGACY):
            if not (w.data.ndim == 2 and w.data.flags.c_contiguous and w.data.dtype == np.uint8):
                raise _Unsupported(f"weight {name!r}: its blocks are not contiguous rows")
            by_rows = w.dtype != DType.Q8_0 or q8
            if w.dtype not in _K_KINDS:
                self.formats[w.dtype.name.lower()] = None
            self.q8 |= q8 and by_rows
            return self._table(name, w, by_rows)
        fmt = _FORMATS.get(getattr(w, "dtype", None)) if matrix else ("f32" if getattr(w, "dtype", None) == F32 else None)
        if not (type(w) is np.ndarray and fmt and w.ndim == (2 if matrix else 1) and w.flags.c_contiguous):
            raise _Unsupported(f"weight {name!r} is not a contiguous "
                               f"{'F32, F16, BF16, GGML block' if matrix else 'F32 vector'}"
                               f"{' matrix' if matrix else ''}")
        if matrix:
            self.formats[fmt] = None
        return self._table(name, w, False)

    def _table(self, name: str, w, by_rows: bool) -> int:
        key = (name, by_rows)
        if key not in self.weight_ids:
            self.weight_ids[key] = len(self.weights)
            self.weights.append(w)
            self.by_rows.append(by_rows)
        return self.weight_ids[key]

    def emit(self, *operands: int) -> None:
        self.code.append([int(v) for v in operands])

    def epsilon(self, eps: float) -> int:
        self.eps.append(float(eps))
        return len(self.eps) - 1

    def family(self, wi: int) -> tuple[int, int]:
        """A product weight's family (:data:`JOINT`: float, Q8_0 on F32's tiles too;
        :data:`K_BLOCKS`; :data:`L_BLOCKS`) and its kind: a K-quant's (4, 5, 6), a legacy block
        weight's format code, 0 for a float weight."""
        w = self.weights[wi]
        if not self.by_rows[wi]:
            return JOINT, 0
        if w.dtype in _K_KINDS:
            return K_BLOCKS, _K_KINDS[w.dtype]
        return L_BLOCKS, _LEGACY[w.dtype]

    def matrix(self, w: str, xs: int, o: int, q8: bool) -> int:
        """Weight ``w`` of the product of slot ``xs`` into slot ``o``."""
        wi = self.weight(w, True, q8)
        if self.weights[wi].shape != (self.widths[o], self.widths[xs]):
            raise _Unsupported(f"weight {w!r} {list(self.weights[wi].shape)} against x {self.widths[xs]} wide")
        return wi

    def products(self, xs: int, ws: Sequence[str], outs: Sequence[int], q8: bool) -> None:
        """``x @ W^T`` for each weight, with f32 activations or (``q8``) quantized ones where its
        type has such a product: one launch each, or a joint launch of two or three of one family
        (float, K-quant or legacy block), as :func:`.compiled.linear_many`."""
        ids = [self.matrix(w, xs, o, q8) for w, o in zip(ws, outs)]
        families = [self.family(wi) for wi in ids]
        if len(ids) > 3 or len({family for family, _ in families}) > 1:
            groups = [([wi], [o], [f]) for wi, o, f in zip(ids, outs, families)]
        else:
            groups = [(ids, outs, families)]
        for ids, outs, families in groups:
            pairs = [v for wi, o in zip(ids, outs) for v in (wi, o)]
            family = families[0][0]
            if family == JOINT:
                self.emit(PRODUCT, xs, *pairs) if len(ids) == 1 else self.emit(JOINT, xs, len(ids), *pairs)
            else:
                kinds = [kind for _, kind in families]
                self.emit(family, xs, len(ids), *pairs, *([0] * (6 - len(pairs))), *kinds,
                          *([kinds[0]] * (3 - len(kinds))), q8)


class _Unsupported(Exception):
    """A step the program cannot take (its message says why)."""


def _step_code(b: _Builder, step, node, pass_on, q8: bool = False) -> None:
    """``step``'s instructions, or :class:`_Unsupported` (``pass_on``: the executor's kernel of
    the steps that pass a group's results on; ``q8``: its backend quantizes the activations of
    its products)."""
    fn, kind = step.fn, getattr(step.fn, "program_kind", None)
    if fn is pass_on:
        for read, write in zip(step.reads, step.writes):
            b.alias(read, write)
        return
    if isinstance(node.op, Add) and kind is None:
        a, c = (b.value(n) for n in step.reads)
        out = b.value(step.writes[0])
        if not b.widths[a] == b.widths[c] == b.widths[out]:
            raise _Unsupported(f"node {node.id}: an Add that broadcasts")
        b.emit(ADD, a, c, out)
        return
    if isinstance(fn, _AttentionChain):
        _attention_code(b, step, fn)
        return
    if kind is None:
        raise _Unsupported(f"node {node.id} ({type(node.op).__name__}) runs outside the numba backend's kernels")
    name, *params = kind
    r, w = step.reads, step.writes
    if name == "rms":
        b.emit(RMS, b.value(r[0]), b.weight(r[1], False), b.epsilon(params[0]), b.value(w[0]))
    elif name == "skip":
        b.emit(SKIP, b.value(r[0]), b.value(r[1]), b.weight(r[2], False), b.epsilon(params[0]), b.value(w[0]),
               b.value(w[1]))
    elif name in ("matmul", "siblings"):
        b.products(b.value(r[0]), r[1:], [b.value(n) for n in w], q8)
    elif name == "swiglu":
        gate = b.value(w[0])
        up = b.scratch(b.widths[gate])
        b.products(b.value(r[0]), r[1:3], [gate, up], q8)
        b.emit(SILU, gate, up)
    elif name == "norm_matmul":
        normed = b.scratch(b.widths[b.value(r[0])])
        b.emit(RMS, b.value(r[0]), b.weight(r[1], False), b.epsilon(params[0]), normed)
        b.products(normed, r[2:3], [b.value(w[0])], q8)
    else:
        raise _Unsupported(f"node {node.id}: {name}")


def _attention_code(b: _Builder, step, chain) -> None:
    """The attention chain's instruction: its reads are (q, pos, k, v); writes (q_rot, k_rot,
    k_all, v_all, out) in the nodes' order, of which the KV views leave no value."""
    if not chain.fast:
        raise _Unsupported("an attention chain off its vector cores")
    q, _, k, v = (step.reads[i] for i in chain.at)
    made = [step.writes[chain.order.index(j)] for j in range(5)]  # q_rot, k_rot, k_all, v_all, out
    rope = (chain.rope.rope_dim, float(chain.rope.base), chain.attn.head_dim)
    if b.rope not in (None, rope):
        raise _Unsupported("attention chains of different rotations or head sizes")
    b.rope = rope
    for name in made[2:4]:
        b.values[name.removesuffix(_SHARED)] = _KV_VIEW
    cache = len(b.caches)
    b.caches.append(_Cache(step.state_key, step.kv_cache, chain.widths[1]))
    a = chain.attn
    b.emit(ATTENTION, b.value(q), b.value(k), b.value(v), cache, b.value(made[0]), b.value(made[1]), b.value(made[4]),
           a.num_heads, a.kv_heads, a.head_dim, int(bool(a.causal)), chain.window, chain.rope.head_dim,
           chain.rope.rope_dim)


# -- the program's step -------------------------------------------------------------------------------
class Program:
    """Steps ``steps`` (consecutive, their nodes from ``index`` on) as one step's kernel: reads
    :attr:`reads` (values made before it), writes :attr:`writes` (values read after it)."""

    def __init__(self, steps: list, b: _Builder, reads: tuple, writes: tuple, backend, constants: dict) -> None:
        self.steps, self.index, self.reads, self.writes = steps, steps[0].index, reads, writes
        self.backend, self.constants = backend, constants
        self.code = np.zeros((len(b.code), WIDTH), np.int64)
        for i, row in enumerate(b.code):
            self.code[i, :len(row)] = row
        starts, self.per_row = _allocate(b, steps, reads, writes)
        self.slots = np.array([[s, w] for s, w in zip(starts, b.widths)], np.int64).reshape(-1, 2)
        stored = [w.data if isinstance(w, QuantizedArray) else w for w in b.weights]
        # Block weights by [address, rows, row bytes]; the rest [address, elements, format code]:
        # floats and Q8_0 on floats.py's tiles flat, a norm's vector (F32, the code unread)
        self.weights = np.array([[a.ctypes.data, *a.shape] if k else [a.ctypes.data, a.size, _code(w)]
                                 for k, a, w in zip(b.by_rows, stored, b.weights)], np.int64).reshape(-1, 3)
        self._held = b.weights  # the addresses above stay valid while the program lives
        self.eps = np.array(b.eps or [0.0], np.float64)
        self.caches, self.rope, self.formats, self.q8 = b.caches, b.rope, list(b.formats), b.q8
        self.imports = [b.values[n.removesuffix(_SHARED)] for n in reads]
        self.exports = [b.values[n.removesuffix(_SHARED)] for n in writes]
        head_dim = b.rope[2] if b.rope else compiled_attention.HEAD_DIMS[0]
        self.attention_spec = compiled_attention.SPECS((cpu.PATH, head_dim))
        self._empty = np.zeros((1, 1), F32)
        self._empty.flags.writeable = False

    def describe(self) -> str:
        products = f"{' and '.join(f.upper() for f in self.formats)} products, " if self.formats else ""
        products += "Q8-quantized activations, " if self.q8 else ""
        return (f"{len(self.steps)} steps from node {self.index} in one compiled call "
                f"({len(self.code)} instructions, {products}{len(self.caches)} KV caches)")

    def __call__(self, inputs: Sequence, ctx: KernelContext) -> tuple:
        """One session's pass (``ctx.state``: its KV states by key); off the fast path, the steps
        one by one."""
        m = inputs[0].shape[0] if inputs and getattr(inputs[0], "ndim", 0) == 2 else -1
        done = self._run(inputs, [ctx], [m]) if self._fits(inputs, m) else None
        return self._one_by_one(inputs, ctx) if done is None else done

    def over_segments(self, inputs: Sequence, cuts: Sequence[slice], ctxs: Sequence[KernelContext]) -> tuple | None:
        """A batched pass of several sessions (``cuts``: each one's rows), in one call; None
        (the executor then calls it a segment at a time) off the fast path."""
        m = cuts[-1].stop
        return self._run(inputs, ctxs, [cut.stop - cut.start for cut in cuts]) if self._fits(inputs, m) else None

    def takes(self, rows: int, positions: Sequence[tuple[dict, int]]) -> bool:
        """Whether a pass of ``rows`` rows in all whose sessions' KV states and positions are
        ``positions`` runs here (else the executor runs the steps: a position a KV cache refuses
        then fails as its node)."""
        if not self._rows_fit(rows):
            return False
        for kv, pos in positions:
            for cache in self.caches:
                state = kv.get(cache.key)
                if not 0 <= pos <= (state.length if state is not None else 0):
                    return False
        return True

    def _run(self, inputs: Sequence, ctxs: Sequence[KernelContext], rows: Sequence[int]) -> tuple | None:
        m = sum(rows)
        starts = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(rows, out=starts[1:])
        kv = np.empty((len(self.caches), len(rows), 3), np.int64)
        for g, (ctx, t) in enumerate(zip(ctxs, rows)):
            if not self._room(ctx.state, ctx.pos, t, kv[:, g]):
                return None
        arena = np.empty(self.per_row * m, F32)
        for s, x in zip(self.imports, inputs):
            arena[self.slots[s, 0] * m:(self.slots[s, 0] + self.slots[s, 1]) * m] = x.reshape(-1)
        cos = sin = self._empty
        if self.rope:
            parts = [cos_sin_rows(ctx.pos, t, self.rope[0], self.rope[1]) for ctx, t in zip(ctxs, rows)]
            cos, sin = parts[0] if len(parts) == 1 else (np.concatenate([p[i] for p in parts]) for i in (0, 1))
            if cos.flags.writeable:  # computed, not cut from the cache: typed as the cached ones
                cos.flags.writeable = sin.flags.writeable = False
        positions = np.array([ctx.pos for ctx in ctxs], np.int64)
        _execute(self.code, self.slots, self.weights, self.eps, kv, cos, sin, arena, m, starts, positions,
                 numba.get_num_threads(), self.attention_spec)
        for ctx, t in zip(ctxs, rows):
            for cache in self.caches:
                ctx.state[cache.key].hold(ctx.pos + t)
        return tuple(arena[self.slots[s, 0] * m:(self.slots[s, 0] + self.slots[s, 1]) * m].reshape(m, self.slots[s, 1])
                     for s in self.exports)

    def _rows_fit(self, m: int) -> bool:
        """A pass of ``m`` rows whose products are the compiled ones (BLAS's from BLAS_ROWS
        rows, unless batch-invariant: :meth:`.numba.NumbaBackend.linear`)."""
        return m >= 1 and (m < BLAS_ROWS or self.backend.invariant)

    def _fits(self, inputs: Sequence, m: int) -> bool:
        if not self._rows_fit(m):
            return False
        return all(type(x) is np.ndarray and x.dtype == F32 and x.shape == (m, self.slots[s, 1])
                   for s, x in zip(self.imports, inputs))

    def _room(self, kv: dict, pos: int, m: int, rooms: np.ndarray) -> bool:
        """Each cache's (K address, V address, rows) with room for rows ``pos..pos + m`` into
        ``rooms``, grown as :meth:`KvState.reserve` grows them; False where a write there would be
        refused."""
        for i, cache in enumerate(self.caches):
            state = KvState.held_in(kv, cache.key, cache.op)
            room = state.room(pos, m, cache.width)
            if room is None:
                if not 0 <= pos <= state.length:
                    return False
                like = np.empty((m, cache.width), F32)
                try:
                    state.reserve(pos, like, like)
                except Exception:  # noqa: BLE001 -- one by one, the node names the error
                    return False
                room = state.room(pos, m, cache.width)
            rooms[i] = room
        return True

    def _one_by_one(self, inputs: Sequence, ctx: KernelContext) -> tuple:
        """The steps as without the program (each error naming its node)."""
        values = dict(zip(self.reads, inputs))
        values[POS] = np.array([ctx.pos], np.float32)
        plain = KernelContext(rng=ctx.rng, pos=ctx.pos)
        for step in self.steps:
            args = [values[n] if n in values else self.constants[n] for n in step.reads]
            own = plain
            if step.kv_cache is not None:
                own = KernelContext(state=KvState.held_in(ctx.state, step.state_key, step.kv_cache), rng=ctx.rng,
                                    pos=ctx.pos)
            try:
                outs = step.fn(args, own)
            except ChainedNodeError as e:
                raise ChainedNodeError(step.index - self.index + e.offset, e.inputs, e.error) from e.error
            except Exception as e:  # noqa: BLE001 -- the executor names the node
                raise ChainedNodeError(step.index - self.index, args, e) from e
            values.update(zip(step.writes, outs))
            for name in step.frees:
                values.pop(name, None)
        return tuple(values[n] for n in self.writes)


def _code(w) -> int:
    """A float weight's format code in the weight table (F32 for a norm's vector)."""
    if isinstance(w, QuantizedArray):
        return Q8_0_CODE
    return _CODES[_FORMATS[w.dtype]]


def _allocate(b: _Builder, steps: list, reads: tuple, writes: tuple) -> tuple[list[int], int]:
    """Each slot's offset per row in the arena, slots reused after their last read (the values
    read from outside the program, and those it hands on, live throughout); and the arena's
    width per row."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, row in enumerate(b.code):
        for s in _operands(row):
            first.setdefault(s, i)
            last[s] = i
    end = len(b.code)
    for n in (*reads, *writes):
        s = b.values[n.removesuffix(_SHARED)]
        first[s], last[s] = 0 if n in reads else first.get(s, 0), end
    starts = [0] * len(b.widths)
    free: list[tuple[int, int]] = []  # (start, width) of free spans
    top = 0
    by_start = sorted(first, key=lambda s: first[s])
    live: list[int] = []
    for s in by_start:
        for d in [d for d in live if last[d] < first[s]]:
            live.remove(d)
            free.append((starts[d], b.widths[d]))
        fit = next((f for f in sorted(free) if f[1] >= b.widths[s]), None)
        if fit is None:
            starts[s], top = top, top + b.widths[s]
        else:
            free.remove(fit)
            starts[s] = fit[0]
            if fit[1] > b.widths[s]:
                free.append((fit[0] + b.widths[s], fit[1] - b.widths[s]))
        live.append(s)
    return starts, top


def _operands(row: list[int]) -> list[int]:
    """The value slots an instruction reads or writes."""
    op = row[0]
    if op == RMS:
        return [row[1], row[4]]
    if op == SKIP:
        return [row[1], row[2], row[5], row[6]]
    if op == PRODUCT:
        return [row[1], row[3]]
    if op in (JOINT, K_BLOCKS, L_BLOCKS):
        return [row[1], *row[4:4 + 2 * row[2]:2]]
    if op in (SILU,):
        return [row[1], row[2]]
    if op == ADD:
        return [row[1], row[2], row[3]]
    return [row[1], row[2], row[3], row[5], row[6], row[7]]  # ATTENTION


def build(steps: list, graph, specs: dict, constants: dict, backends: list, pass_on) -> tuple[int, int, Program] | str:
    """The longest run of steps ``steps[lo:hi]`` a program takes, as ``(lo, hi, program)``, or
    why none (``inspect --plan``: what ended the longest run tried).  ``specs``: the values whose
    rows follow the pass's (inferred at T = 3 and 5), at T = 3."""
    best, why, tried = None, "no step the program takes", -1
    i = 0
    while i < len(steps):
        j, b, backend = i, _Builder(specs, constants), None
        while j < len(steps):
            step = steps[j]
            owner = backends[step.index]
            try:
                _step_code(b, step, graph.nodes[step.index], pass_on, _quantizes(owner))
            except _Unsupported as e:
                if j - i > tried:
                    why, tried = str(e), j - i
                break
            if getattr(step.fn, "program_kind", None) or isinstance(step.fn, _AttentionChain):
                backend = backend or owner
            j += 1
        real = sum(step.fn is not pass_on for step in steps[i:j])
        if backend is not None and real >= 2 and (best is None or j - i > best[1] - best[0]):
            best = (i, j, b, backend)
        i = max(j, i + 1)
    if best is None:
        return why
    lo, hi, b, backend = best
    # Made again: the step that ended the run may have left half its instructions in ``b``.
    b = _Builder(specs, constants)
    for step in steps[lo:hi]:
        _step_code(b, step, graph.nodes[step.index], pass_on, _quantizes(backends[step.index]))
    reads, writes = _borders(steps, lo, hi, graph, constants)
    for name in (*reads, *writes):
        if b.values.get(name.removesuffix(_SHARED), _KV_VIEW) == _KV_VIEW:
            return f"value {name!r} crosses the program's border but is not F32 rows"
    return lo, hi, Program(steps[lo:hi], b, reads, writes, backend, constants)


def _quantizes(backend) -> bool:
    """Whether ``backend``'s products quantize their activations (``numba-q8``)."""
    return getattr(backend, "activations", "f32") == "q8_0"


def _borders(steps: list, lo: int, hi: int, graph, constants: dict) -> tuple[tuple, tuple]:
    """What ``steps[lo:hi]`` read from before them (not weights) and write for later steps or
    the graph's outputs."""
    made, reads = set(), {}
    for step in steps[lo:hi]:
        reads.update((n, None) for n in step.reads if n not in made and n not in constants and n != POS)
        made.update(step.writes)
    later = {n for step in steps[hi:] for n in step.reads} | set(graph.outputs)
    return tuple(reads), tuple(n for n in dict.fromkeys(w for s in steps[lo:hi] for w in s.writes) if n in later)

