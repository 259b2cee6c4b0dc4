"""Generation kernels: Sample (greedy and filtered sampling) and the diffusion steps NoiseSchedule
(DDIM, eta = 0) and FlowStep (flow-matching Euler), per docs/ops.md.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from dist_runtime.ir.ops import FlowStep, NoiseSchedule, Sample

from ._common import F32, as_compute, cast_back, compute_dtype, fail
from .elementwise import argmax, softmax
from .positions import scalar
from .registry import register

GREEDY, TEMPERATURE, TOP_K, TOP_P, MIN_P = range(5)


# -- Sample ------------------------------------------------------------------------------------
def filter_logits(logits, *, method: int, temperature: float = 1.0, p: float = 1.0,
                  k: int = 0) -> np.ndarray:
    """The logits divided by the temperature, with the tokens a method drops set to ``-inf``.

    The filters are Hugging Face's ``TopKLogitsWarper``, ``TopPLogitsWarper`` and
    ``MinPLogitsWarper`` with ``min_tokens_to_keep=1``; Python-float parameters stay weak (NEP 50),
    so every comparison is in f32 as in their torch code.
    """
    x = _scaled(as_compute(logits, compute_dtype(logits)), temperature)
    if method == TOP_K:
        n = min(k, x.shape[-1]) - 1  # the k-th largest sits at index n of the descending order
        kth = -np.partition(-x, n, axis=-1)[..., n:n + 1]
        x[x < kth] = -np.inf  # ties with the k-th largest are kept
    elif method == TOP_P:
        order = np.argsort(x, axis=-1, kind="stable")  # ascending
        cumulative = np.cumsum(softmax(np.take_along_axis(x, order, axis=-1)), axis=-1)
        drop_sorted = cumulative <= (1 - p)
        drop_sorted[..., -1] = False  # always keep the most likely token
        drop = np.empty_like(drop_sorted)
        np.put_along_axis(drop, order, drop_sorted, axis=-1)
        x[drop] = -np.inf
    elif method == MIN_P:
        probs = softmax(x)
        x[probs < p * probs.max(axis=-1, keepdims=True)] = -np.inf
    elif method != TEMPERATURE:
        raise fail("Sample", f"method={method} is not 0 (greedy), 1, 2, 3 or 4")
    return x


def _scaled(x: np.ndarray, temperature: float) -> np.ndarray:
    """``x / temperature``; where a tiny temperature overflows finite logits to +-inf (whose
    softmax is NaN), the logits are shifted by their row's maximum first -- the same distribution
    (softmax and every filter are shift-invariant), which then tends to greedy as it should."""
    with np.errstate(over="ignore"):
        out = x / temperature
    if not np.isfinite(out).all() and np.isinf(out[np.isfinite(x)]).any():  # the common case: one pass
        with np.errstate(over="ignore", invalid="ignore"):
            out = (x - np.max(x, axis=-1, keepdims=True)) / temperature
    return out


def draw(filtered: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Inverse-CDF draw per row: the first index whose cumulative probability exceeds ``u``."""
    probs = softmax(filtered)
    cdf = np.cumsum(probs, axis=-1)
    ids = np.count_nonzero(cdf <= u.reshape(*cdf.shape[:-1], 1), axis=-1)
    # Rounding can leave the total just below u; then the draw is the last token still kept.
    last_kept = probs.shape[-1] - 1 - np.argmax(probs[..., ::-1] > 0, axis=-1)
    return np.asarray(np.minimum(ids, last_kept), dtype=np.int64)


def sample(logits, seed=None, *, method: int = GREEDY, temperature: float = 1.0, p: float = 1.0,
           k: int = 0, rng: np.random.Generator | None = None) -> np.ndarray:
    """Token ids ``[...]`` (I64) from ``logits [..., V]``; ``seed`` overrides ``rng``."""
    if logits.shape[-1] == 0:
        raise fail("Sample", f"logits {list(logits.shape)} have an empty vocabulary (last dim 0)")
    if method == GREEDY:
        return argmax(logits)
    filtered = filter_logits(logits, method=method, temperature=temperature, p=p, k=k)
    if seed is not None:
        value = scalar("Sample", "seed", seed)
        if not (isinstance(value, int) and value >= 0):
            raise fail("Sample", f"seed must be an integer >= 0, got {value!r}")
        rng = np.random.default_rng(value)
    elif rng is None:
        raise fail("Sample", f"method {method} draws at random but has neither a seed input nor "
                             f"the session's generator (ctx.rng)")
    rows = int(np.prod(filtered.shape[:-1]))
    return draw(filtered, rng.random(rows))


@register(Sample)
def _sample(op, inputs, ctx):
    logits, *seed = inputs
    return (sample(logits, *seed, method=op.method, temperature=op.temperature, p=op.p, k=op.k,
                   rng=ctx.rng),)


