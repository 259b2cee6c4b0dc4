"""Per-session sampling on the driver, with the maths of ``kernels.generation``.

The stages return logits; the coordinator picks the next token for each session with that
session's settings and its own seeded generator, so two sessions with the same seed and prompt
draw the same tokens however they interleave, and a single-process run with the same settings
draws the same tokens too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dist_runtime.kernels.generation import GREEDY, MIN_P, TEMPERATURE, TOP_K, TOP_P, sample

@dataclass(frozen=True)
class Sampling:
    """``greedy`` (default), or a temperature with at most one filter: ``top_k``, ``top_p`` or
    ``min_p`` (the ``Sample`` op applies one method per call)."""

    temperature: float = 0.0  # 0: greedy
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        filters = sum([self.top_k > 0, self.top_p < 1.0, self.min_p > 0.0])
        if self.temperature < 0 or filters > 1 or self.top_k < 0 or not 0 < self.top_p <= 1 \
                or not 0 <= self.min_p <= 1 or self.seed < 0:
            raise ValueError(f"invalid sampling settings {self}: temperature >= 0, at most one of "
                             "top_k > 0, 0 < top_p < 1, 0 < min_p <= 1, and seed >= 0")

    @property
    def method(self) -> int:
        if self.temperature == 0:
            return GREEDY
        if self.top_k:
            return TOP_K
        if self.top_p < 1.0:
            return TOP_P
        if self.min_p > 0.0:
            return MIN_P
        return TEMPERATURE

    def rng(self) -> np.random.Generator:
        return np.random.default_rng(self.seed)

    def choose(self, logits: np.ndarray, rng: np.random.Generator) -> int:
        """The next token from the last row of ``logits`` [..., V]."""
        row = np.asarray(logits).reshape(-1, logits.shape[-1])[-1:]
        method = self.method
        p = self.top_p if method == TOP_P else self.min_p if method == MIN_P else 1.0
        ids = sample(row, method=method, temperature=float(self.temperature or 1.0), p=float(p),
                     k=int(self.top_k), rng=rng)
        return int(np.asarray(ids).reshape(-1)[0])
