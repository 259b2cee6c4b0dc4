"""Shape rules: for each op, its output TensorSpecs from its payload and its input TensorSpecs.

Every rule has the signature ``rule(op, inputs) -> list[TensorSpec]``: ``op`` is the payload
instance (e.g. ``Rope(head_dim=64, rope_dim=32, base=1e4)``) and ``inputs`` the input specs.
``@rule(Rope)`` enters a rule in the op table as ``Rope.spec.shape`` (the only registration) and
its annotation names the payload class; this module imports ``ops.py``, never the reverse.
The caller has already checked the number of inputs against ``op.spec.inputs``; a rule returns
exactly ``op.spec.num_outputs(op)`` specs, with ``offset``/``size`` left None.  docs/ops.md gives
each op's maths; the rules below are that maths applied to shapes.

Conventions
-----------
* Shapes are numpy shapes (row-major, last dim contiguous).  A dim of ``-1`` is unknown until run
  time; any other negative dim is an error.
* A check that involves an unknown dim is skipped, never failed; an output dim computed from an
  unknown dim is unknown (``-1``), except that a product with a known ``0`` is ``0``.  Where two
  dims must be equal and one is unknown, the output takes the known one.  Unknown dims are
  assumed to be non-zero (a Reshape check may rely on it).
* Axes (``dim``, ``dim0``, ``perm``, ``axis``) may be negative and count from the end, as in numpy
  and torch; an axis outside ``[-rank, rank)`` is an error.
* Broadcasting is numpy's (ONNX "multidirectional"): shapes are right-aligned and a dim of 1
  stretches.  With an unknown dim the result is unknown: 4 with -1 gives -1, and 1 with -1 gives
  -1.  "Broadcastable to" (ONNX "unidirectional") means the operand stretches to a fixed target.
* Dtypes: activations are float types (F32, F16, BF16, F64).  Only weight slots may hold a GGML
  block type (Matmul ``b``, TokenEmbed ``table``, FusedNormMatmul ``W``, FusedSwiGlu ``W_gate`` and
  ``W_up``, LoraApply ``W``), besides the explicit (de)quantization inputs; a block tensor's last
  dim must be a multiple of its block size.  Layout ops (Transpose, Reshape, Permute, Concat,
  Split, Chunk) move any non-block element type.  An op's float output has the dtype of its first
  input; a table lookup (TokenEmbed, PosEmbed, RelativePosEmbedding) has its table's dtype, F32
  for a block table.
* A rule raises :class:`ShapeError` naming the op, the offending input (index, name, dtype and
  shape) and the numbers that disagree, e.g. ``Matmul: inner dims disagree: input 0 (a)
  f32[-1,4096] has K=4096, input 1 (b) f32[1024,4095] (transpose_b) has K=4095``.  No other
  exception escapes a rule, whatever the ranks, zero dims or payload values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NoReturn

from ..dtypes import DType
from ..errors import GraphValidationError
from .ops import (AdaLN, Add, Argmax, BatchNorm, CausalConv1d, Chunk, Clamp, Concat, Conv1d,
    Conv2d, Conv3d, ConvTranspose2d, DepthwiseConv, Dequantize, Div, FlashAttention, FlowStep,
    FusedNormMatmul, FusedSkipNorm, FusedSwiGlu, GeGlu, Gelu, Glu, GroupNorm, InstanceNorm,
    Interpolate, Kron, KvCache, KvCompress, KvDecompress, LayerNorm, LeakyRelu, LoraApply, Matmul,
    MatrixInverse, Mul, NanToNum, NoiseSchedule, PRelu, PatchEmbed, Permute, PixelShuffle,
    PixelUnshuffle, Pool, PosEmbed, Quantize, RelativePosEmbedding, Relu, Reshape, RmsNorm, Rope,
    Sample, Sdpa, SdpaCross, SdpaWindow, Sigmoid, Silu, SinusoidalEmbed, Softmax, Split, Sub,
    SwiGlu, Tanh, TokenEmbed, Transpose, Unpatchify)
from .payload import OPS_BY_NAME, OpPayload, ShapeRule
from .tensor_spec import TensorSpec

UNKNOWN = -1
Shape = tuple[int, ...]
Specs = list[TensorSpec]


def rule(*classes: type[OpPayload]) -> Callable[[ShapeRule], ShapeRule]:
    """Enter the decorated function in the op table as the shape rule of each of ``classes``."""

    def register(fn: ShapeRule) -> ShapeRule:
        for cls in classes:
            if cls.spec.shape is not None:
                raise AssertionError(f"{cls.__name__} has two shape rules")
            # OpSpec is frozen for everyone else; its rule can only be entered here, where the
            # payload classes are importable without a cycle, once per op at import time.
            object.__setattr__(cls.spec, "shape", fn)
        return fn

    return register


class ShapeError(GraphValidationError):
    """A shape rule rejected its inputs; the validator adds the node and its neighbours."""


# -- named inputs ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Arg:
    """One input of the node, with its position and its name in docs/ops.md."""

    index: int
    name: str
    spec: TensorSpec

    @property
    def shape(self) -> Shape:
        return self.spec.shape

    @property
    def dtype(self) -> DType:
        return self.spec.dtype

    @property
    def rank(self) -> int:
        return len(self.spec.shape)

    def __str__(self) -> str:
        return f"input {self.index} ({self.name}) {self.spec}"


def _args(op, inputs, *names: str) -> list[Arg | None]:
    """Name the inputs (absent optional inputs are None) and reject dims below -1."""
    args: list[Arg | None] = []
    for i, name in enumerate(names):
        if i >= len(inputs):
            args.append(None)
            continue
        arg = Arg(i, name, inputs[i])
        if any(d < UNKNOWN for d in arg.shape):
            _fail(op, f"{arg} has a negative dim; only -1 (unknown) is allowed")
        args.append(arg)
    return args


def _fail(op, message: str) -> NoReturn:
    raise ShapeError(f"{type(op).__name__}: {message}")


def _out(shape, dtype: DType) -> TensorSpec:
    return TensorSpec(tuple(shape), dtype)


def _fmt(shape: Shape) -> str:
    return f"[{','.join(map(str, shape))}]"


# -- dims --------------------------------------------------------------------------------------
def _agree(a: int, b: int) -> bool:
    """Two dims that must be equal: true when they are, or when either is unknown."""
    return a < 0 or b < 0 or a == b


def _merge(a: int, b: int) -> int:
    """The value of two agreeing dims: the known one, if any."""
    return a if a >= 0 else b


def _prod(dims) -> int:
    dims = tuple(dims)
    if 0 in dims:
        return 0
    if any(d < 0 for d in dims):
        return UNKNOWN
    return math.prod(dims)


def _sum(dims) -> int:
    dims = tuple(dims)
    return UNKNOWN if any(d < 0 for d in dims) else sum(dims)


def _div(a: int, b: int) -> int:
    """``a / b`` for a dim ``a`` the caller has checked is a multiple of ``b > 0``."""
    return a // b if a >= 0 else UNKNOWN


def _divides(op, arg: Arg, axis: int, by: int, why: str) -> None:
    d = arg.shape[axis]
    if by > 0 and d >= 0 and d % by:
        _fail(op, f"{arg}: dim {axis} is {d}, not a multiple of {by} ({why})")


def _axis(op, arg: Arg, axis: int, field: str = "dim") -> int:
    """Normalise a possibly negative axis of ``arg`` to ``0 <= axis < rank``."""
    if not -arg.rank <= axis < arg.rank:
        _fail(op, f"{field}={axis} is out of range for {arg} (rank {arg.rank})")
    return axis % arg.rank


def _bdim(a: int, b: int) -> int | None:
    """numpy broadcast of two dims; None if they are incompatible."""
    if a == b or b == 1:
        return a
    if a == 1:
        return b
    if a < 0 or b < 0:
        return UNKNOWN
    return None


def _broadcast(op, *parts: tuple[str, Shape]) -> Shape:
    """numpy broadcast of several ``(label, shape)``; the label names the shape in errors."""
    out: Shape = ()
    seen: list[str] = []
    for label, shape in parts:
        n = max(len(out), len(shape))
        a, b = (1,) * (n - len(out)) + out, (1,) * (n - len(shape)) + tuple(shape)
        dims = []
        for i, (x, y) in enumerate(zip(a, b)):
            d = _bdim(x, y)
            if d is None:
                so_far = f" (together {_fmt(out)})" if len(seen) > 1 else ""
                _fail(op, f"cannot broadcast {' and '.join(seen)}{so_far} with {label}: "
                          f"dim {i - n} is {x} vs {y}")
            dims.append(d)
        out = tuple(dims)
        seen.append(label)
    return out


def _broadcastable_to(op, arg: Arg | None, target: Shape, what: str) -> None:
    """``arg`` must stretch to ``target`` (ONNX unidirectional broadcasting)."""
    if arg is None:
        return
    if arg.rank > len(target):
        _fail(op, f"{arg} has more dims than {what}")
    for i in range(1, arg.rank + 1):
        d, t = arg.shape[-i], target[-i]
        if d != 1 and not _agree(d, t):
            _fail(op, f"{arg} is not broadcastable to {what}: dim {-i} is {d} vs {t}")


def _same_shape(op, a: Arg, b: Arg) -> Shape:
    """Two inputs of one shape (unknown dims agree with anything); the merged shape."""
    if a.rank != b.rank or not all(map(_agree, a.shape, b.shape)):
        _fail(op, f"{b} must have the shape of {a}")
    return tuple(map(_merge, a.shape, b.shape))


# -- ranks and dims of inputs ------------------------------------------------------------------
def _rank(op, arg: Arg | None, lo: int, hi: float = math.inf) -> None:
    if arg is None or lo <= arg.rank <= hi:
        return
    want = f"rank {lo}" if lo == hi else f"rank >= {lo}" if hi == math.inf else f"rank {lo}..{hi}"
    _fail(op, f"{arg} must have {want}, got rank {arg.rank}")


def _dim(op, arg: Arg, axis: int, expected: int, what: str) -> None:
    """``arg.shape[axis]`` must equal ``expected`` (skipped when either is unknown)."""
    if not _agree(arg.shape[axis], expected):
        _fail(op, f"{arg}: {what} must be {expected}, got {arg.shape[axis]}")


def _vector(op, arg: Arg | None, n: int, what: str) -> None:
    """An optional per-feature parameter of shape ``[n]`` (norm weight, bias, ...)."""
    if arg is None:
        return
    _rank(op, arg, 1, 1)
    _dim(op, arg, 0, n, f"its length ({what})")


def _linear_weight(op, x: Arg, w: Arg) -> int:
    """``w`` is a ``[N, K]`` matrix applied to ``x [..., K]`` as ``x @ w^T``; returns N."""
    _rank(op, w, 2, 2)
    if not _agree(x.shape[-1], w.shape[1]):
        _fail(op, f"inner dims disagree: {x} has K={x.shape[-1]}, {w} ([N, K]) has K={w.shape[1]}")
    return w.shape[0]


# -- dtypes ------------------------------------------------------------------------------------
FLOATS = "a float type (f32, f16, bf16, f64)"
BLOCK_KV = (DType.Q8_0, DType.Q4_0)
LINEAR_Q = (DType.I8, DType.U8)


def _float(op, *args: Arg | None) -> None:
    for a in args:
        if a is not None and not a.dtype.is_float:
            _fail(op, f"{a} must be {FLOATS}, got {a.dtype.name}")


def _plain(op, *args: Arg | None) -> None:
    """Any element type but a block type (layout ops, shape-only inputs)."""
    for a in args:
        if a is not None and a.dtype.is_quantized:
            _fail(op, f"{a} is a block-quantized type ({a.dtype.name}), not allowed here")


def _blocks(op, arg: Arg, dtype: DType) -> None:
    """``arg``'s last dim packs into blocks of ``dtype`` (a GGML block type)."""
    if arg.rank == 0:
        _fail(op, f"{arg}: {dtype.name} packs blocks along the last dim, which a scalar lacks")
    last = arg.shape[-1]
    if last >= 0 and last % dtype.block_size:
        _fail(op, f"{arg}: {dtype.name} packs {dtype.block_size} elements per block along the "
                  f"last dim, and {last} is not a multiple of {dtype.block_size}")


