"""What a bound kernel computes, in the terms the compiled program (:mod:`.program`) builds from.

A backend's binder marks a kernel it can hand to the program with one record
(``kernel.computes = Rms(eps)``); the program's builder looks the record's type up in its own
table (``program/builder.py``, :data:`~.program.builder.STEP_CODE`).  A kernel without a record
runs as a step of its own.  The attention chain is known by its class
(:class:`.numba.AttentionChain`), which carries its ops.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rms:
    """RmsNorm of ``x`` by a scale vector: reads ``(x, scale)``, writes ``(out,)``."""

    eps: float


@dataclass(frozen=True)
class SkipRms:
    """``total = x + residual``, then its RmsNorm: reads ``(x, residual, scale)``, writes ``(total, out)``."""

    eps: float


@dataclass(frozen=True)
class Products:
    """``x @ W^T`` for each weight: reads ``(x, W_1, .., W_n)``, writes ``(y_1, .., y_n)`` (a Matmul
    with ``transpose_b``, or a shared launch of several)."""


@dataclass(frozen=True)
class SwiGlu:
    """``silu(x @ W_gate^T) * (x @ W_up^T)``: reads ``(x, W_gate, W_up)``, writes ``(out,)``."""


@dataclass(frozen=True)
class NormProducts:
    """RmsNorm of ``x`` then ``@ W^T``: reads ``(x, scale, W)``, writes ``(out,)``."""

    eps: float
