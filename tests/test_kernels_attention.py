"""The attention kernels and the KV cache (kernels/attention.py) against independent references.

* PyTorch and transformers, through tests/fixtures/kernels/attention.npz (written by
  tests/fixtures/make_attention_fixtures.py): ``scaled_dot_product_attention(enable_gqa=True)``
  with Hugging Face's own causal / Mistral sliding-window / band mask functions at end-aligned
  query positions, and ``DynamicCache.update`` for the cache.
* A per-head loop written here (``loop_attention``) with explicit visibility matrices, for
  configurations the fixtures do not cover (batch broadcasting, mask shapes, dtypes, Tk = 0).
"""

from __future__ import annotations

import math
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import dist_runtime.kernels.attention as A
import dist_runtime.kernels.positions  # noqa: F401  (registers Rope, for the prefill-versus-decode test)
from dist_runtime.dtypes import DType
from dist_runtime.errors import DistRuntimeError
from dist_runtime.ir.ops import FlashAttention, KvCache, Rope, Sdpa, SdpaCross, SdpaWindow
from dist_runtime.tensor import QuantizedArray
from dist_runtime.kernels.registry import KernelContext, kernel_for

FIXTURES = np.load(Path(__file__).parent / "fixtures" / "kernels" / "attention.npz")
CASES = sorted({k.split(".")[0] for k in FIXTURES.files if not k.startswith("kv.")})
F32_TOL = dict(rtol=1e-4, atol=1e-5)  # torch's f32 result; ours differs by a few ulps
F16_TOL = dict(rtol=1e-3, atol=1e-3)  # both rounded once to f16 (11 bits), from f32 results


def run(op, *inputs, ctx=None):
    return kernel_for(type(op))(op, list(inputs), ctx or KernelContext())


def fixture(name):
    get = FIXTURES.__getitem__
    h, kv, hd, causal, window = (int(x) for x in get(f"{name}.params"))
    mask = get(f"{name}.mask") if f"{name}.mask" in FIXTURES.files else None
    inputs = [get(f"{name}.q"), get(f"{name}.k"), get(f"{name}.v")] + ([mask] if mask is not None else [])
    return inputs, dict(num_heads=h, kv_heads=kv, head_dim=hd), bool(causal), window, get(f"{name}.out")


def ops_for(name, heads, causal, window):
    """Every op whose result the fixture defines."""
    if window:
        return [SdpaWindow(**heads, window=window, causal=causal)]
    ops = [Sdpa(**heads, causal=causal)] + [FlashAttention(**heads, causal=causal, block=b)
                                            for b in (1, 2, 3, 4, 256)]  # 3, 4 divide no Tk here
    if name.startswith("cross"):
        ops.append(SdpaCross(**heads))
    return ops


@pytest.mark.parametrize("name", CASES)
def test_against_torch(name):
    inputs, heads, causal, window, expected = fixture(name)
    tol = F16_TOL if expected.dtype == np.float16 else F32_TOL
    for op in ops_for(name, heads, causal, window):
        (out,) = run(op, *inputs)
        assert out.dtype == inputs[0].dtype and out.shape == expected.shape, op
        np.testing.assert_allclose(out.astype(np.float64), expected.astype(np.float64), **tol,
                                   err_msg=repr(op))


def test_fixture_cases_cover_the_edge_cases():
    assert {"decode_mqa", "chunk_causal", "mha_mask_rows", "window_wide", "window_band",
            "f16_causal"} <= set(CASES)
    # a fully masked row: torch (and so we) give zeros, not NaN
    out = FIXTURES["mha_mask_rows.out"]
    assert np.all(out[:, 2] == 0) and np.all(np.isfinite(out))


# -- an independent closed form ----------------------------------------------------------------
def visibility(tq, tk, causal, window):
    """Explicit [Tq, Tk] matrix of which key each query sees (query i at key position i+Tk-Tq)."""
    seen = np.ones((tq, tk), bool)
    for i in range(tq):
        at = i + tk - tq
        for j in range(tk):
            if window and causal:
                seen[i, j] = at - window < j <= at
            elif window:
                seen[i, j] = abs(j - at) < window
            elif causal:
                seen[i, j] = j <= at
    return seen