def _weight(op, *args: Arg | None) -> None:
    """A weight slot: a float type or a GGML block type."""
    for a in args:
        if a is None:
            continue
        if a.dtype.is_quantized:
            _blocks(op, a, a.dtype)
        elif not a.dtype.is_float:
            _fail(op, f"{a} must be {FLOATS} or a block-quantized type, got {a.dtype.name}")


def _integer(op, arg: Arg | None) -> None:
    if arg is not None and not arg.dtype.is_integer:
        _fail(op, f"{arg} must be an integer type (i8, i16, i32, i64, u8), got {arg.dtype.name}")


def _scalar(op, arg: Arg | None) -> None:
    """A one-element number (a position, a timestep, a seed): shape [] or [1]."""
    if arg is None:
        return
    if arg.rank > 1 or (arg.rank == 1 and arg.shape[0] not in (1, UNKNOWN)):
        _fail(op, f"{arg} must be a scalar, shape [] or [1]")
    if not (arg.dtype.is_float or arg.dtype.is_integer):
        _fail(op, f"{arg} must be a float or integer number, got {arg.dtype.name}")


# -- payload values ----------------------------------------------------------------------------
def _at_least(op, lo: int, *names: str) -> None:
    """Every payload field named ``name`` or ``name_<axis>`` must be >= lo."""
    for field, value in op.payload().items():
        if any(field == n or field.startswith(n + "_") for n in names) and value < lo:
            _fail(op, f"{field}={value} must be >= {lo}")