# -- NoiseSchedule -----------------------------------------------------------------------------
LINEAR, SCALED_LINEAR, SQUAREDCOS_CAP_V2 = range(3)
EPSILON, V_PREDICTION, SAMPLE = range(3)


@functools.lru_cache(maxsize=16)
def alphas_cumprod(num_train_timesteps: int, beta_start: float, beta_end: float,
                   beta_schedule: int) -> np.ndarray:
    """``cumprod(1 - betas)`` of a training schedule, f32 as diffusers keeps it (read-only)."""
    n = num_train_timesteps
    if beta_schedule == LINEAR:
        betas = np.linspace(beta_start, beta_end, n).astype(F32)
    elif beta_schedule == SCALED_LINEAR:
        betas = np.linspace(beta_start ** 0.5, beta_end ** 0.5, n).astype(F32) ** 2
    elif beta_schedule == SQUAREDCOS_CAP_V2:  # betas_for_alpha_bar: in double, then f32
        def abar(s):
            return np.cos((s + 0.008) / 1.008 * np.pi / 2) ** 2

        i = np.arange(n, dtype=np.float64)
        betas = np.minimum(1 - abar((i + 1) / n) / abar(i / n), 0.999).astype(F32)
    else:
        raise fail("NoiseSchedule", f"beta_schedule={beta_schedule} is not 0, 1 or 2")
    table = np.cumprod(1 - betas, dtype=F32)
    table.flags.writeable = False
    return table


def _timestep(what: str, value) -> int:
    """A timestep input, rounded to the nearest integer (docs/ops.md)."""
    value = scalar("NoiseSchedule", what, value)
    if not math.isfinite(value):
        raise fail("NoiseSchedule", f"{what}={value} is not a finite timestep")
    return int(round(value))


def noise_schedule(sample, model_output, t, t_prev, *, num_train_timesteps: int = 1000,
                   beta_start: float = 0.0001, beta_end: float = 0.02, beta_schedule: int = LINEAR,
                   prediction_type: int = EPSILON) -> np.ndarray:
    """One DDIM step (eta = 0) from ``t`` to ``t_prev``, as diffusers ``DDIMScheduler.step``."""
    n = num_train_timesteps
    t, t_prev = _timestep("t", t), _timestep("t_prev", t_prev)
    if not 0 <= t < n or t_prev >= n:
        raise fail("NoiseSchedule", f"timesteps t={t}, t_prev={t_prev} are outside the training "
                                    f"schedule: t must be in [0, {n}) and t_prev < {n}")
    table = alphas_cumprod(n, beta_start, beta_end, beta_schedule)
    # numpy f32 scalars: the coefficients are f32, as diffusers' 0-d tensors are.
    a_t = table[t]
    a_prev = table[t_prev] if t_prev >= 0 else table[0]  # set_alpha_to_one=False
    b_t = 1 - a_t
    dtype = compute_dtype(sample, model_output)
    x, out = as_compute(sample, dtype), as_compute(model_output, dtype)
    if prediction_type == EPSILON:
        x0, eps = (x - np.sqrt(b_t) * out) / np.sqrt(a_t), out
    elif prediction_type == SAMPLE:
        x0 = out
        eps = (x - np.sqrt(a_t) * x0) / np.sqrt(b_t)
    elif prediction_type == V_PREDICTION:
        x0 = np.sqrt(a_t) * x - np.sqrt(b_t) * out
        eps = np.sqrt(a_t) * out + np.sqrt(b_t) * x
    else:
        raise fail("NoiseSchedule", f"prediction_type={prediction_type} is not 0, 1 or 2")
    return cast_back(np.sqrt(a_prev) * x0 + np.sqrt(1 - a_prev) * eps, sample)


@register(NoiseSchedule)
def _noise_schedule(op, inputs, ctx):
    return (noise_schedule(*inputs, num_train_timesteps=op.num_train_timesteps,
                           beta_start=op.beta_start, beta_end=op.beta_end,
                           beta_schedule=op.beta_schedule, prediction_type=op.prediction_type),)


# -- FlowStep ----------------------------------------------------------------------------------
def shifted_sigma(u: float, shift: float) -> np.float32:
    """``shift * u / (1 + (shift - 1) * u)`` in f32 (SD3's timestep shift)."""
    u = F32.type(u)
    return shift * u / (1 + (shift - 1) * u)


def flow_step(sample, velocity, t, t_next, *, shift: float = 1.0) -> np.ndarray:
    """Euler step of flow matching: ``sample + (sigma(t_next) - sigma(t)) * velocity``."""
    dt = (shifted_sigma(scalar("FlowStep", "t_next", t_next), shift)
          - shifted_sigma(scalar("FlowStep", "t", t), shift))
    dtype = compute_dtype(sample, velocity)
    return cast_back(as_compute(sample, dtype) + dt * as_compute(velocity, dtype), sample)


@register(FlowStep)
def _flow_step(op, inputs, ctx):
    return (flow_step(*inputs, shift=op.shift),)
