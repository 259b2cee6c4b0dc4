"""Building a program from the executor's steps: instructions, value slots and the weight table.

A step joins the program when its kernel says what it computes (a :mod:`..step_kinds` record,
looked up in :data:`STEP_CODE`), when it is the numba backend's attention chain
(:class:`..numba.AttentionChain`), an Add of equal widths, or a step that passes a group's results
on.  Every product's weight goes through the product table (:mod:`..compiled.products`): its route
decides the instruction (float tiles: PRODUCT / JOINT; K-quants: K_BLOCKS; legacy blocks:
L_BLOCKS) and the weight's code there.  :func:`build` takes the longest run of steps that all join.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ...dtypes import DType
from ...ir.ops import Add
from ...ir.tensor_spec import POS
from ...tensor import QuantizedArray
from ..compiled import floats, stored
from ..compiled.products import PRODUCTS
from ..compiled.registry import FLOATS, KQUANTS, LEGACY, Route
from ..numba import AttentionChain
from ..step_kinds import NormProducts, Products, Rms, SkipRms, SwiGlu
from .instructions import (ADD, ATTENTION, JOINT, K_BLOCKS, L_BLOCKS, PRODUCT, RMS, SILU, SKIP, encode, operands)

F32 = np.dtype(np.float32)
SHARED = "@shared"
#: The slot of a KvCache's outputs (views of the session's cache, read only inside the chain).
KV_VIEW = -1
#: A route's family -> the instruction that takes its products.
_OPCODE = {FLOATS: JOINT, KQUANTS: K_BLOCKS, LEGACY: L_BLOCKS}


class Unsupported(Exception):
    """A step the program cannot take (its message says why)."""


@dataclass
class Cache:
    """One attention chain's KV cache: the session's key for its state, the op, the K row's width."""

    key: int
    op: object
    width: int


class Builder:
    """Instructions, value slots and weights of a program, made step by step."""

    def __init__(self, specs: dict, constants: dict) -> None:
        self.specs, self.constants = specs, constants
        self.code: list[list[int]] = []
        self.values: dict[str, int] = {}  # value name (without @shared) -> slot
        self.widths: list[int] = []
        self.weights: list = []  # each weight as its kernel reads it (a block weight's bytes)
        self.table: list[list[int]] = []  # the weight table's rows but the address: see vm.py
        self.weight_ids: dict[tuple, int] = {}
        self.eps: list[float] = []
        self.caches: list[Cache] = []
        self.rope: tuple | None = None  # (rope_dim, base, head_dim of attention) of every chain
        self.formats: dict[str, None] = {}  # the product weights' types, in order of first use
        self.q8 = False  # whether some product quantizes its activations
        self.kernels: set[str] = set()  # the product kernels its instructions call (vm.KERNELS)

    def value(self, name: str) -> int:
        """The slot of value ``name`` (or of its ``@shared`` form), made on first use."""
        name = name.removesuffix(SHARED)
        if self.values.get(name) == KV_VIEW:
            raise Unsupported(f"value {name!r}, a KV cache's rows, is read outside its attention chain")
        if name not in self.values:
            spec = self.specs.get(name)
            if spec is None or spec.dtype != DType.F32 or len(spec.shape) != 2:
                raise Unsupported(f"value {name!r} is not F32 rows of the pass ({spec or 'rows fixed'})")
            self.values[name] = len(self.widths)
            self.widths.append(int(spec.shape[1]))
        return self.values[name]

    def alias(self, shared: str, name: str) -> None:
        """A pass-on step's value: the one its group's first step made (a KV view stays one)."""
        key = shared.removesuffix(SHARED)
        self.values[name] = self.values[key] if self.values.get(key) == KV_VIEW else self.value(shared)

    def scratch(self, width: int) -> int:
        self.widths.append(width)
        return len(self.widths) - 1

    def vector(self, name: str) -> int:
        """A norm's F32 scale vector's row in the weight table."""
        w = self.constants.get(name)
        if not (type(w) is np.ndarray and w.dtype == F32 and w.ndim == 1 and w.flags.c_contiguous):
            raise Unsupported(f"weight {name!r} is not a contiguous F32 vector")
        return self._table(name, w, [w.size, 0])

    def matrix(self, name: str, xs: int, o: int, activations: str) -> tuple[int, Route]:
        """Product weight ``name`` (of slot ``xs`` into slot ``o``): its row in the weight table and
        its route in the product table with ``activations``."""
        w = self.constants.get(name)
        if not isinstance(w, (np.ndarray, QuantizedArray)):
            raise Unsupported(f"weight {name!r} is not a stored weight")
        dtype, data = stored(w)
        record = PRODUCTS.get(dtype)
        if record is None or type(data) is not np.ndarray or data.ndim != 2 or not data.flags.c_contiguous:
            raise Unsupported(f"weight {name!r} is not a contiguous 2-D weight of a type of the product table")
        if tuple(w.shape) != (self.widths[o], self.widths[xs]):
            raise Unsupported(f"weight {name!r} {list(w.shape)} against x {self.widths[xs]} wide")
        route = record.route(activations)
        self.formats[dtype.name] = None
        self.q8 |= route.activations == "q8_0"
        self.kernels.add(floats.FORMATS[route.code] if route.family == FLOATS
                         else f"{route.family}_{'q8' if route.activations == 'q8_0' else 'f32'}")
        by_rows = route.family != FLOATS  # blocks by rows; float tiles flat
        return self._table(name, data, [*data.shape] if by_rows else [data.size, route.code]), route

    def _table(self, name: str, data: np.ndarray, row: list[int]) -> int:
        key = (name, tuple(row))
        if key not in self.weight_ids:
            self.weight_ids[key] = len(self.weights)
            self.weights.append(data)
            self.table.append(row)
        return self.weight_ids[key]

    def emit(self, op: int, **fields: int) -> None:
        self.code.append(encode(op, **fields))

    def epsilon(self, eps: float) -> int:
        self.eps.append(float(eps))
        return len(self.eps) - 1

    def products(self, xs: int, ws: Sequence[str], outs: Sequence[int], activations: str) -> None:
        """``x @ W^T`` for each weight: one launch each, or a joint launch of two or three whose
        routes share an instruction (as :func:`..compiled.linear_many`)."""
        found = [self.matrix(w, xs, o, activations) for w, o in zip(ws, outs)]
        ops = [_OPCODE[route.family] for _, route in found]
        if len(found) > 3 or len(set(ops)) > 1:
            groups = [([f], [o]) for f, o in zip(found, outs)]
        else:
            groups = [(found, list(outs))]
        for group, group_outs in groups:
            op = _OPCODE[group[0][1].family]
            pairs = {}
            for j, ((wi, _), o) in enumerate(zip(group, group_outs)):
                pairs[f"w{j}"], pairs[f"out{j}"] = wi, o
            if op == JOINT and len(group) == 1:
                self.emit(PRODUCT, x=xs, w=group[0][0], out=group_outs[0])
            elif op == JOINT:
                self.emit(JOINT, x=xs, count=len(group), **pairs)
            else:
                kinds = [route.code for _, route in group]
                kinds += [kinds[0]] * (3 - len(kinds))
                self.emit(op, x=xs, count=len(group), **pairs, kind0=kinds[0], kind1=kinds[1], kind2=kinds[2],
                          q8=group[0][1].activations == "q8_0")