def _positive_finite(op, **values: float) -> None:
    for field, value in values.items():
        if not (math.isfinite(value) and value > 0):
            _fail(op, f"{field}={value:.7g} must be a finite number > 0")


def _one_of(op, field: str, allowed: dict[int, str]) -> None:
    value = getattr(op, field)
    if value not in allowed:
        names = ", ".join(f"{k} {v}" for k, v in allowed.items())
        _fail(op, f"{field}={value} is not one of {names}")


def _spatial(op, name: str) -> tuple[int, ...]:
    """A per-axis payload parameter: ``name`` (1-D ops) or ``name_d``, ``name_h``, ``name_w``."""
    if hasattr(op, name):
        return (getattr(op, name),)
    return tuple(getattr(op, f"{name}_{ax}") for ax in "dhw" if hasattr(op, f"{name}_{ax}"))


def _window_len(op, x: Arg, axis: int, k: int, s: int, p: int, d: int) -> int:
    """Output length of a conv / pool window along ``axis``: (L + 2p - d*(k-1) - 1)//s + 1."""
    length = x.shape[axis]
    if length < 0:
        return UNKNOWN
    n = (length + 2 * p - d * (k - 1) - 1) // s + 1
    if n < 1:
        _fail(op, f"{x}: dim {axis} of length {length} gives an output length {n} < 1 "
                  f"(kernel {k}, stride {s}, padding {p}, dilation {d})")
    return n


# -- 0..19: arithmetic and layout --------------------------------------------------------------
@rule(Matmul)
def matmul(op: Matmul, inputs: Specs) -> Specs:
    """numpy matmul; with ``transpose_b`` b is stored [..., N, K] and y = a @ b^T."""
    a, b = _args(op, inputs, "a", "b")
    _float(op, a)
    _weight(op, b)
    _rank(op, a, 1)
    _rank(op, b, 1)
    if b.rank == 1:  # a vector: [K], the added dim removed afterwards (numpy)
        kb, n = b.shape[0], ()
    elif op.transpose_b:
        kb, n = b.shape[-1], b.shape[-2:-1]
    else:
        kb, n = b.shape[-2], b.shape[-1:]
    if not _agree(a.shape[-1], kb):
        layout = " (transpose_b)" if op.transpose_b and b.rank > 1 else ""
        _fail(op, f"inner dims disagree: {a} has K={a.shape[-1]}, {b}{layout} has K={kb}")
    batch = _broadcast(op, (f"{a} batch dims", a.shape[:-2]), (f"{b} batch dims", b.shape[:-2]))
    return [_out(batch + a.shape[-2:-1] + n, a.dtype)]


@rule(Add, Mul, Sub, Div)
def broadcast(op: Add | Mul | Sub | Div, inputs: Specs) -> Specs:
    """Elementwise binary op with numpy broadcasting."""
    a, b = _args(op, inputs, "a", "b")
    _float(op, a, b)
    return [_out(_broadcast(op, (str(a), a.shape), (str(b), b.shape)), a.dtype)]


@rule(Clamp, NanToNum, Silu, Gelu, Relu, LeakyRelu, Sigmoid, Tanh)
def unary(op: Clamp | NanToNum | Silu | Gelu | Relu | LeakyRelu | Sigmoid | Tanh, inputs: Specs) -> Specs:
    """Elementwise op on one float tensor: same shape and dtype."""
    (x,) = _args(op, inputs, "x")
    _float(op, x)
    return [_out(x.shape, x.dtype)]


@rule(Transpose)
def transpose(op: Transpose, inputs: Specs) -> Specs:
    (x,) = _args(op, inputs, "x")
    _plain(op, x)
    d0, d1 = _axis(op, x, op.dim0, "dim0"), _axis(op, x, op.dim1, "dim1")
    shape = list(x.shape)
    shape[d0], shape[d1] = shape[d1], shape[d0]
    return [_out(shape, x.dtype)]


@rule(Reshape)
def reshape(op: Reshape, inputs: Specs) -> Specs:
    """ONNX Reshape, allowzero=0: a 0 copies the input dim at that index, one -1 is inferred."""
    (x,) = _args(op, inputs, "x")
    _plain(op, x)
    target = list(op.shape)
    if any(d < UNKNOWN for d in target) or target.count(UNKNOWN) > 1:
        _fail(op, f"shape {_fmt(op.shape)} may hold dims >= 0 and at most one -1")
    copied = [i for i, d in enumerate(target) if d == 0]
    if copied and copied[-1] >= x.rank:
        _fail(op, f"shape {_fmt(op.shape)} copies dim {copied[-1]} (a 0), but {x} has rank {x.rank}")
    out = [x.shape[i] if d == 0 else d for i, d in enumerate(target)]
    if any(x.shape[i] == 0 for i in copied):  # both sides are empty, whatever the rest
        if UNKNOWN in target:
            _fail(op, f"cannot infer the -1 of shape {_fmt(op.shape)} for {x}: it copies a 0 dim")
        return [_out(out, x.dtype)]
    # The copied dims are on both sides and cancel (an unknown one is assumed non-zero).
    rest_in = _prod(d for i, d in enumerate(x.shape) if i not in copied)
    rest_out = math.prod(d for d in target if d > 0)
    if rest_in >= 0 and (rest_in % rest_out if UNKNOWN in target else rest_in != rest_out):
        _fail(op, f"{x} cannot be reshaped to {_fmt(op.shape)}: {rest_in} elements against "
                  f"{rest_out}{' times the -1' if UNKNOWN in target else ''}"
                  f"{' (besides the copied dims)' if copied else ''}")
    if UNKNOWN in target:
        out[target.index(UNKNOWN)] = rest_in // rest_out if rest_in >= 0 else UNKNOWN
    return [_out(out, x.dtype)]


@rule(Permute)
def permute(op: Permute, inputs: Specs) -> Specs:
    """torch.permute: output dim i is input dim perm[i]."""
    (x,) = _args(op, inputs, "x")
    _plain(op, x)
    if len(op.perm) != x.rank:
        _fail(op, f"perm {_fmt(op.perm)} has {len(op.perm)} entries, but {x} has rank {x.rank}")
    axes = [_axis(op, x, p, "perm entry") for p in op.perm]
    if sorted(axes) != list(range(x.rank)):
        _fail(op, f"perm {_fmt(op.perm)} is not a permutation of the {x.rank} dims of {x}")
    return [_out([x.shape[a] for a in axes], x.dtype)]


