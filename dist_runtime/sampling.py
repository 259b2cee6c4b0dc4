"""How the next token is chosen: one ``Sampling`` for every generation path.

The in-process executor path, the pipeline's coordinator, the command line and (later) the server
all choose tokens here, with the maths of the ``Sample`` op (``kernels.generation``): greedy when the
temperature is 0, otherwise Hugging Face's warpers in Hugging Face's order -- temperature, top-k,
top-p, min-p -- each applied to what the previous one kept, then one inverse-CDF draw from the
session's own seeded generator.  Two sessions with the same settings and seed draw the same tokens
however their steps interleave, in one process or across stages.
"""

from __future__ import annotations

import secrets
from dataclasses import asdict, dataclass
from typing import NamedTuple

import numpy as np

from .errors import DistRuntimeError, SamplingError
from .kernels.elementwise import argmax
from .kernels.generation import MIN_P, TEMPERATURE, TOP_K, TOP_P, draw, filter_logits


@dataclass(frozen=True)
class Sampling:
    """``temperature`` 0 is greedy (the default); otherwise any of ``top_k`` (0: off), ``top_p``
    (1: off) and ``min_p`` (0: off) filter, in that order.  ``seed`` seeds the session's generator."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        checks = [(0 <= self.temperature < float("inf"), "temperature must be a finite number >= 0"),
                  (self.top_k >= 0, "top_k must be >= 0"),
                  (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
                  (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
                  (self.seed >= 0, "seed must be >= 0")]
        problem = next((msg for ok, msg in checks if not ok), None)
        if problem is None and self.greedy and self.filters:
            problem = "temperature 0 (greedy) contradicts " + ", ".join(name for name, _, _ in self.filters)
        if problem:
            raise SamplingError(f"invalid sampling settings: {problem} ({self.describe()})")

    @classmethod
    def from_options(cls, *, greedy: bool = False, temperature: float | None = None, top_k: int | None = None,
                     top_p: float | None = None, min_p: float | None = None, seed: int | None = None) -> Sampling:
        """Settings as people give them: a filter without a temperature samples at temperature 1
        (transformers' ``do_sample=True``); nothing given is greedy; no seed is a fresh one."""
        given = [name for name, v in (("top_k", top_k), ("top_p", top_p), ("min_p", min_p)) if v is not None]
        if greedy and (given or (temperature or 0) > 0):
            raise SamplingError(f"greedy contradicts {', '.join(given or ['temperature'])}")
        if temperature is None:
            temperature = 1.0 if given else 0.0
        return cls(temperature=float(temperature), top_k=top_k or 0, top_p=1.0 if top_p is None else top_p,
                   min_p=min_p or 0.0, seed=fresh_seed() if seed is None else seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def filters(self) -> list[tuple[str, int, dict]]:
        """The filters in force, in the order they apply: (name, method, parameters)."""
        chain = [("top_k", TOP_K, {"k": self.top_k}, self.top_k > 0),
                 ("top_p", TOP_P, {"p": self.top_p}, self.top_p < 1.0),
                 ("min_p", MIN_P, {"p": self.min_p}, self.min_p > 0.0)]
        return [(name, method, params) for name, method, params, on in chain if on]

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in asdict(self).items())

    def with_seed(self, seed: int) -> Sampling:
        return Sampling(self.temperature, self.top_k, self.top_p, self.min_p, seed)

    def rng(self) -> np.random.Generator:
        return np.random.default_rng(self.seed)

    def choose(self, logits: np.ndarray, rng: np.random.Generator) -> int:
        """The next token from the last row of ``logits [..., V]``."""
        logits = np.asarray(logits)
        if logits.ndim == 0 or logits.shape[-1] == 0:
            raise DistRuntimeError(f"cannot sample from logits of shape {list(logits.shape)}")
        row = logits.reshape(-1, logits.shape[-1])[-1:]
        if self.greedy:
            return int(argmax(row)[0])
        row = filter_logits(row, method=TEMPERATURE, temperature=self.temperature)
        for _, method, params in self.filters:
            row = filter_logits(row, method=method, **params)
        return int(draw(row, rng.random(1))[0])


def fresh_seed() -> int:
    """A seed for a run that was given none (reported with the results, so it can be repeated)."""
    return secrets.randbits(31)


class TokenLogprobs(NamedTuple):
    """A chosen token's log-probability and the most likely tokens' (id, log-probability), most
    likely first; of the model's distribution (the logits before temperature and filters)."""

    logprob: float
    top: tuple[tuple[int, float], ...]


def token_logprobs(logits: np.ndarray, token: int, k: int) -> TokenLogprobs:
    """:class:`TokenLogprobs` of ``token`` and the ``k`` most likely tokens (ties: lower id first)
    from the last row of ``logits [..., V]``."""
    row = np.asarray(logits, np.float64).reshape(-1, np.shape(logits)[-1])[-1]
    shifted = row - row.max()
    logp = shifted - np.log(np.exp(shifted).sum())
    top = np.argsort(-logp, kind="stable")[:k]
    return TokenLogprobs(float(logp[token]), tuple((int(i), float(logp[i])) for i in top))