# -- a step's instructions, by what its kernel computes ---------------------------------------------
def _rms(b: Builder, r: tuple, w: tuple, kind: Rms, activations: str) -> None:
    b.emit(RMS, x=b.value(r[0]), scale=b.vector(r[1]), eps=b.epsilon(kind.eps), out=b.value(w[0]))


def _skip(b: Builder, r: tuple, w: tuple, kind: SkipRms, activations: str) -> None:
    b.emit(SKIP, x=b.value(r[0]), residual=b.value(r[1]), scale=b.vector(r[2]), eps=b.epsilon(kind.eps),
           total=b.value(w[0]), out=b.value(w[1]))


def _products(b: Builder, r: tuple, w: tuple, kind: Products, activations: str) -> None:
    b.products(b.value(r[0]), r[1:], [b.value(n) for n in w], activations)


def _swiglu(b: Builder, r: tuple, w: tuple, kind: SwiGlu, activations: str) -> None:
    gate = b.value(w[0])
    up = b.scratch(b.widths[gate])
    b.products(b.value(r[0]), r[1:3], [gate, up], activations)
    b.emit(SILU, gate=gate, up=up)


def _norm_products(b: Builder, r: tuple, w: tuple, kind: NormProducts, activations: str) -> None:
    normed = b.scratch(b.widths[b.value(r[0])])
    b.emit(RMS, x=b.value(r[0]), scale=b.vector(r[1]), eps=b.epsilon(kind.eps), out=normed)
    b.products(normed, r[2:3], [b.value(w[0])], activations)


#: What a kernel computes (its ``computes`` record's type) -> its instructions.
STEP_CODE = {Rms: _rms, SkipRms: _skip, Products: _products, SwiGlu: _swiglu, NormProducts: _norm_products}


def step_code(b: Builder, step, node, pass_on, activations: str) -> None:
    """``step``'s instructions, or :class:`Unsupported` (``pass_on``: the executor's kernel of
    the steps that pass a group's results on; ``activations``: its backend's)."""
    fn, kind = step.fn, getattr(step.fn, "computes", None)
    if fn is pass_on:
        for read, write in zip(step.reads, step.writes):
            b.alias(read, write)
        return
    if isinstance(node.op, Add) and kind is None:
        a, c = (b.value(n) for n in step.reads)
        out = b.value(step.writes[0])
        if not b.widths[a] == b.widths[c] == b.widths[out]:
            raise Unsupported(f"node {node.id}: an Add that broadcasts")
        b.emit(ADD, a=a, b=c, out=out)
        return
    if isinstance(fn, AttentionChain):
        _attention(b, step, fn)
        return
    if type(kind) not in STEP_CODE:
        raise Unsupported(f"node {node.id} ({type(node.op).__name__}) runs outside the numba backend's kernels")
    STEP_CODE[type(kind)](b, step.reads, step.writes, kind, activations)