@rule(Concat)
def concat(op: Concat, inputs: Specs) -> Specs:
    args = _args(op, inputs, *[f"x{i}" for i in range(len(inputs))])
    first = args[0]
    _plain(op, *args)
    _rank(op, first, 1)
    axis = _axis(op, first, op.dim)
    out = list(first.shape)
    for a in args[1:]:
        if a.dtype != first.dtype or a.rank != first.rank:
            _fail(op, f"{a} must have the dtype and rank of {first}")
        for i, d in enumerate(a.shape):
            if i != axis and not _agree(d, out[i]):
                _fail(op, f"{a} differs from the other inputs at dim {i} ({d} vs {out[i]}); "
                          f"only dim {axis} may differ")
            out[i] = _merge(out[i], d)
    out[axis] = _sum(a.shape[axis] for a in args)
    return [_out(out, first.dtype)]


@rule(Split)
def split(op: Split, inputs: Specs) -> Specs:
    (x,) = _args(op, inputs, "x")
    _plain(op, x)
    _rank(op, x, 1)
    axis = _axis(op, x, op.dim)
    if not op.sizes or min(op.sizes) < 0:
        _fail(op, f"sizes {_fmt(op.sizes)} must be a non-empty list of sizes >= 0")
    if not _agree(x.shape[axis], sum(op.sizes)):
        _fail(op, f"sizes {_fmt(op.sizes)} sum to {sum(op.sizes)}, but {x} has "
                  f"{x.shape[axis]} at dim {axis}")
    return [_out(x.shape[:axis] + (s,) + x.shape[axis + 1:], x.dtype) for s in op.sizes]


@rule(Chunk)
def chunk(op: Chunk, inputs: Specs) -> Specs:
    (x,) = _args(op, inputs, "x")
    _plain(op, x)
    _rank(op, x, 1)
    _at_least(op, 1, "chunks")
    axis = _axis(op, x, op.dim)
    _divides(op, x, axis, op.chunks, f"chunks={op.chunks} must divide it evenly")
    piece = _div(x.shape[axis], op.chunks)
    return [_out(x.shape[:axis] + (piece,) + x.shape[axis + 1:], x.dtype)] * op.chunks


# -- 20..39: attention and positions -----------------------------------------------------------
@rule(Sdpa, SdpaCross, SdpaWindow, FlashAttention)
def sdpa(op: Sdpa | SdpaCross | SdpaWindow | FlashAttention, inputs: Specs) -> Specs:
    """Sdpa, SdpaCross, SdpaWindow, FlashAttention: q [..., Tq, H*hd], k, v [..., Tk, KV*hd]."""
    q, k, v, mask = _args(op, inputs, "q", "k", "v", "mask")
    _at_least(op, 1, "num_heads", "kv_heads", "head_dim", "window", "block")
    heads, kv_heads, hd = op.num_heads, op.kv_heads, op.head_dim
    if heads % kv_heads:
        _fail(op, f"num_heads={heads} is not a multiple of kv_heads={kv_heads}")
    _float(op, q, k, v, mask)
    for a in (q, k, v):
        _rank(op, a, 2)
    _dim(op, q, -1, heads * hd, f"the width (num_heads*head_dim = {heads}*{hd})")
    _dim(op, k, -1, kv_heads * hd, f"the width (kv_heads*head_dim = {kv_heads}*{hd})")
    _dim(op, v, -1, kv_heads * hd, f"the width (kv_heads*head_dim = {kv_heads}*{hd})")
    if not _agree(k.shape[-2], v.shape[-2]):
        _fail(op, f"{k} and {v} must have the same sequence length (dim -2)")
    tq, tk = q.shape[-2], _merge(k.shape[-2], v.shape[-2])
    if getattr(op, "causal", False) and tq > tk >= 0:
        _fail(op, f"causal attention needs Tq <= Tk, but {q} has Tq={tq} and {k} has Tk={tk}")
    batch = _broadcast(op, *((f"{a} batch dims", a.shape[:-2]) for a in (q, k, v)))
    scores = batch + (heads, tq, tk)
    _broadcastable_to(op, mask, scores, f"the scores [..., num_heads, Tq, Tk] = {_fmt(scores)}")
    return [_out(batch + (tq, heads * hd), q.dtype)]


def _kv_stored(op, arg: Arg) -> None:
    """A K or V tensor as a cache stores it: a float type, or Q8_0 / Q4_0 blocks."""
    if not (arg.dtype.is_float or arg.dtype in BLOCK_KV):
        _fail(op, f"{arg} must be {FLOATS}, Q8_0 or Q4_0, got {arg.dtype.name}")
    if arg.dtype.is_quantized:
        _blocks(op, arg, arg.dtype)


@rule(KvCache)
def kv_cache(op: KvCache, inputs: Specs) -> Specs:
    """K_new, V_new [..., T, width] -> K_full, V_full [..., -1, width] (past + T rows)."""
    k, v = _args(op, inputs, "k_new", "v_new")
    for a in (k, v):
        _rank(op, a, 2)
        _kv_stored(op, a)
    if k.rank != v.rank or not all(map(_agree, k.shape[:-1], v.shape[:-1])):
        _fail(op, f"{k} and {v} must agree on every dim but the last")
    lead = tuple(map(_merge, k.shape[:-2], v.shape[:-2]))
    return [_out(lead + (UNKNOWN, a.shape[-1]), a.dtype) for a in (k, v)]


@rule(KvCompress)
def kv_compress(op: KvCompress, inputs: Specs) -> Specs:
    (x,) = _args(op, inputs, "x")
    _float(op, x)
    if op.dtype not in BLOCK_KV + (DType.F16, DType.BF16):
        _fail(op, f"dtype={op.dtype.name} is not a KV storage type (Q8_0, Q4_0, F16, BF16)")
    if op.dtype.is_quantized:
        _blocks(op, x, op.dtype)
    return [_out(x.shape, op.dtype)]


@rule(KvDecompress)
def kv_decompress(op: KvDecompress, inputs: Specs) -> Specs:
    (x,) = _args(op, inputs, "x")
    _kv_stored(op, x)
    if not op.dtype.is_float:
        _fail(op, f"dtype={op.dtype.name} must be a float type (F32)")
    return [_out(x.shape, op.dtype)]


