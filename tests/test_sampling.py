"""``dist_runtime.sampling``: the one sampler of every generation path, against a closed-form
reference written here (softmax, Hugging Face's warpers as their docs define them, inverse CDF)."""

from __future__ import annotations

import numpy as np
import pytest

from dist_runtime.errors import SamplingError
from dist_runtime.sampling import Sampling


def _reference(logits: np.ndarray, s: Sampling, u: float) -> int:
    """Temperature, then top-k, top-p, min-p on what is left, then the first index whose
    cumulative probability exceeds ``u`` -- in float64, from the definitions."""
    x = logits.astype(np.float64) / s.temperature
    keep = np.ones(x.shape, bool)
    if s.top_k:
        keep &= x >= np.sort(x)[-s.top_k]
    if s.top_p < 1:
        p = np.where(keep, np.exp(x - x[keep].max()), 0)
        p /= p.sum()
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]  # mass of the more likely tokens
        keep[order[before >= s.top_p]] = False
    if s.min_p:
        p = np.where(keep, np.exp(x - x[keep].max()), 0)
        keep &= p >= s.min_p * p.max()
    p = np.where(keep, np.exp(x - x[keep].max()), 0)
    cdf = np.cumsum(p / p.sum())
    return int(np.count_nonzero(cdf <= u))


@pytest.mark.parametrize("settings", [
    Sampling(temperature=0.7, seed=1), Sampling(temperature=0.8, top_k=5, seed=2),
    Sampling(temperature=1.0, top_p=0.9, seed=3), Sampling(temperature=1.3, min_p=0.1, seed=4),
    Sampling(temperature=0.9, top_k=20, top_p=0.8, seed=5), Sampling(temperature=1.1, top_k=30, top_p=0.95, min_p=0.02, seed=6),
])
def test_the_chain_matches_the_definitions(settings):
    rng = np.random.default_rng(0)
    for trial in range(40):
        logits = (rng.standard_normal((2, 64)) * 3).astype(np.float32)
        u = np.random.default_rng(settings.seed + trial).random(1)[0]
        got = settings.choose(logits, np.random.default_rng(settings.seed + trial))
        assert got == _reference(logits[-1], settings, u)


def test_greedy_takes_the_first_maximum_of_the_last_row():
    logits = np.array([[9, 0, 0], [1, 5, 5]], np.float32)
    assert Sampling().choose(logits, None) == 1


def test_the_same_seed_draws_the_same_tokens():
    s = Sampling(temperature=1.0, top_p=0.95, seed=7)
    logits = np.random.default_rng(1).standard_normal((1, 100)).astype(np.float32)
    a, b = s.rng(), s.rng()
    assert [s.choose(logits, a) for _ in range(20)] == [s.choose(logits, b) for _ in range(20)]


def test_options_as_people_give_them():
    assert Sampling.from_options(seed=1) == Sampling(seed=1)  # nothing given: greedy
    assert Sampling.from_options(top_k=5, seed=1) == Sampling(temperature=1.0, top_k=5, seed=1)
    assert Sampling.from_options(temperature=0.5, top_p=0.9, min_p=0.1, seed=2).filters[1][0] == "min_p"
    assert 0 <= Sampling.from_options().seed < 2 ** 31  # a fresh seed, reported with the results
    with pytest.raises(SamplingError, match="greedy contradicts top_k"):
        Sampling.from_options(greedy=True, top_k=3)


@pytest.mark.parametrize("bad, words", [
    (dict(temperature=-1), "temperature must be a finite number >= 0"),
    (dict(temperature=float("inf")), "temperature must be a finite number"), (dict(temperature=0, top_k=3), "contradicts top_k"),
    (dict(temperature=1, top_p=0), "top_p must be in"), (dict(temperature=1, top_k=-1), "top_k must be"),
    (dict(temperature=1, min_p=2), "min_p must be in"), (dict(seed=-1), "seed must be"),
])
def test_bad_settings_are_refused_by_name(bad, words):
    with pytest.raises(SamplingError, match=words):
        Sampling(**bad)


def test_token_logprobs_are_the_log_softmax_most_likely_first():
    from dist_runtime.sampling import token_logprobs

    logits = np.array([[0.0, 0.0, 0.0], [1.0, 3.0, 1.0]], np.float32)
    got = token_logprobs(logits, 2, 2)  # the last row
    want = np.log(np.exp([1.0, 3.0, 1.0]) / np.exp([1.0, 3.0, 1.0]).sum())
    assert got.logprob == pytest.approx(want[2])
    assert [i for i, _ in got.top] == [1, 0] and got.top[0][1] == pytest.approx(want[1])  # ties: lower id


class _Uniform:
    """A generator whose every draw is ``u``: which token each ``u`` picks shows the kept set."""

    def __init__(self, u: float) -> None:
        self.u = u

    def random(self, n: int) -> np.ndarray:
        return np.full(n, self.u)


@pytest.mark.parametrize("n, top_p, kept", [(4, 0.5, {2, 3}), (4, 0.75, {1, 2, 3}), (8, 0.25, {6, 7}),
                                            (2, 0.5, {1})])
def test_top_p_at_an_exact_tie_keeps_the_smallest_set_reaching_p(n, top_p, kept):
    """n equal logits: each token's probability is exactly 1/n, so the kept tokens' cumulative
    probability equals ``top_p`` exactly; that set is kept, not one token more (docs/ops.md,
    "Sample": drop cumulative ``<= 1 - p`` in ascending order, equal logits in vocabulary order)."""
    s = Sampling(temperature=1.0, top_p=top_p, seed=0)
    logits = np.zeros((1, n), np.float32)
    drawn = {s.choose(logits, _Uniform(u)) for u in np.linspace(0, 1, 64, endpoint=False)}
    assert drawn == kept