def _attention(b: Builder, step, chain: AttentionChain) -> None:
    """The attention chain's instruction: its reads are (q, pos, k, v); writes (q_rot, k_rot,
    k_all, v_all, out) in the nodes' order, of which the KV views leave no value."""
    if not chain.fast:
        raise Unsupported("an attention chain off its vector cores")
    q, _, k, v = (step.reads[i] for i in chain.at)
    made = [step.writes[chain.order.index(j)] for j in range(5)]  # q_rot, k_rot, k_all, v_all, out
    rope = (chain.rope.rope_dim, float(chain.rope.base), chain.attn.head_dim)
    if b.rope not in (None, rope):
        raise Unsupported("attention chains of different rotations or head sizes")
    b.rope = rope
    for name in made[2:4]:
        b.values[name.removesuffix(SHARED)] = KV_VIEW
    cache = len(b.caches)
    b.caches.append(Cache(step.state_key, step.kv_cache, chain.widths[1]))
    a = chain.attn
    b.emit(ATTENTION, q=b.value(q), k=b.value(k), v=b.value(v), cache=cache, q_rot=b.value(made[0]),
           k_rot=b.value(made[1]), out=b.value(made[4]), heads=a.num_heads, kv_heads=a.kv_heads, head_dim=a.head_dim,
           causal=int(bool(a.causal)), window=chain.window, rope_head_dim=chain.rope.head_dim,
           rope_dim=chain.rope.rope_dim)


# -- the longest run ----------------------------------------------------------------------------------
def _activations(backend) -> str:
    """The activations of ``backend``'s products (``numba-q8``: q8_0)."""
    return getattr(backend, "activations", "f32")


def longest_run(steps: list, graph, specs: dict, constants: dict, backends: list, pass_on):
    """The longest run of steps ``steps[lo:hi]`` a program takes, as ``(lo, hi, builder)``, or why
    none (``inspect --plan``: what ended the longest run tried)."""
    best, why, tried = None, "no step the program takes", -1
    i = 0
    while i < len(steps):
        j, b, joined = i, Builder(specs, constants), False
        while j < len(steps):
            step = steps[j]
            try:
                step_code(b, step, graph.nodes[step.index], pass_on, _activations(backends[step.index]))
            except Unsupported as e:
                if j - i > tried:
                    why, tried = str(e), j - i
                break
            joined |= getattr(step.fn, "computes", None) is not None or isinstance(step.fn, AttentionChain)
            j += 1
        real = sum(step.fn is not pass_on for step in steps[i:j])
        if joined and real >= 2 and (best is None or j - i > best[1] - best[0]):
            best = (i, j)
        i = max(j, i + 1)
    if best is None:
        return why
    lo, hi = best
    # Made again: the step that ended the run may have left half its instructions in a builder.
    b = Builder(specs, constants)
    for step in steps[lo:hi]:
        step_code(b, step, graph.nodes[step.index], pass_on, _activations(backends[step.index]))
    return lo, hi, b


def borders(steps: list, lo: int, hi: int, graph, constants: dict) -> tuple[tuple, tuple]:
    """What ``steps[lo:hi]`` read from before them (not weights) and write for later steps or
    the graph's outputs."""
    made, reads = set(), {}
    for step in steps[lo:hi]:
        reads.update((n, None) for n in step.reads if n not in made and n not in constants and n != POS)
        made.update(step.writes)
    later = {n for step in steps[hi:] for n in step.reads} | set(graph.outputs)
    return tuple(reads), tuple(n for n in dict.fromkeys(w for s in steps[lo:hi] for w in s.writes) if n in later)


def allocate(b: Builder, reads: tuple, writes: tuple) -> tuple[list[int], int]:
    """Each slot's offset per row in the arena, slots reused after their last read (the values
    read from outside the program, and those it hands on, live throughout); and the arena's
    width per row."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, row in enumerate(b.code):
        for s in operands(row):
            first.setdefault(s, i)
            last[s] = i
    end = len(b.code)
    for n in (*reads, *writes):
        s = b.values[n.removesuffix(SHARED)]
        first[s], last[s] = 0 if n in reads else first.get(s, 0), end
    starts = [0] * len(b.widths)
    free: list[tuple[int, int]] = []  # (start, width) of free spans
    top = 0
    live: list[int] = []
    for s in sorted(first, key=lambda s: first[s]):
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