@rule(Rope)
def rope(op: Rope, inputs: Specs) -> Specs:
    """x [..., T, n*head_dim], pos []/[1] -> x's shape."""
    x, pos = _args(op, inputs, "x", "pos")
    _at_least(op, 1, "head_dim")
    if not (2 <= op.rope_dim <= op.head_dim and op.rope_dim % 2 == 0):
        _fail(op, f"rope_dim={op.rope_dim} must be even, >= 2 and <= head_dim={op.head_dim}")
    _positive_finite(op, base=op.base)
    _float(op, x)
    _rank(op, x, 2)
    _divides(op, x, -1, op.head_dim, f"whole heads of head_dim={op.head_dim}")
    _scalar(op, pos)
    return [_out(x.shape, x.dtype)]


@rule(SinusoidalEmbed)
def sinusoidal_embed(op: SinusoidalEmbed, inputs: Specs) -> Specs:
    """timesteps [N] (or []) -> [N, dim] (or [dim]) f32."""
    (t,) = _args(op, inputs, "timesteps")
    _at_least(op, 1, "dim")
    _positive_finite(op, max_period=op.max_period)
    half = op.dim // 2
    if not math.isfinite(op.downscale_freq_shift) or (half and half == op.downscale_freq_shift):
        _fail(op, f"downscale_freq_shift={op.downscale_freq_shift} must be finite and differ "
                  f"from dim//2={half} (the exponent divides by their difference)")
    _rank(op, t, 0, 1)
    if not (t.dtype.is_float or t.dtype.is_integer):
        _fail(op, f"{t} must be a float or integer type, got {t.dtype.name}")
    return [_out(t.shape + (op.dim,), DType.F32)]


@rule(RelativePosEmbedding)
def relative_pos_embedding(op: RelativePosEmbedding, inputs: Specs) -> Specs:
    """q [..., Tq, *], k [..., Tk, *], table [num_buckets, H], pos? -> [H, Tq, Tk]."""
    q, k, table, pos = _args(op, inputs, "q", "k", "table", "pos")
    buckets = op.num_buckets // 2 if op.bidirectional else op.num_buckets
    if buckets // 2 < 1:
        _fail(op, f"num_buckets={op.num_buckets} is too small for T5 bucketing "
                  f"(needs >= {4 if op.bidirectional else 2})")
    if op.max_distance <= buckets // 2:
        _fail(op, f"max_distance={op.max_distance} must exceed the exact range "
                  f"{buckets // 2} (the log bucket divides by log(max_distance / {buckets // 2}))")
    _plain(op, q, k)
    _rank(op, q, 2)
    _rank(op, k, 2)
    _float(op, table)
    _rank(op, table, 2, 2)
    _dim(op, table, 0, op.num_buckets, "dim 0 (num_buckets)")
    _scalar(op, pos)
    return [_out((table.shape[1], q.shape[-2], k.shape[-2]), table.dtype)]


# -- 40..59: normalisation ---------------------------------------------------------------------
@rule(RmsNorm, LayerNorm)
def norm_last(op: RmsNorm | LayerNorm, inputs: Specs) -> Specs:
    """RmsNorm, LayerNorm: x [..., D], weight [D], bias [D]."""
    x, weight, bias = _args(op, inputs, "x", "weight", "bias")
    _float(op, x, weight, bias)
    _rank(op, x, 1)
    for p in (weight, bias):
        _vector(op, p, x.shape[-1], f"D, the last dim of {x}")
    return [_out(x.shape, x.dtype)]


@rule(BatchNorm, GroupNorm, InstanceNorm)
def norm_channels(op: BatchNorm | GroupNorm | InstanceNorm, inputs: Specs) -> Specs:
    """BatchNorm (x, scale, bias, mean, var), GroupNorm / InstanceNorm (x, weight?, bias?)."""
    batch = hasattr(op, "momentum")
    names = ("x", "scale", "bias", "mean", "var") if batch else ("x", "weight", "bias")
    x, *params = _args(op, inputs, *names)
    _float(op, x, *params)
    instance = not batch and not hasattr(op, "num_groups")
    _rank(op, x, 3 if instance else 2)
    channels = x.shape[1]
    if hasattr(op, "num_groups"):
        _at_least(op, 1, "num_groups")
        _divides(op, x, 1, op.num_groups, f"channels split into num_groups={op.num_groups}")
    for p in params:
        _vector(op, p, channels, f"C, dim 1 of {x}")
    return [_out(x.shape, x.dtype)]


@rule(AdaLN)
def ada_ln(op: AdaLN, inputs: Specs) -> Specs:
    """x [..., D]; shift and scale broadcastable to x."""
    x, shift, scale = _args(op, inputs, "x", "shift", "scale")
    _float(op, x, shift, scale)
    _rank(op, x, 1)
    for p in (shift, scale):
        _broadcastable_to(op, p, x.shape, str(x))
    return [_out(x.shape, x.dtype)]


# -- 60..79: activations -----------------------------------------------------------------------
def _halves(op, x: Arg, axis: int) -> Shape:
    """The shape of one half of ``x`` split along ``axis`` (which must be even)."""
    _divides(op, x, axis, 2, "it is split into two halves")
    return x.shape[:axis] + (_div(x.shape[axis], 2),) + x.shape[axis + 1:]


@rule(GeGlu, SwiGlu)
def gated(op: GeGlu | SwiGlu, inputs: Specs) -> Specs:
    """GeGlu, SwiGlu: one input split in halves along the last dim, or two broadcast inputs."""
    if len(inputs) == 1:
        (x,) = _args(op, inputs, "x")
        _float(op, x)
        _rank(op, x, 1)
        return [_out(_halves(op, x, x.rank - 1), x.dtype)]
    a, b = _args(op, inputs, "a", "b")
    _float(op, a, b)
    return [_out(_broadcast(op, (str(a), a.shape), (str(b), b.shape)), a.dtype)]


@rule(Glu)
def glu(op: Glu, inputs: Specs) -> Specs:
    (x,) = _args(op, inputs, "x")
    _float(op, x)
    return [_out(_halves(op, x, _axis(op, x, op.dim)), x.dtype)]


@rule(PRelu)
def prelu(op: PRelu, inputs: Specs) -> Specs:
    x, slope = _args(op, inputs, "x", "slope")
    _float(op, x, slope)
    _broadcastable_to(op, slope, x.shape, str(x))
    return [_out(x.shape, x.dtype)]


@rule(Softmax)
def softmax(op: Softmax, inputs: Specs) -> Specs:
    (x,) = _args(op, inputs, "x")
    _float(op, x)
    _axis(op, x, op.dim)
    return [_out(x.shape, x.dtype)]


