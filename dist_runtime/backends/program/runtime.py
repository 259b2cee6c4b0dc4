"""The compiled program as a step of the executor: a pass's values into the arena, one call of the
compiled loop (:mod:`.vm`), the values out; off its fast path (an input not as built for, a KV
cache that would refuse the write), and while a child compiles its code ahead
(:mod:`..compiled.ahead`), the steps one by one, as without it (the same bits), each error naming
its own node.  A batched pass of several sessions runs once over every row, each segment attending
over its own session's cache (:meth:`Program.over_segments`).
"""

from __future__ import annotations

from typing import Sequence

import numba
import numpy as np

from dist_runtime.dtypes import DType
from dist_runtime.kernels.attention import KvState
from dist_runtime.kernels.positions import cos_sin_rows
from dist_runtime.kernels.registry import KernelContext

from ...ir.tensor_spec import POS
from .. import ChainedNodeError
from ..compiled import attention as compiled_attention
from ..compiled import cpu
from . import vm
from .builder import SHARED, Builder, allocate
from .instructions import WIDTH, describe

F32 = np.dtype(np.float32)


class Program:
    """Steps ``steps`` (consecutive, their nodes from ``index`` on) as one step's kernel: reads
    :attr:`reads` (values made before it), writes :attr:`writes` (values read after it)."""

    def __init__(self, steps: list, b: Builder, reads: tuple, writes: tuple, constants: dict,
                 kv_dtype: DType = DType.F32) -> None:
        self.steps, self.index, self.reads, self.writes = steps, steps[0].index, reads, writes
        self.kv_dtype = kv_dtype  # what its sessions' KV caches keep rows in: F32, F16 or Q8_0
        # its element type, for vm: F16 as uint16 bits, Q8_0 as its blocks' bytes
        self._kv_like = np.empty(0, {DType.F16: np.uint16, DType.Q8_0: np.uint8}.get(kv_dtype, F32))
        self.constants = constants
        self.code = np.zeros((len(b.code), WIDTH), np.int64)
        for i, row in enumerate(b.code):
            self.code[i, :len(row)] = row
        starts, self.per_row = allocate(b, reads, writes)
        self.slots = np.array([[s, w] for s, w in zip(starts, b.widths)], np.int64).reshape(-1, 2)
        # [address, rows, row bytes] for block weights, [address, elements, format code] for the
        # rest (vm.py's module docstring)
        self.weights = np.array([[a.ctypes.data, *row] for a, row in zip(b.weights, b.table)], np.int64).reshape(-1, 3)
        self._held = b.weights  # the addresses above stay valid while the program lives
        self.eps = np.array(b.eps or [0.0], np.float64)
        self.caches, self.rope, self.formats, self.q8 = b.caches, b.rope, list(b.formats), b.q8
        self.kernels = tuple(vm.ON if name in b.kernels else vm.OFF for name in vm.KERNELS)
        self.imports = [b.values[n.removesuffix(SHARED)] for n in reads]
        self.exports = [b.values[n.removesuffix(SHARED)] for n in writes]
        head_dim = b.rope[2] if b.rope else compiled_attention.HEAD_DIMS[0]
        self.attention_spec = compiled_attention.SPECS((cpu.PATH, head_dim))
        self._empty = np.zeros((1, 1), F32)
        self._empty.flags.writeable = False
        self._ready = False  # vm.ready() said so once

    def describe(self) -> str:
        products = f"{' and '.join(self.formats)} products, " if self.formats else ""
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
        if rows < 1:
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
        args = (self.code, self.slots, self.weights, self.eps, kv, self._kv_like, cos, sin, arena, m, starts, positions,
                numba.get_num_threads(), self.attention_spec, self.kernels)
        if not self._ready:  # compiling ahead in a child: the steps one by one meanwhile
            if not vm.ready(*args):
                return None
            self._ready = True
        vm.execute(*args)
        for ctx, t in zip(ctxs, rows):
            for cache in self.caches:
                ctx.state[cache.key].hold(ctx.pos + t)
        return tuple(arena[self.slots[s, 0] * m:(self.slots[s, 0] + self.slots[s, 1]) * m].reshape(m, self.slots[s, 1])
                     for s in self.exports)

    def _fits(self, inputs: Sequence, m: int) -> bool:
        """The inputs the program was built for: F32 rows of the widths it reads."""
        return m >= 1 and all(type(x) is np.ndarray and x.dtype == F32 and x.shape == (m, self.slots[s, 1])
                   for s, x in zip(self.imports, inputs))

    def _room(self, kv: dict, pos: int, m: int, rooms: np.ndarray) -> bool:
        """Each cache's (K address, V address, rows) with room for rows ``pos..pos + m`` into
        ``rooms``, grown as :meth:`KvState.reserve` grows them; False where a write there would be
        refused."""
        for i, cache in enumerate(self.caches):
            state = KvState.held_in(kv, cache.key, cache.op)
            room = state.room(pos, m, cache.width, self.kv_dtype)
            if room is None:
                if not 0 <= pos <= state.length:
                    return False
                like = np.empty((m, cache.width), F32)
                try:
                    state.reserve(pos, like, like)
                except Exception:  # noqa: BLE001 -- one by one, the node names the error
                    return False
                room = state.room(pos, m, cache.width, self.kv_dtype)
                if room is None:  # a cache kept in another type than the program's: one by one
                    return False
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

    def listing(self) -> list[str]:
        """The program's instructions, one line each, fields by name."""
        return [describe(row) for row in self.code]