def loop_attention(q, k, v, mask, *, num_heads, kv_heads, head_dim, causal=False, window=0):
    """One head, one batch index and one query row at a time, in f64."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    tq, tk = q.shape[-2], k.shape[-2]
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    bias = np.zeros((*batch, num_heads, tq, tk)) + (0 if mask is None else mask.astype(np.float64))
    seen = visibility(tq, tk, causal, window)
    out = np.zeros((*batch, tq, num_heads * head_dim))
    for b in np.ndindex(*batch):
        qb, kb, vb = (np.broadcast_to(a, (*batch, *a.shape[-2:]))[b] for a in (q, k, v))
        for h in range(num_heads):
            g = h // (num_heads // kv_heads)
            cols = slice(h * head_dim, (h + 1) * head_dim)
            kv_cols = slice(g * head_dim, (g + 1) * head_dim)
            for i in range(tq):
                s = np.array([qb[i, cols] @ kb[j, kv_cols] / math.sqrt(head_dim) + bias[b][h, i, j]
                              if seen[i, j] else -np.inf for j in range(tk)])
                if not np.isfinite(s).any():
                    continue  # sees no key: zeros
                p = np.exp(s - s.max())
                out[b][i, cols] = (p / p.sum()) @ vb[:, kv_cols]
    return out


RNG = np.random.default_rng(7)

# (batch of q, batch of k and v, Tq, Tk, H, KV, hd, mask shape or None)
LOOP_CONFIGS = [
    ((), (), 4, 4, 2, 1, 3, None),
    ((2,), (2,), 1, 6, 6, 2, 4, (2, 1, 1, 6)),  # decode, GQA 3:1, padding mask
    ((3,), (), 5, 8, 4, 4, 2, (4, 5, 8)),  # k, v shared by the batch; per-head mask
    ((), (2,), 2, 5, 2, 2, 5, (5,)),  # q broadcast over k's batch; a mask over keys only
    ((2, 1), (1, 3), 3, 3, 3, 1, 1, (1, 1, 3, 3)),  # two batch dims broadcasting; head_dim 1
    ((1,), (1,), 6, 6, 8, 2, 7, (6, 6)),
]


@pytest.mark.parametrize("config", LOOP_CONFIGS, ids=str)
def test_against_loop(config):
    bq, bk, tq, tk, h, kv, hd, mask_shape = config
    q = RNG.standard_normal((*bq, tq, h * hd)).astype(np.float32)
    k = RNG.standard_normal((*bk, tk, kv * hd)).astype(np.float32)
    v = RNG.standard_normal((*bk, tk, kv * hd)).astype(np.float32)
    mask = None if mask_shape is None else RNG.standard_normal(mask_shape).astype(np.float32)
    inputs = [q, k, v] + ([mask] if mask is not None else [])
    heads = dict(num_heads=h, kv_heads=kv, head_dim=hd)
    variants = [(Sdpa(**heads, causal=c), dict(causal=c)) for c in (False, True)]
    variants += [(FlashAttention(**heads, causal=True, block=b), dict(causal=True)) for b in (1, 3, 5)]
    variants += [(SdpaWindow(**heads, window=w, causal=c), dict(causal=c, window=w))
                 for w in (1, 2, 9) for c in (True, False)]
    for op, how in variants:
        expected = loop_attention(q, k, v, mask, **heads, **how)
        (out,) = run(op, *inputs)
        assert out.dtype == np.float32 and out.shape == expected.shape
        np.testing.assert_allclose(out, expected, **F32_TOL, err_msg=repr(op))


def test_window_one_sees_only_itself_and_wide_window_is_causal():
    q, k, v = (RNG.standard_normal((5, 8)).astype(np.float32) for _ in range(3))
    heads = dict(num_heads=2, kv_heads=2, head_dim=4)
    (one,) = run(SdpaWindow(**heads, window=1), q, k, v)
    np.testing.assert_allclose(one, v, rtol=1e-6)
    (wide,) = run(SdpaWindow(**heads, window=5), q, k, v)
    (causal,) = run(Sdpa(**heads, causal=True), q, k, v)
    np.testing.assert_allclose(wide, causal, rtol=1e-6)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float64])
def test_dtypes(dtype):
    q = RNG.standard_normal((2, 3, 8)).astype(dtype)
    k, v = (RNG.standard_normal((2, 3, 4)).astype(dtype) for _ in range(2))
    mask = np.zeros((1, 3), dtype)
    heads = dict(num_heads=2, kv_heads=1, head_dim=4)
    expected = loop_attention(q, k, v, mask, **heads, causal=True)
    tol = {np.float64: dict(rtol=1e-12, atol=1e-12), np.float16: F16_TOL}.get(
        dtype, dict(rtol=1e-2, atol=1e-2))  # bf16: 8 significant bits
    for op in (Sdpa(**heads, causal=True), FlashAttention(**heads, causal=True, block=2)):
        (out,) = run(op, q, k, v, mask)
        assert out.dtype == np.dtype(dtype)
        np.testing.assert_allclose(out.astype(np.float64), expected, **tol)


def test_rows_that_see_no_key_give_zeros():
    q, k, v = (RNG.standard_normal((3, 4)).astype(np.float32) for _ in range(3))
    mask = np.zeros((3, 3), np.float32)
    mask[1] = -np.inf
    heads = dict(num_heads=1, kv_heads=1, head_dim=4)
    for op in (Sdpa(**heads), FlashAttention(**heads, block=2)):
        with np.errstate(all="raise"):  # no hidden 0/0 or inf - inf either
            (out,) = run(op, q, k, v, mask)
        assert np.all(out[1] == 0) and np.all(np.isfinite(out))
        empty = np.zeros((0, 4), np.float32)
        (none,) = run(op, q, empty, empty)  # Tk = 0
        assert none.shape == (3, 4) and np.all(none == 0)


def test_decode_stays_float32():
    """NEP 50: a float64 scale would turn every product into float64 (docs/performance.md)."""
    q = RNG.standard_normal((1, 1, 64)).astype(np.float32)
    k = RNG.standard_normal((1, 9, 32)).astype(np.float32)
    for op in (Sdpa(num_heads=4, kv_heads=2, head_dim=16, causal=True),
               FlashAttention(num_heads=4, kv_heads=2, head_dim=16, causal=True, block=4)):
        (out,) = run(op, q, k, k)
        assert out.dtype == np.float32


def test_run_time_errors():
    heads = dict(num_heads=2, kv_heads=1, head_dim=2)
    q, k = np.zeros((2, 3, 4), np.float32), np.zeros((2, 3, 2), np.float32)
    bad = {
        "causal attention needs Tq <= Tk": (Sdpa(**heads, causal=True), [q, k[:, :2], k[:, :2]]),
        "k has Tk=3 rows but v has 2": (Sdpa(**heads), [q, k, k[:, :2]]),
        "do not broadcast": (Sdpa(**heads), [q, np.zeros((3, 3, 2), np.float32), k]),
        "not broadcastable": (SdpaCross(**heads), [q, k, k, np.zeros((3, 3, 3), np.float32)]),
    }
    for message, (op, inputs) in bad.items():
        with pytest.raises(DistRuntimeError, match=message):
            run(op, *inputs)


# -- KV cache ----------------------------------------------------------------------------------
def cache_ctx(max_seq=0):
    return KernelContext(state=A.KvState.for_op(KvCache(max_seq=max_seq)))


def test_kv_cache_against_dynamic_cache():
    """HF DynamicCache.update on [B, KV, T, hd]: prefill 3 rows, decode 1, 1, a chunk of 2."""
    ctx, op = cache_ctx(), KvCache()
    steps = sorted({int(k.split(".")[1]) for k in FIXTURES.files if k.startswith("kv.")})
    for step in steps:
        get = lambda what: FIXTURES[f"kv.{step}.{what}"]  # noqa: E731
        k_full, v_full = run(op, get("k_new"), get("v_new"), ctx=ctx)
        np.testing.assert_array_equal(k_full, get("k_full"))
        np.testing.assert_array_equal(v_full, get("v_full"))
        ctx.pos += get("k_new").shape[-2]  # what the executor does after a run


def test_kv_cache_replay_is_idempotent_and_views_are_zero_copy():
    ctx, op = cache_ctx(), KvCache()
    rows = RNG.standard_normal((6, 4)).astype(np.float32)
    run(op, rows[:3], rows[:3], ctx=ctx)
    ctx.pos = 3
    first, _ = run(op, rows[3:4], rows[3:4] * 2, ctx=ctx)
    again, v_again = run(op, rows[3:4], rows[3:4] * 2, ctx=ctx)  # a retried step: same position
    np.testing.assert_array_equal(again, rows[:4])
    np.testing.assert_array_equal(v_again[3], rows[3] * 2)
    assert ctx.state.length == 4
    assert np.shares_memory(first, again) and not again.flags.writeable  # no growth in between
    ctx.pos = 2  # a rewind: rows from 2 on are replaced, the cache ends at pos + T
    k3, _ = run(op, rows[4:6], rows[4:6], ctx=ctx)
    np.testing.assert_array_equal(k3, np.concatenate([rows[:2], rows[4:6]]))
    assert ctx.state.length == 4


def test_kv_cache_grows_in_blocks_and_honours_the_hint():
    op, row = KvCache(), np.ones((2, 1, 3), np.float32)
    ctx = cache_ctx()
    sizes = set()
    for pos in range(4000):
        ctx.pos = pos
        k, _ = run(op, row * pos, row, ctx=ctx)
        sizes.add(ctx.state.allocated)
        # whole blocks, at most an eighth (and a block) beyond the rows held
        assert ctx.state.allocated % A.KV_BLOCK == 0 and ctx.state.allocated <= (pos + 1) * 9 // 8 + A.KV_BLOCK
    assert k.shape == (2, 4000, 3) and np.all(k[:, :, 0] == np.arange(4000))
    assert len(sizes) <= 16  # amortised O(1) appends, not a copy per token or per block
    hinted = cache_ctx(max_seq=64)
    run(op, row, row, ctx=hinted)
    assert hinted.state.allocated == 64
    hinted.pos = 1
    run(op, np.ones((2, 70, 3), np.float32), np.ones((2, 70, 3), np.float32), ctx=hinted)
    assert hinted.state.allocated >= 71 and hinted.state.length == 71  # a hint never limits


def test_kv_cache_grows_to_its_ceiling_and_past_it_only_when_a_write_does():
    op, row = KvCache(), np.ones((2, 1, 3), np.float32)
    ctx = KernelContext(state=A.KvState.for_op(op, ceiling=300))
    for pos in range(300):
        ctx.pos = pos
        run(op, row * pos, row, ctx=ctx)
        assert ctx.state.allocated <= 300  # the rows the request was admitted for, never a block more
    assert ctx.state.allocated == 300 and ctx.state.nbytes() == (2 * 2 * 300 * 3 * 4,) * 2
    ctx.pos = 300
    k, _ = run(op, row * 300, row, ctx=ctx)  # a write past it still succeeds
    assert ctx.state.allocated == 301 and np.all(k[:, :, 0] == np.arange(301))
    states = A.KvStates(ceiling=40)
    state = A.KvState.held_in(states, "n", op)
    assert state.ceiling == 40
    states.set_ceiling(600)
    assert state.ceiling == 600


def test_kv_cache_edge_cases_and_errors():
    op = KvCache()
    ctx = cache_ctx()
    rows = np.ones((3, 4), np.float16)
    k, v = run(op, rows, rows[:, :2], ctx=ctx)
    assert k.dtype == np.float16 and v.shape == (3, 2)
    ctx.pos = 3
    k, _ = run(op, rows[:0], rows[:0, :2], ctx=ctx)  # T = 0: the current contents
    assert k.shape == (3, 4)
    errors = {
        "positions must be contiguous": (5, rows, rows[:, :2]),
        "k_new changed": (3, np.ones((3, 6), np.float16), rows[:, :2]),
        "v_new changed": (3, rows, rows[:, :2].astype(np.float32)),
        "must agree": (3, rows, rows[:2, :2]),
    }
    for message, (pos, k_new, v_new) in errors.items():
        ctx.pos = pos
        with pytest.raises(DistRuntimeError, match=message):
            run(op, k_new, v_new, ctx=ctx)
    ctx.state.reset()  # a new sequence may change the layout
    ctx.pos = 0
    k, _ = run(op, np.ones((1, 6), np.float32), np.ones((1, 2), np.float32), ctx=ctx)
    assert k.shape == (1, 6) and k.dtype == np.float32
    with pytest.raises(DistRuntimeError, match="KvState"):
        run(op, rows, rows)  # no state: the executor must supply one


def test_kv_cache_stores_quantized_blocks_unchanged():
    op, ctx = KvCache(), cache_ctx()
    blocks = RNG.integers(0, 256, (2, 5, 34), dtype=np.uint8)  # 2 rows of one Q8_0 block each
    k_new = QuantizedArray(blocks[0, :3], DType.Q8_0, (3, 32))
    k_full, v_full = run(op, k_new, np.zeros((3, 8), np.float32), ctx=ctx)
    ctx.pos = 3
    k_full, _ = run(op, QuantizedArray(blocks[0, 3:], DType.Q8_0, (2, 32)),
                    np.zeros((2, 8), np.float32), ctx=ctx)
    assert isinstance(k_full, QuantizedArray) and k_full.dtype is DType.Q8_0
    assert k_full.shape == (5, 32)
    np.testing.assert_array_equal(k_full.data, blocks[0])


def test_prefill_equals_token_by_token_decode():
    """docs/ops.md, "The pos input": one run over T rows = T runs of one row (Rope, KvCache, Sdpa)."""
    heads = dict(num_heads=4, kv_heads=2, head_dim=6)
    rope, attn = Rope(head_dim=6, rope_dim=4), Sdpa(**heads, causal=True)
    q = RNG.standard_normal((1, 7, 24)).astype(np.float32)
    k = RNG.standard_normal((1, 7, 12)).astype(np.float32)
    v = RNG.standard_normal((1, 7, 12)).astype(np.float32)

    def step(ctx, rows):
        pos = np.array([ctx.pos], np.float32)
        (qr,), (kr,) = run(rope, q[:, rows], pos), run(rope, k[:, rows], pos)
        k_full, v_full = run(KvCache(), kr, v[:, rows], ctx=ctx)
        (out,) = run(attn, qr, k_full, v_full)
        ctx.pos += rows.stop - rows.start
        return out

    prefill = step(cache_ctx(), slice(0, 7))
    ctx = cache_ctx()
    decode = np.concatenate([step(ctx, slice(t, t + 1)) for t in range(7)], axis=1)
    assert decode.dtype == np.float32
    np.testing.assert_allclose(decode, prefill, rtol=1e-5, atol=1e-6)


def test_maths_functions_are_callable_on_their_own():
    q = RNG.standard_normal((2, 4)).astype(np.float32)
    out = A.sdpa(q, q, q, num_heads=1, kv_heads=1, head_dim=4, causal=True)
    np.testing.assert_allclose(out[0], q[0], rtol=1e-6)
    np.testing.assert_allclose(A.flash_attention(q, q, q, num_heads=1, kv_heads=1, head_dim=4,
                                                 causal=True, block=1), out, rtol=1e-6)