# -- 80..99: convolution and pooling -----------------------------------------------------------
def _conv_io(op, inputs, kernel: tuple[int, ...], transposed: bool = False) -> tuple[Arg, int]:
    """Check x [N, C, *L], weight and bias [O]; return (x, O).

    The weight is [O, C/groups, *kernel], or [C, O/groups, *kernel] when ``transposed``;
    a payload without ``groups`` (DepthwiseConv) has groups = C and weight [C*m, 1, *kernel].
    """
    x, w, bias = _args(op, inputs, "x", "weight", "bias")
    _float(op, x, w, bias)
    rank = len(kernel) + 2
    _rank(op, x, rank, rank)
    _rank(op, w, rank, rank)
    channels = x.shape[1]
    groups = getattr(op, "groups", None)
    if groups is None:  # depthwise
        _dim(op, w, 1, 1, "dim 1 (one input channel per group)")
        if channels > 0:
            _divides(op, w, 0, channels, f"C={channels} groups of output channels")
        out_channels = w.shape[0]
    elif transposed:
        _dim(op, w, 0, channels, f"dim 0 (C, dim 1 of {x})")
        _divides(op, w, 0, groups, f"groups={groups}")
        _divides(op, x, 1, groups, f"groups={groups}")
        out_channels = _prod((w.shape[1], groups))
    else:
        _divides(op, x, 1, groups, f"groups={groups}")
        _divides(op, w, 0, groups, f"groups={groups}")
        _dim(op, w, 1, _div(channels, groups), f"dim 1 (C/groups, C = dim 1 of {x})")
        out_channels = w.shape[0]
    for i, kk in enumerate(kernel):
        _dim(op, w, i + 2, kk, f"dim {i + 2} (the kernel size)")
    _vector(op, bias, out_channels, "the number of output channels")
    return x, out_channels


@rule(Conv1d, Conv2d, Conv3d, DepthwiseConv)
def conv(op: Conv1d | Conv2d | Conv3d | DepthwiseConv, inputs: Specs) -> Specs:
    """Conv1d, Conv2d, Conv3d, DepthwiseConv (the spatial rank comes from the payload fields)."""
    _at_least(op, 1, "kernel", "stride", "dilation", "groups")
    kernel, stride, pad, dil = (_spatial(op, f) for f in ("kernel", "stride", "padding", "dilation"))
    x, out_channels = _conv_io(op, inputs, kernel)
    lengths = tuple(_window_len(op, x, i + 2, *p) for i, p in enumerate(zip(kernel, stride, pad, dil)))
    return [_out((x.shape[0], out_channels) + lengths, x.dtype)]


@rule(ConvTranspose2d)
def conv_transpose(op: ConvTranspose2d, inputs: Specs) -> Specs:
    """out = (L-1)*stride - 2*padding + dilation*(kernel-1) + output_padding + 1."""
    _at_least(op, 1, "kernel", "stride", "dilation", "groups")
    kernel, stride, pad, dil, extra = (_spatial(op, f) for f in (
        "kernel", "stride", "padding", "dilation", "output_padding"))
    for ax, s, d, e in zip("hw", stride, dil, extra):
        if e >= max(s, d):
            _fail(op, f"output_padding_{ax}={e} must be smaller than stride_{ax}={s} "
                      f"or dilation_{ax}={d}")
    x, out_channels = _conv_io(op, inputs, kernel, transposed=True)
    lengths = []
    for i, (k, s, p, d, e) in enumerate(zip(kernel, stride, pad, dil, extra)):
        length = x.shape[i + 2]
        n = (length - 1) * s - 2 * p + d * (k - 1) + e + 1 if length >= 0 else UNKNOWN
        if length >= 0 and n < 1:
            _fail(op, f"{x}: dim {i + 2} of length {length} gives an output length {n} < 1")
        lengths.append(n)
    return [_out((x.shape[0], out_channels, *lengths), x.dtype)]


@rule(CausalConv1d)
def causal_conv1d(op: CausalConv1d, inputs: Specs) -> Specs:
    """x [N, C, L] -> [N, O, L] (left padding (kernel-1)*dilation, stride 1)."""
    _at_least(op, 1, "kernel", "dilation", "groups")
    x, out_channels = _conv_io(op, inputs, (op.kernel,))
    return [_out((x.shape[0], out_channels, x.shape[2]), x.dtype)]


@rule(Pool)
def pool(op: Pool, inputs: Specs) -> Specs:
    """[N, C, H, W] pooled over H, W; [N, C, L] pooled over L (the *_h fields trivial)."""
    (x,) = _args(op, inputs, "x")
    _one_of(op, "mode", {0: "max", 1: "avg"})
    _at_least(op, 1, "kernel", "stride")
    _float(op, x)
    _rank(op, x, 3, 4)
    if x.rank == 3 and (op.kernel_h, op.stride_h, op.padding_h) != (1, 1, 0):
        _fail(op, f"{x} is pooled along its last dim only: kernel_h and stride_h must be 1 and "
                  f"padding_h 0, got {op.kernel_h}, {op.stride_h}, {op.padding_h}")
    axes = ("h", "w")[4 - x.rank:]
    lengths = []
    for i, ax in enumerate(axes):
        k, s, p = (getattr(op, f"{f}_{ax}") for f in ("kernel", "stride", "padding"))
        if 2 * p > k:
            _fail(op, f"padding_{ax}={p} must be at most half of kernel_{ax}={k}")
        lengths.append(_window_len(op, x, i + 2, k, s, p, 1))
    return [_out(x.shape[:2] + tuple(lengths), x.dtype)]


# -- 100..119: resampling and patches ----------------------------------------------------------
def _resized(op, x: Arg, axis: int, size: int, scale: float, ax: str) -> int:
    if size:
        return size
    _positive_finite(op, **{f"scale_{ax}": scale})
    length = x.shape[axis]
    if length < 0:
        return UNKNOWN
    n = math.floor(length * scale)
    if n < 1:
        _fail(op, f"{x}: dim {axis} of length {length} times scale_{ax}={scale:.7g} is {n} < 1 "
                  f"(set out_{ax} instead)")
    return n


@rule(Interpolate)
def interpolate(op: Interpolate, inputs: Specs) -> Specs:
    """Resize the last two dims to out_h, out_w, or floor(H*scale_h), floor(W*scale_w)."""
    (x,) = _args(op, inputs, "x")
    _one_of(op, "mode", {0: "nearest", 1: "bilinear", 2: "bicubic"})
    if op.mode == 0 and op.align_corners:
        _fail(op, "align_corners applies to bilinear and bicubic only, not to mode 0 nearest")
    _float(op, x)
    _rank(op, x, 2)
    h = _resized(op, x, x.rank - 2, op.out_h, op.scale_h, "h")
    w = _resized(op, x, x.rank - 1, op.out_w, op.scale_w, "w")
    return [_out(x.shape[:-2] + (h, w), x.dtype)]


