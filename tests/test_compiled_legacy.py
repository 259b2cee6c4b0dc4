"""The legacy block kernels (``compiled/legacy.py``) beyond the shared harness: the q8_0 activation
path against an independent numpy model of its documented lanes over llama.cpp's integer dots
(bit for bit), its error against
the f32 path within a bound derived from the quantization, batch invariance of that path, the
threaded drivers against the serial ones, and Q5_1.
"""

from __future__ import annotations

import functools
import subprocess
import sys

import numpy as np
import pytest

numba = pytest.importorskip("numba")

from dist_runtime.backends.compiled import cpu, legacy, linear, registry, set_threads  # noqa: E402
from dist_runtime.backends.compiled.simd_int8 import FORMATS  # noqa: E402
from dist_runtime.dtypes import DType  # noqa: E402
from dist_runtime.kernels.quant import dequantize, quantize  # noqa: E402

LEGACY = [DType.Q8_0, DType.Q4_0, DType.Q4_1, DType.Q5_0, DType.Q5_1]
CODES = {dtype: code for code, dtype in FORMATS.items()}
F16_EPS = 2.0**-11  # relative rounding of an f16


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view("<f2")[..., 0].astype(np.float32)


def ggml_codes(w) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per block: integer codes as ggml's vec_dot sees them (q - 8 / q - 16 for Q4_0 / Q5_0, q for
    Q4_1 / Q5_1, signed bytes for Q8_0) [N, nb, 32], d and m (0 without) [N, nb]."""
    n, k = w.shape
    blocks = w.data.reshape(n, k // 32, w.dtype.block_bytes)
    affine = w.dtype in (DType.Q4_1, DType.Q5_1)
    d, m = _f16(blocks[..., 0:2]), (_f16(blocks[..., 2:4]) if affine else np.zeros(blocks.shape[:2], np.float32))
    head = 4 if affine else 2
    if w.dtype == DType.Q8_0:
        return blocks[..., 2:].view(np.int8).astype(np.int64), d, m
    five = w.dtype in (DType.Q5_0, DType.Q5_1)
    nib = blocks[..., head + 4 * five:].astype(np.int64)
    q = np.concatenate([nib & 15, nib >> 4], axis=-1)
    if five:
        qh = blocks[..., head:head + 4].astype(np.int64) << np.array([0, 8, 16, 24])
        q |= (qh.sum(axis=-1, keepdims=True) >> np.arange(32) & 1) << 4
    return (q if affine else q - (16 if five else 8)), d, m


def ggml_quantize_row_q8(x: np.ndarray):
    """quantize_row_q8_1_ref (q8_0 is its codes and d): d = amax / 127 (f32), q = roundf(x / d)
    through id = 1 / d, d stored as f16, s = f16(d * sum(q)) with the f32 d."""
    blocks = x.reshape(x.shape[0], -1, 32)
    d = np.abs(blocks).max(axis=-1) / np.float32(127)
    inv = np.where(d == 0, np.float32(0), np.float32(1) / np.where(d == 0, 1, d)).astype(np.float32)
    v = (blocks * inv[..., None]).astype(np.float64)  # the f32 product x * id, exact in f64
    q = np.trunc(v + np.copysign(0.5, v)).astype(np.int64)  # C roundf: half away from zero
    s = (q.sum(axis=-1).astype(np.float32) * d).astype(np.float16).astype(np.float32)
    return q, d.astype(np.float16).astype(np.float32), s, d


def lanes_dot(x: np.ndarray, w) -> np.ndarray:
    """The q8_0 path's documented numerics (docs/ops.md): per block the exact integer dots of
    ggml's ``vec_dot_*_q8_0`` / ``_q8_1``, kept in 4 lanes (lane l: elements 4l..4l+3 and
    16+4l..16+4l+3), block b in lanes 4 (b % 4) .. + 3 of 16; then, block after block, in f32,
    ``lane += (d_w * d_x) * sumi``; the 16 lanes folded in halves (lane i + lane i + n/2, down to
    one); Q4_1 / Q5_1 plus ``m_w * s_x`` summed per block b % 4, those four folded likewise and
    added after."""
    qw, dw, mw = ggml_codes(w)
    qx, dx, sx, _ = ggml_quantize_row_q8(x)
    m, n, nb = x.shape[0], w.shape[0], qw.shape[1]
    sumi = np.einsum("nbj,mbj->mnbj", qw, qx).reshape(m, n, nb, 2, 4, 4).sum(axis=(3, 5))
    acc, mins = np.zeros((m, n, 16), np.float32), np.zeros((m, n, 4), np.float32)
    for b in range(nb):
        h = b % 4
        scale = (dw[None, :, b] * dx[:, None, b])[..., None]
        acc[..., 4 * h:4 * h + 4] = acc[..., 4 * h:4 * h + 4] + scale * sumi[:, :, b].astype(np.float32)
        mins[..., h] = mins[..., h] + mw[None, :, b] * sx[:, None, b]
    total, extra = fold(acc), fold(mins)
    return total + extra if w.dtype in (DType.Q4_1, DType.Q5_1) else total


def fold(a: np.ndarray) -> np.ndarray:
    """The last axis summed in halves: lane i + lane i + n/2, down to one (f32 throughout)."""
    while a.shape[-1] > 1:
        half = a.shape[-1] // 2
        a = a[..., :half] + a[..., half:]
    return a[..., 0]


def data(dtype: DType, m: int, n: int, k: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    w = quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.1 + 0.02, dtype)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block: d = 0
    return x, w


@pytest.mark.parametrize("dtype", LEGACY, ids=lambda d: d.name)
@pytest.mark.parametrize("m, k", [(7, 512), (1, 352), (2, 288), (5, 32)])  # tiles and lone rows; odd block counts
def test_q8_activations_are_the_lanes_formula_bit_for_bit(dtype, m, k):
    x, w = data(dtype, m, 45, k)
    got = linear(x, w, activations="q8_0")
    assert np.array_equal(got.view(np.uint32), lanes_dot(x, w).view(np.uint32))


@pytest.mark.parametrize("dtype", LEGACY, ids=lambda d: d.name)
@pytest.mark.parametrize("m, k", [(5, 352), (1, 64)])
def test_q8_portable_path_gives_the_same_bits(dtype, m, k):
    """The portable path (CPUs without AVX2) computes the same lanes; called here directly, since
    the package picks the vector path on this CPU."""
    x, w = data(dtype, m, 23, k, seed=5)
    out = np.empty((m, 23), np.float32)
    quantized = legacy._quantized(x, 32, legacy._XCENTRE[CODES[dtype]])
    legacy._q8_portable(*quantized, w.data.reshape(23, -1), out, CODES[dtype], 32, 0, 23)
    assert np.array_equal(out.view(np.uint32), lanes_dot(x, w).view(np.uint32))


@pytest.mark.parametrize("dtype", LEGACY, ids=lambda d: d.name)
def test_f32_portable_path_matches_dequantize_then_matmul_and_is_batch_invariant(dtype):
    """The portable path (CPUs without AVX2) with f32 activations, called here directly since the
    package picks the vector path on this CPU: within 1e-5 of the output's scale, row by row the
    same bits as alone; NaN and inf reach their rows only."""
    x, w = data(dtype, 7, 21, 288, seed=11)
    x[4, 100] = np.nan
    want = x.astype(np.float64) @ dequantize(w).astype(np.float64).T
    data_ = w.data.reshape(21, -1)

    def portable(rows):
        out = np.empty((rows.shape[0], 21), np.float32)
        legacy._f32_portable(rows, registry.block_sums(rows, rows.shape[1] // 32), data_, out, CODES[dtype], 32, 0, 21)
        return out

    got = portable(x)
    fine = [0, 1, 2, 3, 5, 6]
    assert np.max(np.abs(got[fine] - want[fine])) <= 1e-5 * np.max(np.abs(want[fine]))
    assert np.isnan(got[4]).all()
    for i in range(len(x)):
        assert np.array_equal(portable(x[i:i + 1]).view(np.uint32), got[i:i + 1].view(np.uint32)), i


@pytest.mark.skipif(not cpu.AVX2, reason=cpu.REASON)
@pytest.mark.parametrize("dtype", LEGACY, ids=lambda d: d.name)
@pytest.mark.parametrize("m, k", [(6, 352), (1, 4096 + 96)])
def test_q8_256_bit_path_gives_the_same_bits(dtype, m, k):
    """A CPU with AVX2 but without AVX-512 VBMI runs each group of 4 blocks as two 256-bit halves
    (``q8_rows(wide=False)``); the package picks the 512-bit one where it can, so it is built here
    directly: the same lanes, the same bits."""
    x, w = data(dtype, m, 19, k, seed=6)
    out = np.empty((m, 19), np.float32)
    _narrow()(*legacy._quantized(x, 32, legacy._XCENTRE[CODES[dtype]]), w.data.reshape(19, -1), out, CODES[dtype], 0, 19)
    assert np.array_equal(out.view(np.uint32), lanes_dot(x, w).view(np.uint32))


@functools.cache
def _narrow():
    from dist_runtime.backends.compiled.simd_int8 import q8_rows

    rows = q8_rows(wide=False)

    @numba.njit(nogil=True)
    def run(xp, xn, xd, xs, w, out, fmt, lo, hi):
        rows(w, xp, xn, xd, xs, out, lo, hi, fmt)

    return run


WEIGHT_AT_THE_END = """
import ctypes, mmap, sys, numpy as np
from dist_runtime.backends.compiled import linear
from dist_runtime.dtypes import DType
from dist_runtime.tensor import QuantizedArray
path, name, n, k = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
dtype = DType[name]
blocks = np.fromfile(path, np.uint8)
size = blocks.nbytes  # whole pages
region = mmap.mmap(-1, size + mmap.PAGESIZE)
base = ctypes.addressof(ctypes.c_char.from_buffer(region))
libc = ctypes.CDLL(None, use_errno=True)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
assert libc.mprotect(base + size, mmap.PAGESIZE, 0) == 0  # PROT_NONE: a read there is SIGSEGV
data = np.frombuffer(region, np.uint8, size).reshape(n, -1)
data[:] = blocks.reshape(n, -1)
x = np.random.default_rng(0).standard_normal((3, k)).astype(np.float32)
y = linear(x, QuantizedArray(data, dtype, (n, k)), activations="q8_0")
print(float(np.abs(y).sum()))
"""


@pytest.mark.slow  # a child process per type
@pytest.mark.parametrize("dtype", LEGACY, ids=lambda d: d.name)
def test_q8_reads_nothing_past_the_weight(dtype, tmp_path):
    """The 512-bit path loads 128-byte windows from each group's start, past the group's own bytes:
    a weight that ends where readable memory ends (a model file's last tensor, memory-mapped, its
    size a multiple of the page) must not be read beyond.  256 rows of 256 columns fill whole
    pages in every legacy type; the child puts them just before a page it may not read, so that a
    read past the weight is SIGSEGV there, a failure here."""
    n, k = 256, 256
    x, w = data(dtype, 1, n, k, seed=9)
    assert w.data.nbytes % 4096 == 0
    path = tmp_path / "w.bin"
    w.data.tofile(path)
    child = subprocess.run([sys.executable, "-c", WEIGHT_AT_THE_END, str(path), dtype.name, str(n), str(k)],
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-2000:]
    xs = np.random.default_rng(0).standard_normal((3, k)).astype(np.float32)
    assert float(child.stdout) == pytest.approx(float(np.abs(linear(xs, w, activations="q8_0")).sum()), rel=1e-6)


def grouped(x: np.ndarray, centre: int) -> list[np.ndarray]:
    """The quantizer's arrays for ``x`` built from :func:`ggml_quantize_row_q8` (numpy): codes in
    groups of 4 blocks (elements 0-15 of each, then 16-31 of each), minus ``centre`` times each
    lane's code sum (lane l: elements 4l..4l+3 and 16+4l..16+4l+3), each lane's d, and s per
    block; a last group's missing blocks zeros."""
    q, d, s, _ = ggml_quantize_row_q8(x)
    m, nb, _ = q.shape
    pad = -nb % 4
    q, d, s = (np.concatenate([a, np.zeros((m, pad) + a.shape[2:], a.dtype)], axis=1) for a in (q, d, s))
    blocks = q.reshape(m, -1, 4, 2, 16)  # group, block of the group, half, element
    xp = blocks.transpose(0, 1, 3, 2, 4).reshape(m, -1).astype(np.int8)
    xn = -centre * blocks.reshape(m, -1, 4, 2, 4, 4).sum(axis=(3, 5)).reshape(m, -1)
    return [xp, xn.astype(np.int32), np.repeat(d, 4, axis=1).astype(np.float32), s.astype(np.float32)]


