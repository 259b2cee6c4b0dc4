"""Elementwise kernels: arithmetic, Clamp, NanToNum, activations, gated units, Softmax and Argmax.

docs/ops.md, "Arithmetic and layout", "Activations" and "Argmax".  Every function widens its float
inputs to the compute dtype (f32, f64 for F64 inputs), computes there and rounds once to the first
input's dtype.  IEEE specials follow numpy (and torch): NaN propagates, ``x / 0`` is ``±inf``.
"""

from __future__ import annotations

import math

import numpy as np

from dist_runtime.ir.ops import (
    Add, Argmax, Clamp, Div, GeGlu, Gelu, Glu, LeakyRelu, Mul, NanToNum, PRelu, Relu, Sigmoid, Silu,
    Softmax, Sub, SwiGlu, Tanh,
)

from ._common import as_compute, axis, cast_back, check_broadcastable_to, compute_dtype, fail, finfo_max
from .layout import pieces
from .registry import register


# -- arithmetic --------------------------------------------------------------------------------
def _binary(op_name: str, ufunc: np.ufunc, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    ct = compute_dtype(a, b)
    try:
        y = ufunc(as_compute(a, ct), as_compute(b, ct))
    except ValueError:  # a dim unknown at load time turned out incompatible
        raise fail(op_name, f"cannot broadcast a {list(a.shape)} with b {list(b.shape)}") from None
    return cast_back(y, a)


def add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return _binary("Add", np.add, a, b)


def sub(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return _binary("Sub", np.subtract, a, b)


def mul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return _binary("Mul", np.multiply, a, b)


def div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return _binary("Div", np.true_divide, a, b)


def clamp(x: np.ndarray, *, min: float, max: float) -> np.ndarray:  # noqa: A002 (the payload's names)
    """``minimum(maximum(x, min), max)``: NaN in x or a bound propagates; min > max gives max."""
    # The bounds are f32 values rounded to the output dtype (1e5 is inf for F16).
    lo, hi = (float(np.asarray(v, dtype=x.dtype)) for v in (min, max))
    xc = as_compute(x, compute_dtype(x))
    return cast_back(np.minimum(np.maximum(xc, lo), hi), x)


def nan_to_num(x: np.ndarray, *, nan: float, posinf: float, neginf: float) -> np.ndarray:
    """Replace NaN, +inf, -inf; a replacement beyond the output dtype's range is clamped to it."""
    top = finfo_max(x.dtype)
    nan, posinf, neginf = (float(np.clip(v, -top, top)) for v in (nan, posinf, neginf))
    xc = as_compute(x, compute_dtype(x))
    return cast_back(np.nan_to_num(xc, copy=True, nan=nan, posinf=posinf, neginf=neginf), x)


# -- activations (xc: an array already in the compute dtype) -----------------------------------
def _sigmoid(xc: np.ndarray) -> np.ndarray:
    """``1 / (1 + exp(-x))`` with ``exp`` of a non-positive number only: no overflow."""
    e = np.abs(xc, out=np.empty_like(xc))  # in place from here: activations are large
    np.negative(e, out=e)
    np.exp(e, out=e)
    y = np.where(xc >= 0.0, 1.0, e)
    e += 1.0
    y /= e
    return y


def _silu(xc: np.ndarray) -> np.ndarray:
    y = _sigmoid(xc)
    y *= xc
    return y


# numpy has no erf (and a per-element math.erf would be a Python loop), so the exact GELU brings its
# own erfc, in two precisions.  f64: W. J. Cody, "Rational Chebyshev approximations for the error
# function", Math. Comp. 23 (1969), as netlib SPECFUN's CALERF, about 1e-16 relative error; it
# needs three ranges (boolean-mask gathers), about 4x the cost of the f32 path.
_ERF_A = (3.16112374387056560e00, 1.13864154151050156e02, 3.77485237685302021e02,
          3.20937758913846947e03, 1.85777706184603153e-1)
_ERF_B = (2.36012909523441209e01, 2.44024637934444173e02, 1.28261652607737228e03,
          2.84423683343917062e03)
_ERFC_C = (5.64188496988670089e-1, 8.88314979438837594e00, 6.61191906371416295e01,
           2.98635138197400131e02, 8.81952221241769090e02, 1.71204761263407058e03,
           2.05107837782607147e03, 1.23033935479799725e03, 2.15311535474403846e-8)
_ERFC_D = (1.57449261107098347e01, 1.17693950891312499e02, 5.37181101862009858e02,
           1.62138957456669019e03, 3.29079923573345963e03, 4.36261909014324716e03,
           3.43936767414372164e03, 1.23033935480374942e03)
_ERFC_P = (3.05326634961232344e-1, 3.60344899949804439e-1, 1.25781726111229246e-1,
           1.60837851487422766e-2, 6.58749161529837803e-4, 1.63153871373020978e-2)
_ERFC_Q = (2.56852019228982242e00, 1.87295284992346047e00, 5.27905102951428412e-1,
           6.05183413124413191e-2, 2.33520497626869185e-3)
_SQRT_1_PI = 5.6418958354775628695e-1


def _cody_ratio(t: np.ndarray, num: tuple, den: tuple) -> np.ndarray:
    """CALERF's rational function in ``t``: numerator seeded with ``num[-1]``, closing terms last."""
    xnum, xden = num[-1] * t, t
    for p, q in zip(num[:-2], den[:-1]):
        xnum, xden = (xnum + p) * t, (xden + q) * t
    return (xnum + num[-2]) / (xden + den[-1])


def _exp_neg_square(y: np.ndarray) -> np.ndarray:
    """``exp(-y^2)``, with y^2 split so the rounding of the square is not magnified (CALERF)."""
    head = np.trunc(y * 16.0) / 16.0
    return np.exp(-head * head) * np.exp(-(y - head) * (y + head))


def _erfc_cody(z: np.ndarray) -> np.ndarray:
    y = np.abs(z)
    out = np.empty_like(y)
    small, large = y <= 0.46875, y > 4.0
    mid = ~(small | large)  # NaN lands here and propagates
    zs = z[small]
    out[small] = 1.0 - zs * _cody_ratio(zs * zs, _ERF_A, _ERF_B)
    ym = y[mid]
    out[mid] = _exp_neg_square(ym) * _cody_ratio(ym, _ERFC_C, _ERFC_D)
    # Beyond 30 erfc underflows to 0 in f64; clipping keeps inf from making inf - inf.
    yl = np.minimum(y[large], 30.0)
    inv2 = 1.0 / (yl * yl)
    out[large] = _exp_neg_square(yl) * (_SQRT_1_PI - inv2 * _cody_ratio(inv2, _ERFC_P, _ERFC_Q)) / yl
    negative = (z < 0.0) & ~small
    out[negative] = 2.0 - out[negative]
    return out


# f32: Press et al., Numerical Recipes (2nd ed.) section 6.2, ``erfcc``: one Chebyshev fit of
# erfc(y) = t * exp(-y^2 + P(t)), t = 1 / (1 + y/2), for all y >= 0, fractional error < 1.2e-7, with
# no branches.  In f32 arithmetic the rounding of y^2 adds ~y^2 * 6e-8 relative: 1.5e-6 at y = 4,
# where erfc is 1.5e-8 and GELU's result is already within f32 rounding of 0 or x.
_ERFC_NR = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807,
            -1.13520398, 1.48851587, -0.82215223, 0.17087277)


def _erfc_nr(z: np.ndarray) -> np.ndarray:
    y = np.abs(z)
    t = 0.5 * y
    t += 1.0
    np.divide(1.0, t, out=t)
    p = _ERFC_NR[-1] * t  # Horner, in place: this runs on whole activations
    for c in _ERFC_NR[-2:0:-1]:
        p += c
        p *= t
    p += _ERFC_NR[0]
    y *= y
    p -= y
    np.exp(p, out=p)
    p *= t
    return np.where(z < 0.0, 2.0 - p, p)


def erfc(z: np.ndarray) -> np.ndarray:
    """The complementary error function, elementwise, in ``z``'s dtype (f32 or f64)."""
    flat = z.reshape(-1)  # 1-d: ufuncs on 0-d arrays return scalars, which have no out=
    out = _erfc_cody(flat) if flat.dtype == np.float64 else _erfc_nr(flat)
    return out.reshape(z.shape)


_SQRT_HALF = math.sqrt(0.5)
_SQRT_2_PI = math.sqrt(2.0 / math.pi)


def _gelu(xc: np.ndarray, approximate: bool) -> np.ndarray:
    if approximate:
        return 0.5 * xc * (1.0 + np.tanh(_SQRT_2_PI * (xc + 0.044715 * (xc * xc * xc))))
    # 0.5 * (1 + erf(x / sqrt 2)) written as 0.5 * erfc(-x / sqrt 2): accurate in the left tail.
    return 0.5 * xc * erfc(xc * -_SQRT_HALF)


def _unary(fn, x: np.ndarray, *args) -> np.ndarray:
    return cast_back(fn(as_compute(x, compute_dtype(x)), *args), x)


def relu(x: np.ndarray) -> np.ndarray:
    return _unary(lambda xc: np.maximum(xc, 0.0), x)


def leaky_relu(x: np.ndarray, *, alpha: float) -> np.ndarray:
    return _unary(lambda xc: np.where(xc >= 0.0, xc, xc * float(alpha)), x)


def prelu(x: np.ndarray, slope: np.ndarray) -> np.ndarray:
    """``x if x >= 0 else slope * x`` with ``slope`` broadcast to ``x``'s shape."""
    check_broadcastable_to("PRelu", slope, x.shape, "slope")
    ct = compute_dtype(x, slope)
    xc = as_compute(x, ct)
    return cast_back(np.where(xc >= 0.0, xc, xc * as_compute(slope, ct)), x)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return _unary(_sigmoid, x)


def tanh(x: np.ndarray) -> np.ndarray:
    return _unary(np.tanh, x)


def silu(x: np.ndarray) -> np.ndarray:
    return _unary(_silu, x)


def gelu(x: np.ndarray, *, approximate: bool = False) -> np.ndarray:
    return _unary(_gelu, x, approximate)


# -- gated units -------------------------------------------------------------------------------
def _halves(op_name: str, x: np.ndarray, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """The first and second halves of ``x`` along ``dim`` (views)."""
    ax = axis(op_name, dim, x.ndim)
    n = x.shape[ax]
    if n % 2:
        raise fail(op_name, f"dim {ax} of x {list(x.shape)} is {n}, not even: it cannot be halved")
    return tuple(pieces(x, ax, (n // 2, n // 2)))


def _gated(op_name: str, act, value: np.ndarray, gate: np.ndarray, like: np.ndarray) -> np.ndarray:
    """``value * act(gate)`` in the compute dtype, rounded to ``like``'s dtype."""
    ct = compute_dtype(value, gate)
    try:
        y = as_compute(value, ct) * act(as_compute(gate, ct))
    except ValueError:
        raise fail(op_name, f"cannot broadcast {list(value.shape)} with {list(gate.shape)}") from None
    return cast_back(y, like)


def geglu(a: np.ndarray, b: np.ndarray | None = None, *, approximate: bool = False) -> np.ndarray:
    """``a * gelu(b)``; with one input ``x``, ``hidden, gate = halves of x`` (diffusers GEGLU)."""
    x = a
    if b is None:
        a, b = _halves("GeGlu", x, -1)
    return _gated("GeGlu", lambda g: _gelu(g, approximate), a, b, x)


def swiglu(gate: np.ndarray, up: np.ndarray | None = None) -> np.ndarray:
    """``silu(gate) * up``; with one input ``x``, ``gate, up = halves of x`` (gate first)."""
    x = gate
    if up is None:
        gate, up = _halves("SwiGlu", x, -1)
    return _gated("SwiGlu", _silu, up, gate, x)


def glu(x: np.ndarray, *, dim: int = -1) -> np.ndarray:
    """``a * sigmoid(b)`` for the halves ``a, b`` of ``x`` along ``dim`` (torch F.glu)."""
    a, b = _halves("Glu", x, dim)
    return _gated("Glu", _sigmoid, a, b, x)


# -- reductions --------------------------------------------------------------------------------
def softmax(x: np.ndarray, *, dim: int = -1) -> np.ndarray:
    """``exp(x - max) / sum(exp(x - max))`` along ``dim``; an all ``-inf`` slice gives NaN."""
    ax = axis("Softmax", dim, x.ndim)
    xc = as_compute(x, compute_dtype(x))
    # initial=-inf: the max of an empty slice, so a zero-length dim gives an empty result.
    e = xc - np.max(xc, axis=ax, keepdims=True, initial=-math.inf)
    np.exp(e, out=e)
    e /= e.sum(axis=ax, keepdims=True)
    return cast_back(e, x)


def argmax(x: np.ndarray) -> np.ndarray:
    """Index of the largest value along the last dim (first on ties, a NaN is the largest), I64."""
    if x.shape[-1] == 0:
        raise fail("Argmax", f"x {list(x.shape)} has nothing to choose from: its last dim is 0")
    # Widening is exact and gives numpy's NaN-aware float argmax for F16/BF16 too.
    return np.asarray(np.argmax(as_compute(x, compute_dtype(x)), axis=-1), dtype=np.int64)


# -- kernels -----------------------------------------------------------------------------------
@register(Add)
def _add(op, inputs, ctx):
    return (add(*inputs),)


@register(Sub)
def _sub(op, inputs, ctx):
    return (sub(*inputs),)


@register(Mul)
def _mul(op, inputs, ctx):
    return (mul(*inputs),)


@register(Div)
def _div(op, inputs, ctx):
    return (div(*inputs),)


@register(Clamp)
def _clamp(op, inputs, ctx):
    return (clamp(inputs[0], min=op.min, max=op.max),)


@register(NanToNum)
def _nan_to_num(op, inputs, ctx):
    return (nan_to_num(inputs[0], nan=op.nan, posinf=op.posinf, neginf=op.neginf),)


@register(Relu)
def _relu(op, inputs, ctx):
    return (relu(inputs[0]),)


@register(LeakyRelu)
def _leaky_relu(op, inputs, ctx):
    return (leaky_relu(inputs[0], alpha=op.alpha),)


@register(PRelu)
def _prelu(op, inputs, ctx):
    x, slope = inputs
    return (prelu(x, slope),)


@register(Sigmoid)
def _sigmoid_kernel(op, inputs, ctx):
    return (sigmoid(inputs[0]),)


@register(Tanh)
def _tanh(op, inputs, ctx):
    return (tanh(inputs[0]),)


@register(Silu)
def _silu_kernel(op, inputs, ctx):
    return (silu(inputs[0]),)


@register(Gelu)
def _gelu_kernel(op, inputs, ctx):
    return (gelu(inputs[0], approximate=op.approximate),)


@register(GeGlu)
def _geglu(op, inputs, ctx):
    return (geglu(*inputs, approximate=op.approximate),)


@register(SwiGlu)
def _swiglu(op, inputs, ctx):
    return (swiglu(*inputs),)


@register(Glu)
def _glu(op, inputs, ctx):
    return (glu(inputs[0], dim=op.dim),)


@register(Softmax)
def _softmax(op, inputs, ctx):
    return (softmax(inputs[0], dim=op.dim),)


@register(Argmax)
def _argmax(op, inputs, ctx):
    return (argmax(inputs[0]),)