@rule(PixelShuffle)
def pixel_shuffle(op: PixelShuffle, inputs: Specs) -> Specs:
    """[..., C*r*r, H, W] -> [..., C, H*r, W*r]."""
    (x,) = _args(op, inputs, "x")
    _at_least(op, 1, "upscale")
    r = op.upscale
    _float(op, x)
    _rank(op, x, 3)
    _divides(op, x, -3, r * r, f"upscale**2 = {r * r}")
    c, h, w = x.shape[-3:]
    return [_out(x.shape[:-3] + (_div(c, r * r), _prod((h, r)), _prod((w, r))), x.dtype)]


@rule(PixelUnshuffle)
def pixel_unshuffle(op: PixelUnshuffle, inputs: Specs) -> Specs:
    """[..., C, H*r, W*r] -> [..., C*r*r, H, W]."""
    (x,) = _args(op, inputs, "x")
    _at_least(op, 1, "downscale")
    r = op.downscale
    _float(op, x)
    _rank(op, x, 3)
    _divides(op, x, -2, r, f"downscale={r}")
    _divides(op, x, -1, r, f"downscale={r}")
    c, h, w = x.shape[-3:]
    return [_out(x.shape[:-3] + (_prod((c, r * r)), _div(h, r), _div(w, r)), x.dtype)]


@rule(PatchEmbed)
def patch_embed(op: PatchEmbed, inputs: Specs) -> Specs:
    """image [N, C, H, W], weight [D, C, ph, pw], bias [D] -> [N, (H/ph)*(W/pw), D]."""
    x, w, bias = _args(op, inputs, "x", "weight", "bias")
    _at_least(op, 1, "patch")
    _float(op, x, w, bias)
    _rank(op, x, 4, 4)
    _rank(op, w, 4, 4)
    _dim(op, w, 1, x.shape[1], f"dim 1 (C, dim 1 of {x})")
    _dim(op, w, 2, op.patch_h, "dim 2 (patch_h)")
    _dim(op, w, 3, op.patch_w, "dim 3 (patch_w)")
    _divides(op, x, 2, op.patch_h, f"patch_h={op.patch_h}")
    _divides(op, x, 3, op.patch_w, f"patch_w={op.patch_w}")
    _vector(op, bias, w.shape[0], f"D, dim 0 of {w}")
    patches = _prod((_div(x.shape[2], op.patch_h), _div(x.shape[3], op.patch_w)))
    return [_out((x.shape[0], patches, w.shape[0]), x.dtype)]


@rule(Unpatchify)
def unpatchify(op: Unpatchify, inputs: Specs) -> Specs:
    """[N, gh*gw, ph*pw*C] -> [N, C, gh*ph, gw*pw]."""
    (x,) = _args(op, inputs, "x")
    _at_least(op, 1, "patch", "channels", "grid")
    _float(op, x)
    _rank(op, x, 3, 3)
    _dim(op, x, 1, op.grid_h * op.grid_w, f"dim 1 (grid_h*grid_w = {op.grid_h}*{op.grid_w})")
    _dim(op, x, 2, op.patch_h * op.patch_w * op.channels,
         f"dim 2 (patch_h*patch_w*channels = {op.patch_h}*{op.patch_w}*{op.channels})")
    shape = (x.shape[0], op.channels, op.grid_h * op.patch_h, op.grid_w * op.patch_w)
    return [_out(shape, x.dtype)]


# -- 120..139: embeddings ----------------------------------------------------------------------
@rule(TokenEmbed)
def token_embed(op: TokenEmbed, inputs: Specs) -> Specs:
    """ids [...] (integer), table [V, D] (float or block) -> [..., D]."""
    ids, table = _args(op, inputs, "ids", "table")
    _integer(op, ids)
    _weight(op, table)
    _rank(op, table, 2, 2)
    dtype = DType.F32 if table.dtype.is_quantized else table.dtype
    return [_out(ids.shape + table.shape[1:], dtype)]


@rule(PosEmbed)
def pos_embed(op: PosEmbed, inputs: Specs) -> Specs:
    """x [..., T, *], table [P, D], pos? -> [T, D]."""
    x, table, pos = _args(op, inputs, "x", "table", "pos")
    _plain(op, x)
    _rank(op, x, 2)
    _float(op, table)
    _rank(op, table, 2, 2)
    _scalar(op, pos)
    t, rows = x.shape[-2], table.shape[0]
    if t >= 0 and rows >= 0 and op.offset + t > rows:
        _fail(op, f"rows {op.offset}..{op.offset + t - 1} (offset..offset+T-1, plus pos) are "
                  f"past the end of {table} (T = {t} from {x})")
    return [_out((t, table.shape[1]), table.dtype)]


# -- 140..159: generation, schedulers, quantization --------------------------------------------
@rule(NoiseSchedule, FlowStep)
def scheduler_step(op: NoiseSchedule | FlowStep, inputs: Specs) -> Specs:
    """NoiseSchedule (sample, model_output, t, t_prev), FlowStep (sample, velocity, t, t_next)."""
    flow = hasattr(op, "shift")
    names = ("sample", "velocity", "t", "t_next") if flow else ("sample", "model_output", "t", "t_prev")
    sample, model_out, t, t_other = _args(op, inputs, *names)
    if flow:
        _positive_finite(op, shift=op.shift)
    else:
        _at_least(op, 1, "num_train_timesteps")
        _one_of(op, "beta_schedule", {0: "linear", 1: "scaled_linear", 2: "squaredcos_cap_v2"})
        _one_of(op, "prediction_type", {0: "epsilon", 1: "v_prediction", 2: "sample"})
        for field in ("beta_start", "beta_end"):
            value = getattr(op, field)
            if not 0 <= value < 1:
                _fail(op, f"{field}={value} must be in [0, 1)")
    _float(op, sample, model_out)
    shape = _same_shape(op, sample, model_out)
    _scalar(op, t)
    _scalar(op, t_other)
    return [_out(shape, sample.dtype)]


def _linear_params(op, x: Arg, scale: Arg, zero_point: Arg | None, zp_dtype: DType) -> None:
    """ONNX QuantizeLinear / DequantizeLinear parameters: per tensor ([] or [1]) or per axis."""
    _float(op, scale)
    _rank(op, scale, 0, 1)
    if scale.rank == 1 and scale.shape[0] != 1:  # per axis
        axis = _axis(op, x, op.axis, "axis")
        _dim(op, scale, 0, x.shape[axis], f"its length (dim {axis} of {x}, per-axis)")
    if zero_point is not None:
        if zero_point.dtype != zp_dtype:
            _fail(op, f"{zero_point} must have dtype {zp_dtype.name}")
        _same_shape(op, scale, zero_point)


