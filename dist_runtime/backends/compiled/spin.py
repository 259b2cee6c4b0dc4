"""Atomic counters and a bounded spin-wait, for threads that stay in one compiled call from its
first task to its last (the executor's program: :mod:`..program`).

numba offers no atomics on the CPU; these intrinsics emit LLVM's: a sequentially consistent
``atomicrmw add`` (which also publishes every store made before it) and an acquiring load (which
sees them).  A waiting thread first spins on the counter (``pause`` on x86, which frees the core's
pipeline for its sibling), then, past :data:`SPINS` tries, yields its CPU at each try
(``sched_yield``): a thread whose partner was descheduled -- more threads than free cores, another
process busy -- hands the core over instead of burning its time slice.
"""

from __future__ import annotations

import platform

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .cache import jit

_I64 = ir.IntType(64)
#: ``pause`` exists on x86 only; elsewhere a spin is a plain reload.
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")
#: Tries a waiting thread spins before it yields its CPU at each try: 2^10 ``pause`` of ~65
#: cycles (AMD Zen 4), ~20 us here, about the serial work between a decode step's products.  When
#: no other thread wants the CPU a yield returns at once, so a longer wait costs nothing more.
SPINS = 1 << 10


def _slot(context, builder, sig, args):
    array = context.make_array(sig.args[0])(context, builder, args[0])
    return builder.gep(array.data, [args[1]])


@intrinsic
def fetch_add(typingctx, counters, i):
    """``counters[i] += 1`` atomically (int64 array); returns the value before."""
    def codegen(context, builder, sig, args):
        return builder.atomic_rmw("add", _slot(context, builder, sig, args), _I64(1), "seq_cst")
    return types.int64(counters, types.intp), codegen


@intrinsic
def load_acquire(typingctx, counters, i):
    """``counters[i]``, read so that every store made before its last atomic update is seen."""
    def codegen(context, builder, sig, args):
        return builder.load_atomic(_slot(context, builder, sig, args), "acquire", 8)
    return types.int64(counters, types.intp), codegen


@intrinsic
def _relax(typingctx):
    def codegen(context, builder, sig, args):
        if _X86:
            builder.call(cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                        "llvm.x86.sse2.pause"), [])
        return context.get_dummy_value()
    return types.void(), codegen


@intrinsic
def _yield_cpu(typingctx):
    def codegen(context, builder, sig, args):
        builder.call(cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), []),
                                                    "sched_yield"), [])
        return context.get_dummy_value()
    return types.void(), codegen


@jit(nogil=True)
def wait_until(counters, i, target):
    """Return once ``counters[i] >= target`` (see the module's note on spinning)."""
    tries = 0
    while load_acquire(counters, i) < target:
        if tries < SPINS:
            tries += 1
            _relax()
        else:
            _yield_cpu()
