"""The generation kernels (kernels/generation.py) against independent references.

* Sample's filters against Hugging Face's logits warpers, and its draws against the warpers'
  distribution (chi-square on 20k seeded draws) and an inverse CDF written here.
* NoiseSchedule against diffusers ``DDIMScheduler.step(eta=0)`` (3 beta schedules x 3 prediction
  types), FlowStep against ``FlowMatchEulerDiscreteScheduler.step`` over whole schedules.

Fixtures: tests/fixtures/kernels/generation.npz, written by
tests/fixtures/make_generation_fixtures.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

import dist_runtime.kernels.generation as G
from dist_runtime.errors import DistRuntimeError
from dist_runtime.ir.ops import FlowStep, NoiseSchedule, Sample
from dist_runtime.kernels.registry import KernelContext, kernel_for

FIXTURES = np.load(Path(__file__).parent / "fixtures" / "kernels" / "generation.npz")
LOGITS = FIXTURES["warp.logits"]
WARPS = sorted({k.split(".")[1] for k in FIXTURES.files if k.startswith("warp.")} - {"logits"})


def run(op, *inputs, rng=None):
    return kernel_for(type(op))(op, list(inputs), KernelContext(rng=rng))


def sample_op(name) -> Sample:
    method, temperature, p, k = FIXTURES[f"warp.{name}.params"]
    return Sample(method=int(method), temperature=float(temperature), p=float(p), k=int(k))


def hf_probs(name) -> np.ndarray:
    """The distribution HF samples from: softmax of the warped logits, in f64."""
    warped = FIXTURES[f"warp.{name}"].astype(np.float64)
    e = np.exp(warped - warped.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


# -- Sample ------------------------------------------------------------------------------------
def test_greedy_takes_the_first_maximum_without_randomness():
    logits = np.array([[0.0, 2.0, 2.0, 1.0], [5.0, -1.0, 5.0, 0.0]], np.float16)
    (ids,) = run(Sample(method=0), logits)  # no rng at all
    assert ids.dtype == np.int64 and ids.tolist() == [1, 0]
    (one,) = run(Sample(method=0), LOGITS[2])
    assert one.shape == () and int(one) == int(np.argmax(LOGITS[2]))


@pytest.mark.parametrize("name", WARPS)
def test_filter_matches_hf_warpers(name):
    op = sample_op(name)
    got = G.filter_logits(LOGITS, method=op.method, temperature=op.temperature, p=op.p, k=op.k)
    expected = FIXTURES[f"warp.{name}"]
    assert got.dtype == np.float32
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(expected), err_msg="kept set")
    kept = ~np.isneginf(expected)
    np.testing.assert_allclose(got[kept], expected[kept], rtol=1e-6, atol=1e-6)


def chi_square_critical(df: int, z: float = 3.719) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile; z = 3.719 is p = 1e-4."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("name", [n for n in WARPS if not n.endswith("p0") and n != "min_p1"])
def test_draws_follow_the_filtered_distribution(name):
    op, probs, draws = sample_op(name), hf_probs(name), 20_000
    for row in (0, 3):
        logits = np.broadcast_to(LOGITS[row], (draws, LOGITS.shape[1]))
        (ids,) = run(op, logits, np.array(1234 + row, np.int64))
        counts = np.bincount(ids, minlength=probs.shape[1])
        p = probs[row]
        assert counts[p == 0].sum() == 0, "drew a token the filter dropped"
        seen = p * draws >= 5  # pool the rare tokens into one cell, as chi-square wants
        observed = np.append(counts[seen], counts[~seen].sum())
        expected = np.append(p[seen], p[~seen].sum()) * draws
        observed, expected = observed[expected > 0], expected[expected > 0]
        if len(observed) == 1:  # one token kept: every draw is it (checked above)
            continue
        stat = ((observed - expected) ** 2 / expected).sum()
        assert stat < chi_square_critical(len(observed) - 1), (row, stat)


def test_single_token_filters_are_deterministic():
    for name in ("top_p0", "min_p1", "top_k5"):
        op = sample_op(name)
        (ids,) = run(op, LOGITS[2:], np.array(0, np.int64))
        if name != "top_k5":
            assert ids.tolist() == np.argmax(LOGITS[2:], axis=-1).tolist()


def test_draws_are_the_inverse_cdf_of_a_seeded_uniform():
    """docs/ops.md: u = default_rng(seed).random(rows), row-major; the first index whose cumulative
    probability exceeds u."""
    op = sample_op("top_p09")
    logits = np.stack([LOGITS] * 40).reshape(8, 25, LOGITS.shape[1])  # 200 rows, two batch dims
    (ids,) = run(op, logits, np.array(99, np.int64))
    assert ids.shape == (8, 25) and ids.dtype == np.int64
    u = np.random.default_rng(99).random(200)
    cdf = np.cumsum(hf_probs("top_p09"), axis=-1)
    expected = [np.searchsorted(cdf[r % 5], u[r], side="right") for r in range(200)]
    assert ids.reshape(-1).tolist() == expected


def test_same_seed_same_tokens_and_the_session_generator():
    op = sample_op("temperature")
    a = run(op, LOGITS, np.array(7, np.int64))[0]
    b = run(op, LOGITS, np.array(7, np.int32))[0]
    c = run(op, LOGITS, np.array(7, np.int64), rng=np.random.default_rng(0))[0]  # seed wins
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, c)
    x = run(op, LOGITS, rng=np.random.default_rng(5))[0]
    y = run(op, LOGITS, rng=np.random.default_rng(5))[0]
    np.testing.assert_array_equal(x, y)
    gen = np.random.default_rng(5)
    first, second = run(op, LOGITS, rng=gen)[0], run(op, LOGITS, rng=gen)[0]
    assert first.tolist() != second.tolist()  # the session's generator advances


@pytest.mark.parametrize("method", [G.TEMPERATURE, G.TOP_K, G.TOP_P, G.MIN_P])
def test_a_vanishing_temperature_tends_to_greedy_without_overflow(method):
    """logits / 1e-45 overflows f32 to +-inf (a NaN softmax, a garbage draw): the shifted logits
    give the limit, the most likely token, with no warning; a masked token stays masked."""
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(4, 50)).astype(np.float32)
    logits[:, 0] = -np.inf
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        for t in (1e-45, 1e-30):
            got = G.sample(logits, 3, method=method, temperature=t, p=0.5, k=5)
            assert got.tolist() == np.argmax(logits, axis=-1).tolist()
    ordinary = G.filter_logits(logits, method=G.TEMPERATURE, temperature=0.7)
    assert np.array_equal(ordinary, logits / np.float32(0.7))  # bits kept where nothing overflows


# Exact ties on a filter's boundary.  Equal logits have exactly representable probabilities (1/n
# each, -inf: 0), so the cumulative sums hit the threshold exactly, as the random fixtures never do.
@pytest.mark.parametrize("logits, p, kept", [
    ([0, 0, 0, 0], 0.5, [2, 3]),  # ascending cumulative 1/4, 1/2, 3/4, 1: two tokens reach p = 1/2
    ([0, 0, 0, 0], 0.75, [1, 2, 3]),
    ([0, 0, 0, 0], 0.25, [3]),
    ([-np.inf, 0, 0, -np.inf, 0, 0], 0.5, [4, 5]),  # the dropped tokens' zero mass changes nothing
    ([0] * 8, 0.375, [5, 6, 7]),
])
def test_top_p_keeps_exactly_the_smallest_set_that_reaches_p_at_an_exact_tie(logits, p, kept):
    """docs/ops.md: drop the tokens whose ascending cumulative probability is ``<= 1 - p`` (equal
    logits in vocabulary order): the kept set sums to exactly ``p``, not one token more."""
    x = np.array([logits], np.float32)
    got = G.filter_logits(x, method=G.TOP_P, p=p)
    assert np.flatnonzero(~np.isneginf(got[0])).tolist() == kept
    rows = np.broadcast_to(x, (400, x.shape[1])).copy()  # the Sample op draws only those, each of them
    (ids,) = run(Sample(method=G.TOP_P, temperature=1.0, p=p), rows, np.array(11, np.int64))
    assert sorted(set(ids.tolist())) == kept


@pytest.mark.parametrize("method, k, p, logits, kept", [
    (G.TOP_K, 2, 1.0, [0, 1, 1, 2, 1], [1, 2, 3, 4]),  # ties with the k-th largest are kept
    (G.TOP_K, 4, 1.0, [0, 0, 0, 0], [0, 1, 2, 3]),  # k = V keeps all
    (G.MIN_P, 0, 1.0, [0, 1, 1, -1], [1, 2]),  # probability == p * max is kept (only < is dropped)
])
def test_top_k_and_min_p_keep_what_equals_their_threshold(method, k, p, logits, kept):
    x = np.array([logits], np.float32)
    got = G.filter_logits(x, method=method, p=p, k=k)
    assert np.flatnonzero(~np.isneginf(got[0])).tolist() == kept


def test_f16_logits_and_errors():
    (ids,) = run(sample_op("top_k5"), LOGITS.astype(np.float16), np.array(3, np.int64))
    assert ids.dtype == np.int64 and ids.shape == (5,)
    with pytest.raises(DistRuntimeError, match="neither a seed"):
        run(sample_op("top_k5"), LOGITS)
    with pytest.raises(DistRuntimeError, match="seed must be an integer"):
        run(sample_op("top_k5"), LOGITS, np.array(1.5, np.float32))
    with pytest.raises(DistRuntimeError, match="empty vocabulary"):
        run(Sample(method=0), np.zeros((2, 0), np.float32))


# -- NoiseSchedule -----------------------------------------------------------------------------
DDIM = sorted({".".join(k.split(".")[1:3]) for k in FIXTURES.files if k.startswith("ddim.")})


def ddim(name):
    key = f"ddim.{name}"
    n, beta_start, beta_end, schedule, prediction = FIXTURES[f"{key}.params"]
    op = NoiseSchedule(num_train_timesteps=int(n), beta_start=beta_start, beta_end=beta_end,
                       beta_schedule=int(schedule), prediction_type=int(prediction))
    return op, key


@pytest.mark.parametrize("name", DDIM)
def test_ddim_step_against_diffusers(name):
    op, key = ddim(name)
    sample, model_output = FIXTURES[f"{key}.sample"], FIXTURES[f"{key}.model_output"]
    t, t_prev = FIXTURES[f"{key}.t"]
    (prev,) = run(op, sample, model_output, np.array(t, np.int64), np.array([t_prev], np.float32))
    assert prev.dtype == np.float32
    np.testing.assert_allclose(prev, FIXTURES[f"{key}.prev_sample"], rtol=1e-4, atol=1e-5)


def test_ddim_fixtures_cover_every_schedule_and_prediction():
    combos = {(op.beta_schedule, op.prediction_type) for op, _ in map(ddim, DDIM)}
    assert combos == {(s, p) for s in range(3) for p in range(3)}
    assert any(t_prev < 0 for t_prev in (FIXTURES[f"ddim.{n}.t"][1] for n in DDIM))


def test_ddim_dtypes_rounding_and_errors():
    op, key = ddim(DDIM[0])
    sample, model_output = FIXTURES[f"{key}.sample"], FIXTURES[f"{key}.model_output"]
    t, t_prev = (np.array(v, np.float32) for v in FIXTURES[f"{key}.t"])
    (ref,) = run(op, sample, model_output, t, t_prev)
    (rounded,) = run(op, sample, model_output, t + np.float32(0.4), t_prev - np.float32(0.3))
    np.testing.assert_array_equal(rounded, ref)
    (f64,) = run(op, sample.astype(np.float64), model_output.astype(np.float64), t, t_prev)
    (f16,) = run(op, sample.astype(np.float16), model_output.astype(np.float16), t, t_prev)
    assert f64.dtype == np.float64 and f16.dtype == np.float16
    np.testing.assert_allclose(f64, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(f16.astype(np.float32), ref, rtol=3e-3, atol=3e-3)
    for bad_t, bad_prev in ((1000, 900), (-1, -5), (500, 1000)):
        with pytest.raises(DistRuntimeError, match="outside the training schedule"):
            run(op, sample, model_output, np.array(bad_t), np.array(bad_prev))


# -- FlowStep ----------------------------------------------------------------------------------
@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_flow_step_against_diffusers(shift):
    key = f"flow.shift{shift:g}"
    u, x = FIXTURES[f"{key}.u"], FIXTURES[f"{key}.sample0"]
    op = FlowStep(shift=shift)
    steps = zip(FIXTURES[f"{key}.velocity"], FIXTURES[f"{key}.samples"])
    for i, (velocity, expected) in enumerate(steps):
        (x,) = run(op, x, velocity, u[i:i + 1], u[i + 1:i + 2])
        assert x.dtype == np.float32
        np.testing.assert_allclose(x, expected, rtol=1e-5, atol=1e-6)


def test_flow_step_closed_form():
    sample, velocity = np.ones((2, 3), np.float16), np.full((2, 3), 2.0, np.float16)
    t, t_next = np.array(0.5, np.float32), np.array(0.0, np.float32)
    (y,) = run(FlowStep(shift=3.0), sample, velocity, t, t_next)
    sigma = 3 * 0.5 / (1 + 2 * 0.5)  # 0.75 -> 0
    assert y.dtype == np.float16
    np.testing.assert_allclose(y, 1 - sigma * 2, rtol=1e-3)