def _quant_params(op, x, scale, zero_point, qtype, blocks: bool, n_inputs: int, linear: str) -> bool:
    """Check the scale inputs of a (de)quantization to/from ``qtype``: none for GGML blocks (they
    carry their own), a scale (and zero point) for linear I8/U8.  False for any other type."""
    if blocks:
        if scale is not None:
            _fail(op, f"{qtype.name} blocks carry their own scales: one input, got {n_inputs}")
        _blocks(op, x, qtype)
    elif qtype in LINEAR_Q:
        if scale is None:
            _fail(op, f"{linear} needs a scale (input 1)")
        _linear_params(op, x, scale, zero_point, qtype)
    else:
        return False
    return True


@rule(Quantize)
def quantize(op: Quantize, inputs: Specs) -> Specs:
    x, scale, zero_point = _args(op, inputs, "x", "scale", "zero_point")
    _float(op, x)
    if not _quant_params(op, x, scale, zero_point, op.dtype, op.dtype in BLOCK_KV, len(inputs),
                         f"linear quantization to {op.dtype.name}"):
        _fail(op, f"dtype={op.dtype.name}: Quantize produces Q8_0, Q4_0, I8 or U8")
    return [_out(x.shape, op.dtype)]


@rule(Dequantize)
def dequantize(op: Dequantize, inputs: Specs) -> Specs:
    x, scale, zero_point = _args(op, inputs, "x", "scale", "zero_point")
    if not op.dtype.is_float:
        _fail(op, f"dtype={op.dtype.name} must be a float type (F32)")
    if not _quant_params(op, x, scale, zero_point, x.dtype, x.dtype.is_quantized, len(inputs),
                         f"linear dequantization of {x}"):
        _fail(op, f"{x} must be a GGML block type, I8 or U8, got {x.dtype.name}")
    return [_out(x.shape, op.dtype)]


@rule(Sample)
def sample(op: Sample, inputs: Specs) -> Specs:
    """logits [..., V], seed? -> [...] i64."""
    logits, seed = _args(op, inputs, "logits", "seed")
    _one_of(op, "method", {0: "greedy", 1: "temperature", 2: "top-k", 3: "top-p", 4: "min-p"})
    if op.method >= 1:
        _positive_finite(op, temperature=op.temperature)
    if op.method == 2:
        _at_least(op, 1, "k")
    if op.method in (3, 4) and not 0 <= op.p <= 1:
        _fail(op, f"p={op.p} must be in [0, 1]")
    _float(op, logits)
    _rank(op, logits, 1)
    _integer(op, seed)
    _scalar(op, seed)
    return [_out(logits.shape[:-1], DType.I64)]


# -- 160..179: linear algebra ------------------------------------------------------------------
@rule(LoraApply)
def lora_apply(op: LoraApply, inputs: Specs) -> Specs:
    """x [..., K], W [N, K], A [r, K], B [N, r] -> [..., N]."""
    x, w, a, b = _args(op, inputs, "x", "W", "A", "B")
    _float(op, x, a, b)
    _weight(op, w)
    _rank(op, x, 1)
    n = _linear_weight(op, x, w)
    r = _linear_weight(op, x, a)
    _rank(op, b, 2, 2)
    _dim(op, b, 0, n, f"dim 0 (N, dim 0 of {w})")
    _dim(op, b, 1, r, f"dim 1 (r, dim 0 of {a})")
    return [_out(x.shape[:-1] + (_merge(n, b.shape[0]),), x.dtype)]


@rule(Kron)
def kron(op: Kron, inputs: Specs) -> Specs:
    """torch.kron: the lower-rank input gets leading 1s; out dim i = a_i * b_i."""
    a, b = _args(op, inputs, "a", "b")
    _float(op, a, b)
    n = max(a.rank, b.rank)
    sa, sb = (1,) * (n - a.rank) + a.shape, (1,) * (n - b.rank) + b.shape
    return [_out([_prod(p) for p in zip(sa, sb)], a.dtype)]


@rule(MatrixInverse)
def matrix_inverse(op: MatrixInverse, inputs: Specs) -> Specs:
    (x,) = _args(op, inputs, "x")
    _float(op, x)
    _rank(op, x, 2)
    if not _agree(x.shape[-1], x.shape[-2]):
        _fail(op, f"{x} must hold square matrices [..., n, n]")
    n = _merge(x.shape[-1], x.shape[-2])
    return [_out(x.shape[:-2] + (n, n), x.dtype)]


# -- 180..198: fused ops -----------------------------------------------------------------------
@rule(FusedNormMatmul)
def fused_norm_matmul(op: FusedNormMatmul, inputs: Specs) -> Specs:
    """x [..., K], norm_weight [K], W [N, K] -> [..., N]."""
    x, norm_w, w = _args(op, inputs, "x", "norm_weight", "W")
    _float(op, x, norm_w)
    _weight(op, w)
    _rank(op, x, 1)
    _vector(op, norm_w, x.shape[-1], f"K, the last dim of {x}")
    return [_out(x.shape[:-1] + (_linear_weight(op, x, w),), x.dtype)]


@rule(FusedSkipNorm)
def fused_skip_norm(op: FusedSkipNorm, inputs: Specs) -> Specs:
    """x, residual (same shape), weight [D] -> (x + residual, RmsNorm(x + residual))."""
    x, residual, weight = _args(op, inputs, "x", "residual", "weight")
    _float(op, x, residual, weight)
    _rank(op, x, 1)
    shape = _same_shape(op, x, residual)
    _vector(op, weight, shape[-1], f"D, the last dim of {x}")
    return [_out(shape, x.dtype), _out(shape, x.dtype)]


@rule(FusedSwiGlu)
def fused_swiglu(op: FusedSwiGlu, inputs: Specs) -> Specs:
    """x [..., K], W_gate [F, K], W_up [F, K] -> [..., F]."""
    x, gate, up = _args(op, inputs, "x", "W_gate", "W_up")
    _float(op, x)
    _weight(op, gate, up)
    _rank(op, x, 1)
    f_gate, f_up = _linear_weight(op, x, gate), _linear_weight(op, x, up)
    if not _agree(f_gate, f_up):
        _fail(op, f"{gate} and {up} must have the same F (dim 0)")
    return [_out(x.shape[:-1] + (_merge(f_gate, f_up),), x.dtype)]


# -- 199 ---------------------------------------------------------------------------------------
@rule(Argmax)
def argmax(op: Argmax, inputs: Specs) -> Specs:
    (x,) = _args(op, inputs, "x")
    _float(op, x)
    _rank(op, x, 1)
    return [_out(x.shape[:-1], DType.I64)]


_unruled = [name for name, spec in OPS_BY_NAME.items() if spec.shape is None]
if _unruled:
    raise AssertionError(f"ops without a shape rule: {_unruled}")
