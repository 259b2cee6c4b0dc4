"""``numba``: the small ops of a decode step and the matmul family, compiled and batch-invariant.

A decode step of a Llama-family model is mostly matrix-vector products, which BLAS runs at memory
bandwidth; between them come ~10 small ops per layer, on which numpy spends its dispatch and
temporaries: in a 30 ms token of ``benchmarks/bench_decode.py``'s model, Sdpa took 272 us a call,
FusedSkipNorm 60, Rope 48 -- 6 ms in all.  This backend compiles those ops with numba, one pass over
the data each (2-22 us a call):

- RmsNorm and FusedSkipNorm, any rank (rows of the last dim);
- Rope on ``[T, heads * head_dim]``, full or partial rotary;
- TokenEmbed on a block-quantized table (a GGUF's token embeddings): the gathered rows decoded in
  compiled code (:mod:`.compiled.gather`), the CPU library's bits;
- Sdpa and SdpaWindow without a mask input, on ``[Tq, heads * head_dim]`` queries and
  ``[Tk, kv_heads * head_dim]`` keys and values: grouped-query, end-aligned, causal or not,
  windowed, each key and value row read once, whole, for all the query heads (one pass over the
  keys, one over the values), on the vector cores of :mod:`.compiled.attention` for the usual
  head sizes -- faster than the CPU library's BLAS products at every size measured, from a decode
  step to a 2048-row prefill (``benchmarks/bench_attention.py``); other head sizes in numba's
  loops;
- a layer's Rope of q, Rope of k, KvCache and Sdpa as one compiled call (the executor's chains,
  :meth:`NumbaBackend.bind_chain`), the four nodes' bits;

and the matmul family -- Matmul (the lm_head and tied embeddings included), FusedNormMatmul,
FusedSwiGlu, LoraApply -- on the compiled products of :mod:`dist_runtime.backends.compiled`:
weights as stored (F32, F16, BF16, GGML blocks), read in place, threads over output rows,
batch-invariant; FusedSwiGlu's ``silu(gate) * up`` and FusedNormMatmul's norm compiled too.
Which activations a product multiplies its weight with is the product table's default for the
weight type (``NumbaBackend()``, the backend ``numba``: block types quantize the activations per
block as llama.cpp does, float types keep them f32), or one kind for all
(``activations="f32"``, ``numba-f32``; ``"q8_0"``, ``numba-q8``): ``--numerics auto|f32|q8``.  ``inspect --plan`` says per product which path runs it and why.

Every kernel here is batch-invariant (:attr:`NumbaBackend.batch_invariant`): a row's result is the
same bits whatever other rows share the call (a prompt fed in chunks, sessions batched), which
BLAS's blocked products are not.  That is how generation runs; the ``numpy-blas`` backend, asked
for by name, runs the matmul family on BLAS instead.

Its activations are F32 and its weights any type the compiled products read; every other dtype
and op it declines at plan time, and :func:`dist_runtime.backends.assign.assign_backends` sends
those nodes to the CPU library.  A node
whose inputs at run time leave the fast path (a large attention, an empty tensor, a shape the CPU
library would reject) is run by the CPU library's kernel, which gives the same result or the same
error.  Each op it takes is one entry of :attr:`NumbaBackend.ops`.
Results agree with the CPU library within float rounding (``tests/test_backends_numba.py``).

The small ops use no threads.  The products use numba's TBB threads when installed, else its
``workqueue`` pool (:mod:`.compiled.threads`), as many threads as the stage's CPU share
(``NUMBA_NUM_THREADS``, set per stage actor).  numba compiles each kernel on first use and caches
the machine code beside its source.  With numba installed, ``GraphExecutor(model)`` uses this
backend by default (:func:`dist_runtime.backends.default_backends`), and a node hinted ``numba``
(``BackendHint.NUMBA``) asks for it.
"""

from __future__ import annotations

from typing import Sequence

import numba  # noqa: F401 -- this backend's dependency: where it is missing, the error names it
import numpy as np

from dist_runtime.kernels.attention import KvState
from dist_runtime.kernels.positions import cos_sin_rows, position
from dist_runtime.kernels.quant import token_embed