@pytest.mark.parametrize("centre", [1, 8])
@pytest.mark.parametrize("m, k", [(3, 352), (1, 32), (2, 4096)])
def test_quantizers_give_llama_cpps_blocks(m, k, centre):
    """Both quantizers (the scalar one, the vector path's where the CPU has it) against a numpy
    model of llama.cpp's quantize_row_q8_1_ref: every code, lane sum (times the weight's centre),
    scale and block sum, for blocks of zeros, huge and tiny values and halves exactly between two
    codes; and a block with a NaN or an inf gets codes 0 and a scale that is not finite (in both
    alike)."""
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((m, k)) * np.exp(rng.uniform(-30, 30, (m, k // 32, 1))).repeat(32, 1).reshape(m, k)
         ).astype(np.float32)
    x[0, :32] = 0.0
    if k > 96:
        x[0, 32:64] = np.arange(32, dtype=np.float32) - 15.5  # d = 15.5 / 127: some x * (1 / d) near .5
    scalar = [np.zeros(a.shape, a.dtype) for a in legacy._quantized(x, 32, centre)]
    legacy._quantize_rows(x, 32, centre, *scalar)
    with np.errstate(over="ignore"):  # blocks of ~1e13: d overflows f16 to inf, as in llama.cpp
        reference = grouped(x, centre)
    for ours in (scalar, list(legacy._quantized(x, 32, centre))):
        for got, want in zip(ours, reference, strict=True):
            assert np.array_equal(got, want)
    if k > 96:
        x[-1, 70], x[-1, 100] = np.nan, np.inf  # blocks 2 and 3: the first group's second half
        scalar = [np.zeros(a.shape, a.dtype) for a in scalar]
        legacy._quantize_rows(x, 32, centre, *scalar)
        for got, ref in zip(legacy._quantized(x, 32, centre), scalar, strict=True):
            assert np.array_equal(got, ref, equal_nan=got.dtype.kind == "f")
        xp, _, xd, _ = scalar
        assert not xp[-1, 32:64].any() and not xp[-1, 96:128].any() and np.isnan(xd[-1, 8:12]).all() and np.isinf(xd[-1, 12:16]).all()


@pytest.mark.parametrize("dtype", LEGACY, ids=lambda d: d.name)
def test_q8_activations_nan_and_inf_reach_their_rows(dtype):
    x, w = data(dtype, 4, 8, 128, seed=8)
    x[1, 40], x[2, 3] = np.nan, np.inf
    y = linear(x, w, activations="q8_0")
    assert np.isnan(y[1]).all() and not np.isfinite(y[2]).any() and np.isfinite(y[[0, 3]]).all()


@pytest.mark.parametrize("dtype", LEGACY, ids=lambda d: d.name)
def test_q8_activations_err_within_the_quantization_bound(dtype):
    """|x - d16 * q| <= d / 2 + |d16 - d| * 127 <= (1/2 + 127 * 2^-11) d per element; Q8_1's s adds
    one f16 rounding.  So |y_q8 - y_f32| <= sum over blocks of that times sum |w| (+ |m| |s| 2^-11),
    plus the f32 sums' rounding."""
    x, w = data(dtype, 5, 64, 1024, seed=1)
    exact = linear(x, w)
    err = np.abs(linear(x, w, activations="q8_0") - exact)
    qw, dw, mw = ggml_codes(w)
    _, _, sx, d = ggml_quantize_row_q8(x)
    mag = np.abs(qw * dw[..., None]).sum(axis=-1) + 32 * np.abs(mw)  # [N, nb]: sum_j |d q_j| + 32 |m|
    bound = (0.5 + 127 * F16_EPS) * d @ mag.T + F16_EPS * np.abs(sx) @ np.abs(mw).T
    scale = np.abs(x).astype(np.float64) @ np.abs(dequantize(w).astype(np.float64)).T
    assert np.all(err <= bound + 1e-5 * scale.max())
    assert 0 < np.median(err / scale) < 0.01  # really quantized, and close: ~0.02 % of sum |x w| here


@pytest.mark.parametrize("k", [256, 4000])  # 4000: spans of rows (registry.WEIGHT_SPAN_BYTES), a last group of 1 block
@pytest.mark.parametrize("dtype", LEGACY, ids=lambda d: d.name)
def test_q8_activations_are_batch_invariant(dtype, k):
    x, w = data(dtype, 70, 40 if k == 256 else 100, k, seed=2)
    alone = np.concatenate([linear(x[i:i + 1], w, activations="q8_0") for i in range(len(x))])
    try:
        for threads, start, m in [(1, 0, 70), (2, 0, 70), (2, 3, 5), (1, 9, 4), (2, 1, 33)]:
            set_threads(threads)
            got = linear(x[start:start + m], w, activations="q8_0")
            assert np.array_equal(got.view(np.uint32), alone[start:start + m].view(np.uint32)), (threads, m)
    finally:
        set_threads(numba.config.NUMBA_NUM_THREADS)


@pytest.mark.parametrize("m, n, k", [(1, 3, 64), (6, 29, 320)])
def test_q5_1_matches_dequantize_then_matmul(m, n, k):
    x, w = data(DType.Q5_1, m, n, k, seed=3)
    want = x.astype(np.float64) @ dequantize(w).astype(np.float64).T
    assert np.max(np.abs(linear(x, w) - want)) <= 1e-5 * max(np.max(np.abs(want)), 1.0)


@pytest.mark.parametrize("dtype", LEGACY, ids=lambda d: d.name)
@pytest.mark.parametrize("activations", ["f32", "q8_0"])
def test_the_threaded_driver_gives_the_serial_bits(dtype, activations, monkeypatch):
    """Small products run on the calling thread alone (``SERIAL_BYTES``): here the pool's driver
    (which quantizes ``x`` itself for q8_0) runs them too, and must give the same bits."""
    x, w = data(dtype, 6, 203, 288, seed=4)
    alone = linear(x, w, activations=activations)
    monkeypatch.setattr(registry, "SERIAL_BYTES", 0)
    try:
        set_threads(2)
        got = linear(x, w, activations=activations)
    finally:
        set_threads(numba.config.NUMBA_NUM_THREADS)
    assert np.array_equal(got.view(np.uint32), alone.view(np.uint32))