from ..dtypes import DType
from ..errors import DistRuntimeError
from ..ir.graph import Node, TensorSpec
from ..ir.hints import BackendHint
from ..ir.ops import (FusedNormMatmul, FusedSkipNorm, FusedSwiGlu, KvCache, LoraApply, Matmul, OpPayload, RmsNorm,
                      Rope, Sdpa, SdpaWindow, TokenEmbed)
from ..tensor import Array, QuantizedArray
from . import BoundKernel, OpEntry, PerSegment, TableBackend, chain_reads, compiled, register_backend, run_chain
from .compiled import attention as compiled_attention
from .compiled import gather
from .compiled.rows import rms_rows, rope_append_attend, rope_rows, segments_append_attend, silu_mul, skip_rms_rows
from .step_kinds import NormProducts, Products, Rms, SkipRms, SwiGlu
from .blas import WEIGHT_SLOTS, matmul_family_supports
from .cpu import CpuBackend

F32 = np.dtype(np.float32)


def _rows(x: np.ndarray) -> np.ndarray:
    """``x`` as contiguous 2-D rows of its last dim (a view when it already is)."""
    return np.ascontiguousarray(x.reshape(-1, x.shape[-1]) if x.ndim != 2 else x)


def _rms_compiled(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RmsNorm of F32 ``x`` over its last dim, any rank."""
    out = np.empty(x.shape, F32)
    rms_rows(_rows(x), weight, eps, out.reshape(-1, x.shape[-1]))
    return out


def _is_f32(*arrays) -> bool:
    """Plain, non-empty F32 arrays (anything else is the CPU library's to run or reject)."""
    return all(type(a) is np.ndarray and a.dtype == F32 and a.size for a in arrays)


# -- the binders: ``binder(backend, node) -> BoundKernel``; off the fast path, the CPU library's kernel
def _bind_rms_norm(backend: NumbaBackend, node: Node) -> BoundKernel:
    op, reference = node.op, backend.reference(node)

    def run(inputs, ctx):
        x, weight = inputs
        if not (_is_f32(x, weight) and weight.shape == x.shape[-1:]):
            return reference(inputs, ctx)
        return (_rms_compiled(x, weight, op.eps),)
    run.computes = Rms(op.eps)
    return run


def _bind_skip_norm(backend: NumbaBackend, node: Node) -> BoundKernel:
    op, reference = node.op, backend.reference(node)

    def run(inputs, ctx):
        x, residual, weight = inputs
        if not (_is_f32(x, residual, weight) and residual.shape == x.shape
                and weight.shape == x.shape[-1:]):
            return reference(inputs, ctx)
        total, out = np.empty(x.shape, F32), np.empty(x.shape, F32)
        width = x.shape[-1]
        skip_rms_rows(_rows(x), _rows(residual), weight, op.eps,
                       total.reshape(-1, width), out.reshape(-1, width))
        return total, out
    run.computes = SkipRms(op.eps)
    return run


def _takes_weight(x, w) -> bool:
    """``x [..., K]`` F32 against a stored ``W [N, K]`` the compiled products read."""
    return _is_f32(x) and compiled.supports(w) and w.shape[1] == x.shape[-1]


def _bind_swiglu(backend: NumbaBackend, node: Node) -> BoundKernel:
    reference = backend.reference(node)

    def run(inputs, ctx):
        x, w_gate, w_up = inputs
        if not (_takes_weight(x, w_gate) and _takes_weight(x, w_up) and w_gate.shape == w_up.shape):
            return reference(inputs, ctx)
        gate, up = backend.linear_many(x, [w_gate, w_up])
        silu_mul(gate.reshape(-1), up.reshape(-1))
        return (gate,)
    run.computes = SwiGlu()
    return run


def _bind_norm_matmul(backend: NumbaBackend, node: Node) -> BoundKernel:
    op, reference = node.op, backend.reference(node)

    def run(inputs, ctx):
        x, norm_weight, w = inputs
        if not (_takes_weight(x, w) and _is_f32(norm_weight) and norm_weight.shape == x.shape[-1:]):
            return reference(inputs, ctx)
        return (backend.linear(_rms_compiled(x, norm_weight, op.eps), w),)
    run.computes = NormProducts(op.eps)
    return run


def _bind_matmul(backend: NumbaBackend, node: Node) -> BoundKernel:
    op, reference = node.op, backend.reference(node)

    def run(inputs, ctx):
        a, b = inputs
        if not (op.transpose_b and _takes_weight(a, b)):
            return reference(inputs, ctx)
        return (backend.linear(a, b),)
    if op.transpose_b:
        run.computes = Products()
    return run


def _bind_lora(backend: NumbaBackend, node: Node) -> BoundKernel:
    """The base product and both low-rank ones compiled: a row's result stays batch-invariant."""
    op, reference = node.op, backend.reference(node)

    def run(inputs, ctx):
        x, w, a, b = inputs
        if not (_takes_weight(x, w) and _takes_weight(x, a) and _is_f32(b) and b.ndim == 2
                and b.shape[1] == a.shape[0] and b.shape[0] == w.shape[0]):
            return reference(inputs, ctx)
        y = backend.linear(x, w)
        low = backend.linear(backend.linear(x, a), np.ascontiguousarray(b))
        low *= np.float32(op.scale)
        y += low
        return (y,)
    return run


def _bind_rope(backend: NumbaBackend, node: Node) -> BoundKernel:
    op, reference = node.op, backend.reference(node)

    def run(inputs, ctx):
        x, pos = inputs
        if not (_is_f32(x) and x.ndim == 2 and op.head_dim and x.shape[1] % op.head_dim == 0
                and op.rope_dim <= op.head_dim):
            return reference(inputs, ctx)
        cos, sin = cos_sin_rows(position("Rope", pos), x.shape[0], op.rope_dim, float(op.base))
        out = np.empty(x.shape, F32)
        rope_rows(_rows(x), cos, sin, op.head_dim, op.rope_dim, out)
        return (out,)
    return run


def _bits(buf: np.ndarray) -> np.ndarray:
    """A KV cache's buffer as compiled code writes it: F32, an F16 one as its uint16 bits
    (:func:`.compiled.halves.kept`), a Q8_0 one as its blocks' bytes (:mod:`.compiled.kv_q8`)."""
    return buf.view(np.uint16) if buf.dtype == np.float16 else buf


def _kv_rows(k, v) -> bool:
    """Keys and values the compiled attention reads: both F32, both F16, or both Q8_0 blocks of
    rows of a multiple of 32 values (a KV cache kept so)."""
    if type(k) is type(v) is QuantizedArray:
        return (k.dtype == v.dtype == DType.Q8_0 and len(k.shape) == 2 and k.shape[0] > 0
                and k.shape[1] % 32 == 0)
    return (type(k) is type(v) is np.ndarray and k.dtype == v.dtype
            and k.dtype in (np.float32, np.float16) and k.size > 0)


def _kv(x):
    """Keys or values as :func:`.compiled.attention.attention_rows` takes them (Q8_0 blocks as
    they are: a cache's views are contiguous rows)."""
    return x if isinstance(x, QuantizedArray) else _rows(x)


def _bind_attention(backend: NumbaBackend, node: Node) -> BoundKernel:
    op, reference = node.op, backend.reference(node)
    window = op.window if isinstance(op, SdpaWindow) else 0
    widths = (op.num_heads * op.head_dim, op.kv_heads * op.head_dim)

    def run(inputs, ctx):
        q, k, v = inputs
        compiled_attention.warm(op.head_dim)
        if not (_is_f32(q) and _kv_rows(k, v) and q.ndim == k.ndim == v.ndim == 2
                and k.shape[0] == v.shape[0]
                and (q.shape[1], k.shape[1]) == widths and v.shape[1] == widths[1]
                and not (op.causal and q.shape[0] > k.shape[0])):
            return reference(inputs, ctx)
        out = np.empty(q.shape, F32)
        compiled_attention.attention_rows(_rows(q), _kv(k), _kv(v), op.num_heads, op.kv_heads,
                                          op.head_dim, bool(op.causal), window, out)
        return (out,)
    return run


def _bind_token_embed(backend: NumbaBackend, node: Node) -> BoundKernel:
    reference = backend.reference(node)

    def run(inputs, ctx):
        ids, table = inputs
        if not (isinstance(table, QuantizedArray) and table.dtype in gather.DECODERS and len(table.shape) == 2):
            return reference(inputs, ctx)
        return (token_embed(ids, table, decode=gather.rows),)
    return run


def _attention_chain(nodes: Sequence[Node]) -> tuple[Node, Node, Node, Node] | None:
    """``(rope of q, rope of k, KvCache, attention)`` when the first four ``nodes`` are a layer's
    attention as Llama graphs spell it: two Ropes alike on one ``pos`` (either first), the KvCache
    appending the rotated keys, and an Sdpa or SdpaWindow without a mask attending the rotated
    queries over its K and V."""
    if len(nodes) < 4 or not (isinstance(nodes[0].op, Rope) and isinstance(nodes[1].op, Rope)
                              and isinstance(nodes[2].op, KvCache) and type(nodes[3].op) in (Sdpa, SdpaWindow)):
        return None
    a, b, kv, sdpa = nodes[:4]
    rope_q, rope_k = (a, b) if kv.inputs[0] == b.outputs[0] else (b, a)
    if not (a.op == b.op and a.inputs[1] == b.inputs[1] and kv.inputs[0] == rope_k.outputs[0]
            and len(kv.inputs) == 2 and len(sdpa.inputs) == 3
            and tuple(sdpa.inputs) == (rope_q.outputs[0], *kv.outputs[:2])):
        return None
    return rope_q, rope_k, kv, sdpa


class AttentionChain:
    """A layer's Rope of q, Rope of k, KvCache and Sdpa as one compiled call
    (:func:`.compiled.rows.rope_append_attend`; :meth:`NumbaBackend.bind_chain`), where the four nodes took ~75 us
    a layer of a decode step, their code and data cold after the layer's weights streamed through
    the caches.  The same bits as the four nodes alone and the same KV cache; off the fast path
    (another dtype, a head size without vector cores, a write the cache refuses) the four kernels
    in turn (:func:`run_chain`), each error naming its own node.  A batched pass's segments go in
    one call (:meth:`over_segments`)."""

    def __init__(self, nodes: Sequence[Node], kernels: Sequence[BoundKernel], rope_q: Node, rope_k: Node,
                 kv: Node, sdpa: Node) -> None:
        self.nodes, self.kernels = nodes, kernels
        self.rope, self.attn = rope_q.op, sdpa.op
        self.window = self.attn.window if isinstance(self.attn, SdpaWindow) else 0
        reads = chain_reads(nodes)
        self.at = [reads.index(name) for name in (rope_q.inputs[0], rope_q.inputs[1], rope_k.inputs[0], kv.inputs[1])]
        # where each of (q_rot, k_rot, k_all, v_all, out) goes among the nodes' outputs, in order
        made = [rope_q.outputs[0], rope_k.outputs[0], *kv.outputs[:2], sdpa.outputs[0]]
        self.order = [made.index(name) for node in nodes for name in node.outputs]
        self.widths = (self.attn.num_heads * self.attn.head_dim, self.attn.kv_heads * self.attn.head_dim)
        self.fast = (self.attn.head_dim in compiled_attention.HEAD_DIMS and self.rope.head_dim > 0
                     and self.rope.rope_dim <= self.rope.head_dim
                     and all(w % self.rope.head_dim == 0 for w in self.widths))
        self.spec = compiled_attention.SPECS((compiled.cpu.PATH, self.attn.head_dim)) if self.fast else None

    def _fits(self, q, k, v) -> bool:
        """The fast path's inputs: F32 rows of the widths the nodes declare."""
        t = q.shape[0] if getattr(q, "ndim", 0) == 2 else -1
        return (self.fast and _is_f32(q, k, v) and k.ndim == v.ndim == 2 and q.shape == (t, self.widths[0])
                and k.shape == v.shape == (t, self.widths[1]))

    def _rotation(self, pos, rows: int):
        return cos_sin_rows(position("Rope", pos), rows, self.rope.rope_dim, float(self.rope.base))

    def _attends_here(self, rows: int, keys: int) -> bool:
        """Whether the compiled call attends too (else :func:`compiled_attention.attention_rows`
        after it, threaded over the keys: a long context)."""
        return compiled_attention.serial(rows, keys, keys * self.widths[1] * 4)

    def _attend_later(self, q_rot, k_all, v_all, out) -> None:
        a = self.attn
        compiled_attention.attention_rows(q_rot, k_all, v_all, a.num_heads, a.kv_heads, a.head_dim, bool(a.causal),
                                          self.window, out)

    def _outputs(self, *made) -> tuple:
        return tuple(made[i] for i in self.order)

    def _prepare(self, pos, k, v, ctx) -> tuple:
        """One segment's rotation rows, room in its KV cache (every check the nodes make, before
        anything changes: a :class:`DistRuntimeError` leaves all as it was), the row it writes
        from, and whether the compiled call attends too."""
        t, at_row = k.shape[0], int(ctx.pos)
        cos, sin = self._rotation(pos, t)
        k_buf, v_buf = ctx.state.reserve(at_row, k, v)
        return cos, sin, k_buf, v_buf, at_row, self._attends_here(t, at_row + t)

    def _finish(self, ctx, at_row: int, k, v, attend: bool, q_rot, out) -> tuple:
        """One segment's K and V histories once its rows are stored, attending over them now if
        the compiled call did not."""
        k_all, v_all = ctx.state.commit(at_row, k, v)
        if not attend:
            self._attend_later(q_rot, k_all, v_all, out)
        return k_all, v_all

    def __call__(self, inputs, ctx) -> tuple:
        q, pos, k, v = (inputs[i] for i in self.at)
        compiled_attention.warm(self.attn.head_dim)
        if not (isinstance(ctx.state, KvState) and self._fits(q, k, v)):
            return run_chain(self.nodes, self.kernels, inputs, ctx)
        try:
            cos, sin, k_buf, v_buf, at_row, attend = self._prepare(pos, k, v, ctx)
        except DistRuntimeError:  # the nodes alone raise it, each naming itself
            return run_chain(self.nodes, self.kernels, inputs, ctx)
        q_rot, k_rot, out = np.empty(q.shape, F32), np.empty(k.shape, F32), np.empty(q.shape, F32)
        a, r = self.attn, self.rope
        rope_append_attend(self.spec, q, k, v, cos, sin, r.head_dim, r.rope_dim, _bits(k_buf), _bits(v_buf), at_row,
                           a.num_heads, a.kv_heads, a.head_dim, bool(a.causal), self.window, attend, q_rot, k_rot, out)
        k_all, v_all = self._finish(ctx, at_row, k, v, attend, q_rot, out)
        return self._outputs(q_rot, k_rot, k_all, v_all, out)

    def over_segments(self, inputs, cuts, ctxs) -> tuple | None:
        """A batched pass's segments in one compiled call, its threads taking segments
        (:func:`.compiled.rows.segments_append_attend`, each segment's cache by address: a compiled call takes
        no list of arrays): the pass's values, or None (the executor then calls this chain segment
        by segment) off the fast path or where a cache would refuse a write.  8 / 16 sessions'
        f32 decode step: 0.96 / 0.93x the time of segment by segment."""
        q, pos, k, v = (inputs[i] for i in self.at)
        compiled_attention.warm(self.attn.head_dim)
        if not (self._fits(q, k, v) and all(isinstance(c.state, KvState) for c in ctxs)
                and len({c.state.dtype for c in ctxs}) == 1):
            return None
        try:
            made = [self._prepare(pos[i], k[cut], v[cut], ctx) for i, (cut, ctx) in enumerate(zip(cuts, ctxs))]
        except DistRuntimeError:
            return None
        cos, sin, k_bufs, _, at_rows, attend = zip(*made)
        q_rot, k_rot, out = np.empty(q.shape, F32), np.empty(k.shape, F32), np.empty(q.shape, F32)
        a, r = self.attn, self.rope
        segments_append_attend(self.spec, q, k, v, np.concatenate(cos), np.concatenate(sin), r.head_dim, r.rope_dim,
                               np.array([cut.start for cut in cuts] + [q.shape[0]], np.int64),
                               np.array([ctx.state.addresses() for ctx in ctxs], np.int64),
                               _bits(k_bufs[0][:0]), np.array([b.shape[0] for b in k_bufs], np.int64),
                               np.array(at_rows, np.int64),
                               a.num_heads, a.kv_heads, a.head_dim, bool(a.causal), self.window, np.array(attend),
                               q_rot, k_rot, out)
        k_alls, v_alls = zip(*(self._finish(ctx, at_rows[i], k[cut], v[cut], attend[i], q_rot[cut], out[cut])
                               for i, (cut, ctx) in enumerate(zip(cuts, ctxs))))
        return self._outputs(q_rot, k_rot, PerSegment(k_alls), PerSegment(v_alls), out)


# -- what it takes at plan time (F32 inputs already checked) -----------------------------------------
def _rows_of_last_dim(op: OpPayload, input_specs: Sequence[TensorSpec]) -> bool:
    return len(input_specs[0].shape) >= 1


def _rope_rows_2d(op: Rope, input_specs: Sequence[TensorSpec]) -> bool:
    return len(input_specs[0].shape) == 2 and op.rope_dim % 2 == 0


def _block_table(op: TokenEmbed, input_specs: Sequence[TensorSpec]) -> bool:
    """Integer ids and a 2-D table of a block type :mod:`.compiled.gather` decodes (an F32 table's
    rows are a plain gather: the CPU library's)."""
    return (len(input_specs) == 2 and input_specs[0].dtype.is_integer and len(input_specs[1].shape) == 2
            and input_specs[1].dtype in gather.DECODERS)


def _attention_2d(op: Sdpa | SdpaWindow, input_specs: Sequence[TensorSpec]) -> bool:
    """No mask input, 2-D queries, keys and values, and a windowed op with a window."""
    return (len(input_specs) == 3 and all(len(s.shape) == 2 for s in input_specs) and op.kv_heads > 0
            and (op.window > 0 if isinstance(op, SdpaWindow) else True))


#: Ops whose :attr:`NumbaBackend.ops` entry checks its inputs' element types itself.
_OWN_TYPES = frozenset({TokenEmbed})


class NumbaBackend(TableBackend):
    """The small ops of a decode step, compiled (see the module docstring)."""

    name = "numba"
    dtypes = frozenset({DType.F32})
    ops = {
        RmsNorm: OpEntry(_rows_of_last_dim, _bind_rms_norm),
        FusedSkipNorm: OpEntry(_rows_of_last_dim, _bind_skip_norm),
        Rope: OpEntry(_rope_rows_2d, _bind_rope),
        TokenEmbed: OpEntry(_block_table, _bind_token_embed),
        Sdpa: OpEntry(_attention_2d, _bind_attention),
        SdpaWindow: OpEntry(_attention_2d, _bind_attention),
        FusedSwiGlu: OpEntry(matmul_family_supports, _bind_swiglu),
        FusedNormMatmul: OpEntry(matmul_family_supports, _bind_norm_matmul),
        Matmul: OpEntry(matmul_family_supports, _bind_matmul),
        LoraApply: OpEntry(matmul_family_supports, _bind_lora),
    }

    #: Every kernel computes a row as it would alone (see the module docstring).
    batch_invariant = True

    def __init__(self, hint: BackendHint = BackendHint.NUMBA, *, activations: str = "auto") -> None:
        if activations not in compiled.ACTIVATIONS:
            raise ValueError(f"activations must be one of {compiled.ACTIVATIONS}, got {activations!r}")
        self.hint = BackendHint(hint)
        self.activations = activations
        self.name = {"auto": "numba", "f32": "numba-f32", "q8_0": "numba-q8"}[activations]
        self.machine = compiled.init()  # the CPU path and threading layer, for inspect --plan
        self._cpu = CpuBackend()

    def supports(self, op: OpPayload, input_specs: Sequence[TensorSpec]) -> bool:
        """F32 everywhere, except the weights of the matmul family (any type of the product table:
        F32, F16, BF16, GGML blocks) and TokenEmbed's integer ids and block table."""
        entry = self.ops.get(type(op))
        if entry is None or not entry.supports(op, input_specs):
            return False
        if type(op) in _OWN_TYPES:  # its entry checked every input's type
            return True
        weights = WEIGHT_SLOTS.get(type(op), ())
        return all(s.dtype in (compiled.PRODUCTS if i in weights else self.dtypes)
                   for i, s in enumerate(input_specs))

    def detail(self, op: OpPayload, input_specs: Sequence[TensorSpec]) -> str | None:
        """How a product runs (``inspect --plan``): each weight type's route in the product table
        (:mod:`.compiled.products`) with this backend's activations."""
        if type(op) not in WEIGHT_SLOTS:
            return None
        types = sorted({input_specs[i].dtype for i in WEIGHT_SLOTS[type(op)] if i < len(input_specs)},
                       key=lambda d: d.name)
        routes = "; ".join(f"{d.name} on {r.tile}, {r.activations} activations"
                           for d, r in ((d, compiled.route(d, self.activations)) for d in types))
        return f"compiled product: {routes} ({self.machine})"

    def linear(self, x: np.ndarray, w: Array) -> np.ndarray:
        """``x [..., K] @ W[N, K]^T`` in F32 on the weight type's route (batch-invariant)."""
        y = compiled.linear(x.reshape(-1, x.shape[-1]), w, activations=self.activations)
        return y.reshape(*x.shape[:-1], w.shape[0])

    def linear_many(self, x: np.ndarray, ws: list[Array]) -> list[np.ndarray]:
        """``[self.linear(x, w) for w in ws]``, the compiled products in one launch
        (:func:`compiled.linear_many`)."""
        ys = compiled.linear_many(x.reshape(-1, x.shape[-1]), ws, activations=self.activations)
        return [y.reshape(*x.shape[:-1], w.shape[0]) for y, w in zip(ys, ws)]

    def bind_siblings(self, nodes: Sequence[Node]) -> BoundKernel | None:
        """One kernel for Matmuls reading the same ``x`` (the executor's shared launches: a
        layer's q, k and v): ``(x, W_1, .., W_n) -> (y_1, .., y_n)``, the products in one launch
        (:meth:`linear_many`, each row's bits as alone), or each node's own kernel off the fast
        path.  None for any other group."""
        if not all(isinstance(n.op, Matmul) and n.op.transpose_b for n in nodes):
            return None
        singles = [self.bind(n) for n in nodes]

        def run(inputs, ctx):
            x, ws = inputs[0], inputs[1:]
            if all(_takes_weight(x, w) for w in ws):
                return tuple(self.linear_many(x, list(ws)))
            return tuple(single([x, w], ctx)[0] for single, w in zip(singles, ws))
        run.computes = Products()
        return run

    def bind_chain(self, nodes: Sequence[Node], kernels: Sequence[BoundKernel],
                   backends: Sequence) -> tuple[int, BoundKernel] | None:
        """One kernel for a layer's Rope of q, Rope of k, KvCache and Sdpa (the executor's chains;
        :func:`_attention_chain`), the Ropes and the attention this backend's: an
        :class:`AttentionChain`."""
        found = _attention_chain(nodes)
        if found is None or not (backends[0] is backends[1] is backends[3] is self):
            return None
        return 4, AttentionChain(nodes[:4], kernels[:4], *found)

    def reference(self, node: Node) -> BoundKernel:
        """The CPU library's kernel for ``node``: what runs off the fast path."""
        return self._cpu.bind(node)


# Each weight type's default activations (the product table's), f32 ones everywhere, or llama.cpp's
# numerics everywhere: activations quantized to Q8_0 per block before integer dot products.
register_backend("numba", NumbaBackend)
register_backend("numba-f32", lambda: NumbaBackend(activations="f32"))
register_backend("numba-q8", lambda: NumbaBackend(activations="q8_0"))
